"""What the recording pass's gradient pass hands a measure that asks for gradients
(:class:`~storylens.analysis.record.Needs` ``gradients=True``): :class:`Gradients`, one batch's
head outputs and their gradients, and the model's :class:`Readout` (its final norm and unembedding,
for direct logit attribution). Data only: :mod:`storylens.analysis.record` fills it,
:mod:`storylens.analysis.causal` reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from storylens.analysis.encode import StoryBatch
from storylens.lm import AttentionLM


@dataclass(frozen=True)
class Readout:
    """What DLA reads of the model's output: the final norm (``kind`` ``"layer"`` centres, ``"rms"``
    does not), its gain ``[d_model]`` and ``eps``, and the unembedding ``W_U [vocab, d_model]``."""

    norm: nn.Module
    kind: str
    gain: torch.Tensor
    eps: float
    unembed: torch.Tensor


def readout(lm: AttentionLM) -> Readout | None:
    """The final norm and unembedding of ``lm`` (None where they cannot be told apart: DLA left empty)."""
    module = lm.module
    getter = getattr(module, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    base = getattr(module, "base_model", None) or getattr(module, "transformer", None) or module
    norm = None
    for name in ("ln_f", "norm", "final_layer_norm", "norm_f"):
        norm = norm or getattr(base, name, None)
    if head is None:
        head = getattr(module, "lm_head", None)
    if not isinstance(norm, nn.Module) or head is None or getattr(head, "bias", None) is not None:
        return None
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    name = type(norm).__name__
    if isinstance(norm, nn.LayerNorm):
        kind, eps = "layer", norm.eps
    elif "RMSNorm" in name and not name.startswith("Gemma"):  # Gemma's gain is 1 + weight: left out
        kind, eps = "rms", float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    else:
        return None
    return Readout(norm, kind, w.detach(), float(eps), head.weight.detach())


@dataclass
class Gradients:
    """One batch's forward and backward pass (:func:`storylens.analysis.record.record`): per block
    ``z [batch, pos, head, d_head]`` and ``grad = dL/dz`` (``L`` the batch's summed next-token loss,
    so each story's rows are its own loss's gradient), the batch, and for DLA the final norm's scale
    ``[batch, pos]`` and the model's readout (None: not readable)."""

    batch: StoryBatch
    z: list[torch.Tensor]
    grad: list[torch.Tensor]
    scale: torch.Tensor | None
    readout: Readout | None
    output_weights: list[torch.Tensor] | None  # per block W_O [head, d_head, d_model]

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``after [B, T]``: positions 1 .. len - 1 (after the opening token); ``predicted [B, T]``:
        positions 0 .. len - 2 (those whose next token is in the story)."""
        ids = self.batch.ids
        t = torch.arange(ids.shape[1], device=ids.device)[None, :]
        lengths = self.batch.lengths.to(ids.device)[:, None]
        return (t >= 1) & (t < lengths), t < lengths - 1
