"""What reads the residual stream at the model's output: its final norm and unembedding (:class:`Readout`,
for direct logit attribution and for the weights read through them), and a normalisation's kind and gain
(:func:`norm_kind`), the two kinds storylens folds: LayerNorm, which centres, and RMSNorm, which does not."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

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
    known = norm_kind(norm)
    if known is None:
        return None
    kind, gain, eps = known
    return Readout(norm, kind, gain, eps, head.weight.detach())


def norm_kind(norm: nn.Module) -> tuple[str, torch.Tensor, float] | None:
    """A normalisation's kind (``"layer"``: LayerNorm, which centres; ``"rms"``: RMSNorm, which does not), its gain
    ``[d_model]`` and its ``eps``; None for any other (Gemma's, whose gain is ``1 + weight``, among them)."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    name = type(norm).__name__
    if isinstance(norm, nn.LayerNorm):
        return "layer", w.detach(), float(norm.eps)
    if "RMSNorm" in name and not name.startswith("Gemma"):
        return "rms", w.detach(), float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    return None


def norm_scale(read: Readout, x: torch.Tensor) -> torch.Tensor:
    """``[..., pos]`` float64: what the final norm divides ``x [..., pos, d_model]`` (its input) by."""
    x = x.to(torch.float64)
    spread = x.var(-1, unbiased=False) if read.kind == "layer" else x.pow(2).mean(-1)
    return (spread + read.eps).sqrt()
