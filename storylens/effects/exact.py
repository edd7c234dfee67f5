"""Every head's exact effect over a corpus, at a fraction of a forward pass per head.

A head's exact effect is the change in the stories' mean next-token loss (nats per predicted token,
pooled over every predicted token as perplexity is) when its output ``hook_z`` (before the output
projection) is replaced at every position after the opening token by its corpus mean (``"mean"``) or by
zero (``"zero"``), with a standard error over stories
(:class:`~storylens.engine.accumulate.RatioAccumulator`): the same figure as
:func:`storylens.effects.audit.exact_effects`, for every head, cheaper.

What it costs. Each batch runs once unablated, keeping what every block returned; a head of block ``l``
then reruns only blocks ``l .. L - 1`` (and the output head) from what block ``l - 1`` returned
(:meth:`~storylens.lm.hooks.AttentionLM.skip_blocks`): ``(L - l) / L`` of the blocks' work, about half a
forward pass on average. The heads of one block run together, as copies of the batch along its first
dimension, as many at once as fit :data:`COPY_BYTES` (:func:`copies_at_once`).

The mean is each head's mean ``z`` over every position after the opening token of the stories given
(:func:`~storylens.effects.ablation.head_output_means`: a pass before the ablations), or one passed in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from storylens.core.batching import BATCH_TOKENS, length_batches
from storylens.core.errors import StorylensError
from storylens.core.modes import eval_mode
from storylens.effects.ablation import _pad, head_output_means
from storylens.effects.audit import MODES, story_losses
from storylens.engine.accumulate import RatioAccumulator
from storylens.lm import AttentionLM, Hook, ModelLike, wrap

COPY_BYTES = 256 << 20  # what the copies of a batch run together may take (their hidden states, one layer)


def copies_at_once(lm: AttentionLM, tokens: int, width: int, n: int, budget: int = COPY_BYTES) -> int:
    """How many of ``n`` heads of one block run together on a batch of ``tokens`` padded tokens: what their
    copies hold at once fits ``budget`` bytes, at least one. Per token of a copy: a block's working set,
    about 8 hidden states ``width`` wide (the MLP's 4, queries, keys, values, output) in the model's dtype,
    and the loss's logits, their float32 copy and log-softmax (3 x the vocabulary, 4 bytes each)."""
    per_token = 8 * width * torch.empty((), dtype=lm.dtype).element_size() + 3 * lm.vocab_size * 4
    return max(1, min(n, budget // max(tokens * per_token, 1)))


def _hidden(output: Any) -> torch.Tensor:
    """The hidden states a block returned (a tensor, or the first of a tuple)."""
    return output if isinstance(output, torch.Tensor) else next(o for o in output if isinstance(o, torch.Tensor))


def _repeat(output: Any, k: int, batch: int) -> Any:
    """What a block returned, for ``k`` copies of its batch along the first dimension."""
    if isinstance(output, torch.Tensor):
        return output.repeat(k, *([1] * (output.dim() - 1))) if output.dim() and output.shape[0] == batch else output
    if isinstance(output, tuple):
        return tuple(_repeat(o, k, batch) for o in output)
    return output


def _switch_off(heads: Sequence[int], batch: int, values: torch.Tensor | None) -> Callable[[torch.Tensor, Hook], Any]:
    """A ``hook_z`` edit for copies of a batch: copy ``i`` (rows ``i * batch ..``) has head ``heads[i]``
    replaced after the opening token by ``values[heads[i]]`` (``[head, d]``), or by zero."""

    def replace(z: torch.Tensor, hook: Hook) -> torch.Tensor:  # [copies * batch, pos, head, d]
        z = z.clone()
        for i, h in enumerate(heads):
            rows = slice(i * batch, (i + 1) * batch)
            z[rows, 1:, h] = 0.0 if values is None else values[h].to(device=z.device, dtype=z.dtype)
        return z

    return replace


@torch.inference_mode()
def exact_batch(
    lm: AttentionLM,
    ids: torch.Tensor,
    valid: torch.Tensor,
    modes: Sequence[str],
    means: torch.Tensor | None,
    budget: int = COPY_BYTES,
) -> dict[str, torch.Tensor]:
    """One padded batch: per mode, ``[batch, layer, head]`` float64, each story's summed next-token loss
    with the head switched off minus its unablated one. ``means``: ``[layer, head, head_size]``."""
    B, L, H = ids.shape[0], lm.n_layer, lm.n_head
    with lm.keep_block_outputs(range(L)) as kept:
        clean = story_losses(lm, ids, valid)  # [B]
    out = {m: torch.zeros(B, L, H, dtype=torch.float64) for m in modes}
    # no blocks known (blocks() is None): every pass whole, one copy at a time
    k = copies_at_once(lm, ids.numel(), _hidden(kept[0]).shape[-1], H, budget) if kept else 1
    for layer in range(L):
        for first in range(0, H, k):
            heads = list(range(first, min(first + k, H)))
            many_ids, many_valid = ids.repeat(len(heads), 1), valid.repeat(len(heads), 1)
            start = _repeat(kept[layer - 1], len(heads), B) if layer - 1 in kept else None  # layer 0: whole
            for m in modes:
                values = None if m == "zero" else means[layer]  # type: ignore[index]
                edit = [(f"blocks.{layer}.attn.hook_z", _switch_off(heads, B, values))]
                with lm.hooks(edit), lm.skip_blocks(layer, start) if start is not None else nullcontext():
                    losses = story_losses(lm, many_ids, many_valid).view(len(heads), B)
                out[m][:, layer, first : first + len(heads)] = (losses - clean).T
    return out


@dataclass(eq=False)
class ExactAccumulator:
    """Every head's exact effect per mode, streamed story by story: mergeable in any order, a state as
    plain data, :meth:`columns` ``exact_<mode>`` and ``exact_<mode>_se`` as ``[layer, head]`` grids."""

    n_layer: int
    n_head: int
    modes: tuple[str, ...] = MODES
    means_key: str | None = None  # what mean ablation replaced outputs by (a digest): merged only alike

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise StorylensError(f"exact: modes {', '.join(bad) or '(none)'}: each one of {', '.join(MODES)}")
        self.sums = {m: RatioAccumulator((self.n_layer, self.n_head)) for m in self.modes}

    def add(self, diffs: dict[str, torch.Tensor], tokens: torch.Tensor) -> None:
        """``diffs[mode]`` ``[stories, layer, head]`` (summed loss changes), ``tokens`` ``[stories]`` predicted."""
        for m in self.modes:
            self.sums[m].add(diffs[m], tokens)

    def merge(self, other: ExactAccumulator) -> ExactAccumulator:
        if (other.n_layer, other.n_head, other.modes) != (self.n_layer, self.n_head, self.modes):
            raise ValueError("merge: other heads or modes")
        if other.means_key != self.means_key:
            raise ValueError("merge: the two ablated to other means (each run's mean must be the same)")
        for m in self.modes:
            self.sums[m].merge(other.sums[m])
        return self

    def state(self) -> dict:
        return {"shape": [self.n_layer, self.n_head], "modes": list(self.modes), "means_key": self.means_key} | {
            m: self.sums[m].state() for m in self.modes
        }

    @classmethod
    def from_state(cls, state: dict) -> ExactAccumulator:
        try:
            n_layer, n_head = state["shape"]
            made = cls(n_layer, n_head, tuple(state["modes"]), state["means_key"])
            made.sums = {m: RatioAccumulator.from_state(state[m], (made.n_layer, made.n_head)) for m in made.modes}
        except (KeyError, TypeError, ValueError, StorylensError) as e:
            raise ValueError(f"exact state: {e}") from None
        return made

    @property
    def stories(self) -> int:
        return self.sums[self.modes[0]].count

    def columns(self) -> dict[str, torch.Tensor]:
        cols = {}
        for m in self.modes:
            nats, se = self.sums[m].result()
            cols[f"exact_{m}"], cols[f"exact_{m}_se"] = nats, se
        return cols


def means_digest(means: torch.Tensor) -> str:
    """A short digest of the means mean ablation replaces outputs by (float64 bytes)."""
    return hashlib.sha256(means.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()).hexdigest()[:16]


def exact_head_effects(
    model: ModelLike,
    stories_ids: Sequence[Sequence[int]],
    modes: Sequence[str] = MODES,
    *,
    means: torch.Tensor | None = None,
    batch_size: int = 16,
    budget: int = COPY_BYTES,
    on_batch: Callable[[int], None] | None = None,
) -> ExactAccumulator:
    """Every head's exact effect over ``stories_ids`` (token ids, each story opened by the marker), per
    mode, with its standard error over stories (see the module docstring). ``on_batch(stories)`` after
    each batch (a progress bar)."""
    lm = wrap(model)
    acc = ExactAccumulator(lm.n_layer, lm.n_head, tuple(modes))
    if not stories_ids or any(len(s) < 2 for s in stories_ids):
        raise StorylensError("stories: each needs at least two tokens (one predicted)")
    if "mean" in acc.modes:
        if means is None:
            means = head_output_means(lm, stories_ids, batch_size=batch_size, include_marker=False)
        acc.means_key = means_digest(means)
    with eval_mode(lm.module):
        for idx in length_batches([len(s) for s in stories_ids], batch_size, BATCH_TOKENS):
            ids, valid = _pad([stories_ids[i] for i in idx], lm.marker_id, lm.device)
            diffs = exact_batch(lm, ids, valid, acc.modes, means, budget)
            acc.add(diffs, valid[:, 1:].sum(-1).to(torch.float64).cpu())
            if on_batch is not None:
                on_batch(len(idx))
    return acc
