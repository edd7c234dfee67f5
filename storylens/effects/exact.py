"""Every head's exact effect over a corpus, at a fraction of a forward pass per head.

A head's exact effect is the change in the stories' mean next-token loss (nats per predicted token,
pooled over every predicted token as perplexity is) when its output ``hook_z`` (before the output
projection) is replaced at every position after the opening token by its corpus mean (``"mean"``), by
zero (``"zero"``), or by what it wrote on another story drawn at random (``"resample"``: the donor, from the
same chunk of the corpus, seeded, at least as long where one is, :func:`draw_donors`), with a standard
error over stories
(:class:`~storylens.engine.accumulate.RatioAccumulator`): the same figure as
:func:`storylens.effects.audit.exact_effects`, for every head, cheaper.

What it costs. Each batch runs once unablated, keeping what every block returned; a head of block ``l``
then reruns only blocks ``l .. L - 1`` (and the output head) from what block ``l - 1`` returned
(:meth:`~storylens.lm.hooks.AttentionLM.skip_blocks`): ``(L - l) / L`` of the blocks' work, about half a
forward pass on average. The heads of one block run together, as copies of the batch along its first
dimension, as many at once as fit :data:`COPY_BYTES` (:func:`copies_at_once`).

The mean is each head's mean ``z`` over every position after the opening token of the stories given
(:func:`~storylens.effects.ablation.head_output_means`: a pass before the ablations), or one passed in
(``score --exact`` takes it over the corpus's first stories, a stated number, before the scoring pass).

In a recording pass (``score --exact``) :class:`ExactMeasure` does this per batch, after the recording
(:class:`~storylens.engine.record.RerunMeasure`); :func:`exact_head_effects` runs the same passes on a list.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from storylens.core.batching import BATCH_TOKENS, length_batches, pad_batch, valid_mask
from storylens.core.errors import StorylensError
from storylens.core.heads import Head
from storylens.core.modes import eval_mode
from storylens.core.plain import Plain
from storylens.effects.ablation import head_output_means
from storylens.effects.audit import MODES, story_losses
from storylens.effects.cost import AblationCost, block_flops, head_flops
from storylens.engine.accumulate import RatioAccumulator
from storylens.engine.encode import EncodedStory, StoryBatch, batch_of
from storylens.engine.record import Rerun
from storylens.lm import AttentionLM, Hook, ModelLike, wrap

EXACT_MODES = ("mean", "zero", "resample")  # what a head's output is replaced by (see the module docstring)
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


def _switch_off(groups: Sequence[Sequence[int]], batch: int, value: Callable[[int], Any]) -> Callable:
    """A ``hook_z`` edit for copies of a batch: copy ``i`` (rows ``i * batch ..``) has the heads ``groups[i]``
    replaced after the opening token by ``value(head)`` (0, a ``[d]`` mean, or ``[batch, pos - 1, d]``); one
    group alone is applied to every copy."""

    def replace(z: torch.Tensor, hook: Hook) -> torch.Tensor:  # [copies * batch, pos, head, d]
        z = z.clone()
        for i in range(z.shape[0] // batch):
            for h in groups[i] if len(groups) > 1 else groups[0]:
                v = value(h)
                z[i * batch : (i + 1) * batch, 1:, h] = (
                    v.to(device=z.device, dtype=z.dtype) if torch.is_tensor(v) else v
                )
        return z

    return replace


def _value(mode: str, layer: int, *, means: torch.Tensor | None, donors: list[torch.Tensor] | None) -> Callable:
    """What mode ``mode`` puts in a head's place at block ``layer``, per head (see :func:`_switch_off`)."""
    if mode == "zero":
        return lambda h: 0.0
    if mode == "mean":
        assert means is not None
        return lambda h: means[layer, h]
    assert donors is not None
    return lambda h: donors[layer][:, 1:, h]


def donor_outputs(
    lm: AttentionLM, ids: torch.Tensor, donor_ids: torch.Tensor, donor_lengths: torch.Tensor
) -> list[torch.Tensor]:
    """Per block, ``[batch, pos, head, d]``: what each head wrote on each story's donor (row ``b`` of
    ``donor_ids``, ``donor_lengths[b] >= 2`` real tokens), at the positions of ``ids`` (``[batch, pos]``):
    position ``t`` takes the donor's position ``t``, and past the donor's end its positions again from 1
    (``1 + (t - 1) mod (length - 1)``): the opening token is never a donor's."""
    kept: dict[int, torch.Tensor] = {}

    def keep(z: torch.Tensor, hook: Hook) -> None:
        kept[hook.layer] = z

    with lm.hooks([(f"blocks.{i}.attn.hook_z", keep) for i in range(lm.n_layer)]):
        lm.forward(donor_ids, logits=False)
    T = ids.shape[1]
    t = torch.arange(T, device=donor_lengths.device)[None, :]  # [1, T]
    n = donor_lengths[:, None]  # [B, 1]
    at = torch.where(t < n, t, 1 + (t - 1) % (n - 1)).to(kept[0].device)  # [B, T]
    return [kept[i].gather(1, at[:, :, None, None].expand(-1, -1, *kept[i].shape[2:])) for i in range(lm.n_layer)]


@torch.inference_mode()
def exact_batch(
    lm: AttentionLM,
    ids: torch.Tensor,
    valid: torch.Tensor,
    modes: Sequence[str],
    means: torch.Tensor | None,
    budget: int = COPY_BYTES,
    donors: list[torch.Tensor] | None = None,
    base: Sequence[Head] = (),
) -> dict[str, torch.Tensor]:
    """One padded batch: per mode, ``[batch, layer, head]`` float64, each story's summed next-token loss
    with the head switched off minus its loss without (``base``: heads switched off in every run, that
    reference included: each head's effect with those already off; a head of ``base`` gets 0). ``means``:
    ``[layer, head, head_size]`` (mode ``"mean"``); ``donors``: per block ``[batch, pos, head, d]`` (mode
    ``"resample"``, :func:`donor_outputs`). With ``base``, also ``"<mode>:reference"``: ``[batch]``, each
    story's loss with ``base`` off."""
    B, L, H = ids.shape[0], lm.n_layer, lm.n_head
    off: dict[int, list[int]] = {}
    for h in base:
        off.setdefault(h.layer, []).append(h.head)
    out: dict[str, torch.Tensor] = {}
    reference: tuple[dict, torch.Tensor] | None = None
    for m in modes:
        value = functools.partial(_value, m, means=means, donors=donors)
        if reference is None or off:  # the run every ablation is measured from (with base off: per mode)
            hooks = [(f"blocks.{i}.attn.hook_z", _switch_off([hs], B, value(i))) for i, hs in off.items()]
            with lm.keep_block_outputs(range(L)) as kept, lm.hooks(hooks):
                ref = story_losses(lm, ids, valid)  # [B]
            reference = (dict(kept), ref)
        kept, ref = reference
        # no blocks known (blocks() is None): every pass whole, one copy at a time
        k = copies_at_once(lm, ids.numel(), _hidden(kept[0]).shape[-1], H, budget) if kept else 1
        diffs = torch.zeros(B, L, H, dtype=torch.float64)
        for layer in range(L):
            for first in range(0, H, k):
                heads = list(range(first, min(first + k, H)))
                start = _repeat(kept[layer - 1], len(heads), B) if layer - 1 in kept else None  # layer 0: whole
                here = [[h, *off.get(layer, [])] for h in heads]
                edits = [
                    (f"blocks.{layer}.attn.hook_z", _switch_off(here if len(here) > 1 else [here[0]], B, value(layer)))
                ]
                edits += [
                    (f"blocks.{i}.attn.hook_z", _switch_off([hs], B, value(i))) for i, hs in off.items() if i != layer
                ]
                with lm.hooks(edits), lm.skip_blocks(layer, start) if start is not None else nullcontext():
                    losses = story_losses(lm, ids.repeat(len(heads), 1), valid.repeat(len(heads), 1))
                diffs[:, layer, first : first + len(heads)] = (losses.view(len(heads), B) - ref).T
        for h in base:
            diffs[:, h.layer, h.head] = 0.0
        out[m] = diffs
        if off:
            out[f"{m}:reference"] = ref
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
        bad = [m for m in self.modes if m not in EXACT_MODES]
        if bad or not self.modes or len(set(self.modes)) != len(self.modes):
            raise StorylensError(f"exact: modes {', '.join(bad) or '(none)'}: each one of {', '.join(EXACT_MODES)}")
        self.sums = {m: RatioAccumulator((self.n_layer, self.n_head)) for m in self.modes}

    def add(self, diffs: dict[str, torch.Tensor], tokens: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """``diffs[mode]`` ``[stories, layer, head]`` (summed loss changes), ``tokens`` ``[stories]`` predicted;
        ``keep`` (``[stories]`` bool) the stories resample ablation counts (those with a donor)."""
        for m in self.modes:
            rows = keep if m == "resample" and keep is not None else slice(None)
            self.sums[m].add(diffs[m][rows], tokens[rows])

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
        """The stories behind the mean and zero columns (resample's: :meth:`counts`)."""
        return self.sums[self.modes[0]].count

    def counts(self) -> dict[str, int]:
        """Per mode, the stories its column rests on."""
        return {m: self.sums[m].count for m in self.modes}

    def columns(self) -> dict[str, torch.Tensor]:
        cols = {}
        for m in self.modes:
            nats, se = self.sums[m].result()
            cols[f"exact_{m}"], cols[f"exact_{m}_se"] = nats, se
        return cols


@dataclass(frozen=True, eq=False)
class ExactPlan:
    """What a recording pass's exact ablations do (``score --exact``): ``modes`` of :data:`EXACT_MODES`;
    ``means`` ``[layer, head, head_size]`` what mode ``"mean"`` puts in a head's place (a first pass's,
    over ``mean_stories`` stories); only stories before index ``stories`` (None: every one; ``--exact-stories``);
    ``seed`` draws resample's donors; ``budget`` the bytes a block's copies may take (:func:`copies_at_once`)."""

    modes: tuple[str, ...] = ("mean",)
    means: torch.Tensor | None = None
    mean_stories: int = 0
    stories: int | None = None
    seed: int = 0
    budget: int = COPY_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", tuple(self.modes))
        ExactAccumulator(1, 1, self.modes)  # the modes checked once, here
        if ("mean" in self.modes) != (self.means is not None):
            raise StorylensError("exact: mean ablation needs the heads' means, and only it")
        if self.stories is not None and self.stories < 1:
            raise StorylensError(f"--exact-stories: a whole number, 1 or more (got {self.stories})")

    @property
    def means_key(self) -> str | None:
        return None if self.means is None else means_digest(self.means)

    def settings(self) -> dict:
        """What a checkpoint's fingerprint holds of it (a resumed run must ablate alike)."""
        return {"modes": list(self.modes), "means": self.means_key, "stories": self.stories, "seed": self.seed}


def draw_donors(chunk: Sequence[EncodedStory], stories: Sequence[EncodedStory], seed: int) -> list[EncodedStory | None]:
    """Resample ablation's donor for each of ``stories``: another story of its ``chunk`` drawn at random
    (seeded by ``seed`` and the story's index, so the same in any process and order), among those at
    least as long where there are any (every position then has a donor's output at the same position);
    None where the chunk holds no other story of two tokens or more."""
    out: list[EncodedStory | None] = []
    for s in stories:
        others = sorted((c for c in chunk if c.index != s.index and len(c.ids) >= 2), key=lambda c: c.index)
        pool = [c for c in others if len(c.ids) >= len(s.ids)] or others
        if not pool:
            out.append(None)
            continue
        rng = np.random.default_rng([seed, s.index])
        out.append(pool[int(rng.integers(len(pool)))])
    return out


def resample_donors(
    lm: AttentionLM, ids: torch.Tensor, stories: Sequence[EncodedStory], chunk: Sequence[EncodedStory], seed: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Resample ablation's values for a batch of ``stories`` (``ids``, padded): per block what each head wrote
    on each story's donor (:func:`draw_donors`, :func:`donor_outputs`), and ``[stories]`` bool, those with one."""
    drawn = draw_donors(chunk, stories, seed)
    keep = torch.tensor([d is not None for d in drawn])
    donor_ids, donor_lengths = pad_batch([(d or s).ids for d, s in zip(drawn, stories)], lm.marker_id, ids.device)
    with torch.inference_mode():
        donors = donor_outputs(lm, ids, donor_ids, donor_lengths.clamp(min=2).cpu())  # one token: nothing to replace
    return donors, keep


class ExactMeasure(Rerun):
    """Every head's exact effect as a measure of :func:`~storylens.engine.record.record`: after each
    batch's recording it reruns the batch with each head switched off (:func:`exact_batch`) per
    ``plan`` (:class:`ExactPlan`), into :attr:`acc` (an :class:`ExactAccumulator`)."""

    def __init__(self, n_layer: int, n_head: int, plan: ExactPlan):
        self.plan = plan
        self.acc = ExactAccumulator(n_layer, n_head, plan.modes, plan.means_key)

    def rerun(self, lm: AttentionLM, batch: StoryBatch, chunk: Sequence[EncodedStory]) -> None:
        plan = self.plan
        if not batch.stories:
            raise StorylensError("exact: a batch without its stories (record hands them)")
        rows = [i for i, s in enumerate(batch.stories) if plan.stories is None or s.index < plan.stories]
        if not rows:
            return
        lengths = batch.lengths[rows].cpu()
        T = int(lengths.max())
        ids = batch.ids[rows, :T]
        valid = valid_mask(lengths, T).to(ids.device)
        donors, keep = None, None
        if "resample" in plan.modes:
            donors, keep = resample_donors(lm, ids, [batch.stories[i] for i in rows], chunk, plan.seed)
        diffs = exact_batch(lm, ids, valid, plan.modes, plan.means, plan.budget, donors)
        self.acc.add(diffs, (lengths - 1).to(torch.float64), keep)


LENGTH_STORIES = 500  # score --exact: its cost is estimated from the length of the corpus's first this many stories


def exact_cost(lm: AttentionLM, tokens: float, modes: Sequence[str], mean_tokens: float = 0.0) -> AblationCost:
    """What every head's exact effect costs over stories of ``tokens`` tokens in all, counted before it
    runs as :func:`~storylens.effects.cost.ablate_cost` counts: the unablated run (every block and the
    output head), resample's donor run (every block), and per mode every head of block ``l`` rerunning
    blocks ``l ..`` and the output head; and the means' pass over ``mean_tokens`` tokens (every block)."""
    L, H = lm.n_layer, lm.n_head
    per_mode = H * sum(L - layer for layer in range(L))  # blocks a token runs through, every head once
    blocks = L + (L if "resample" in modes else 0) + len(modes) * per_mode
    outputs = 1 + len(modes) * H * L
    flops = tokens * (blocks * block_flops(lm) + outputs * head_flops(lm)) + mean_tokens * L * block_flops(lm)
    passes = blocks / L + mean_tokens / max(tokens, 1.0)
    return AblationCost(passes=passes, flops=flops, scoring=L * tokens * block_flops(lm))


def fitting_stories(lm: AttentionLM, mean_length: float, modes: Sequence[str], limit: float) -> int:
    """How many stories of ``mean_length`` tokens every head's exact effect fits in ``limit`` FLOP (0: none)."""
    per_story = exact_cost(lm, mean_length, modes).flops
    return int(limit // per_story) if per_story > 0 else 0


@dataclass
class ExactInfo(Plain):
    """summary.json's ``exact``: what the exact columns rest on. ``stories`` per mode (resample's leaves
    out a story with no donor in its chunk); the means over ``mean_stories`` first stories (mean
    ablation); ``limit`` the first stories it covers (None: every story); ``seed`` resample's donors; ``chosen``
    how the stories were chosen: ``"asked"`` (``--exact``, ``--exact-stories``) or ``"budget"`` (``score --causal``
    alone: as many as the report's ablation budget allows)."""

    modes: list[str]
    stories: dict[str, int]
    mean_stories: int
    limit: int | None
    seed: int
    chosen: str = "asked"


def exact_info(plan: ExactPlan, acc: ExactAccumulator, chosen: str = "asked") -> ExactInfo:
    return ExactInfo(list(plan.modes), acc.counts(), plan.mean_stories, plan.stories, plan.seed, chosen)


def means_digest(means: torch.Tensor) -> str:
    """A short digest of the means mean ablation replaces outputs by (float64 bytes)."""
    return hashlib.sha256(means.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()).hexdigest()[:16]


def exact_head_effects(
    model: ModelLike,
    stories_ids: Sequence[Sequence[int]],
    modes: Sequence[str] = MODES,
    *,
    means: torch.Tensor | None = None,
    seed: int = 0,
    batch_size: int = 16,
    budget: int = COPY_BYTES,
    on_batch: Callable[[int], None] | None = None,
) -> ExactAccumulator:
    """Every head's exact effect over ``stories_ids`` (token ids, each story opened by the marker), per
    mode of :data:`EXACT_MODES`, with its standard error over stories (see the module docstring): the
    same passes as ``score --exact``, the stories one chunk (resample's donors drawn from all of them,
    ``seed``). ``means``: mean ablation's values (default: the heads' means over these stories).
    ``on_batch(stories)`` after each batch (a progress bar)."""
    measure = on_list(model, stories_ids, modes, means, seed, batch_size, budget, ExactMeasure, on_batch)
    return measure.acc


M = TypeVar("M", bound=Rerun)


def on_list(
    model: ModelLike,
    stories_ids: Sequence[Sequence[int]],
    modes: Sequence[str],
    means: torch.Tensor | None,
    seed: int,
    batch_size: int,
    budget: int,
    make: Callable[[int, int, ExactPlan], M],
    on_batch: Callable[[int], None] | None = None,
) -> M:
    """``make(n_layer, n_head, plan)``'s measure run over ``stories_ids`` as ``score`` runs it over a chunk: the
    stories one chunk, batched by length; ``means`` (None: the heads' means over these stories)."""
    lm = wrap(model)
    if not stories_ids or any(len(s) < 2 for s in stories_ids):
        raise StorylensError("stories: each needs at least two tokens (one predicted)")
    if "mean" in modes and means is None:
        means = head_output_means(lm, stories_ids, batch_size=batch_size, include_marker=False)
    plan = ExactPlan(tuple(modes), means if "mean" in modes else None, len(stories_ids), seed=seed, budget=budget)
    measure = make(lm.n_layer, lm.n_head, plan)
    chunk = [EncodedStory(i, tuple(int(t) for t in s), False, None, (), ()) for i, s in enumerate(stories_ids)]
    with eval_mode(lm.module):
        for idx in length_batches([len(s) for s in stories_ids], batch_size, BATCH_TOKENS):
            measure.rerun(lm, batch_of([chunk[i] for i in idx], lm.marker_id, lm.device), chunk)
            if on_batch is not None:
                on_batch(len(idx))
    return measure
