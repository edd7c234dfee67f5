"""Estimates of every head's effect on the loss, beside the exact effect (:mod:`storylens.effects.exact`), and
their audit against it.

Every estimate here differentiates one function. Head ``h`` of block ``l`` gets a scalar ``a`` per story:
its output after the opening token becomes ``z + a (z' - z)`` (``z'`` what the ablation puts there: the mean,
zero, or the donor's output), so ``a = 0`` is the run and ``a = 1`` the ablated run, and the exact effect is
``f(1) - f(0)`` of ``f(a)``, the story's summed next-token loss. ``df/da = dL/dz . (z' - z)``.

``atp``
    attribution patching: ``f'(0)``, every head from one forward and one backward pass.
``atp*``
    AtP* (Kramár et al. 2024, arXiv 2403.00745) with GradDrop: ``f'(0)`` again once per block ``j`` with the
    gradient through block ``j``'s contribution to the residual stream dropped, and the estimate the mean of
    their sizes, ``sum_j |AtP_{drop j}| / (L - 1)`` (the paper's form: a size, no sign). It finds heads whose
    paths cancel (a trained model's own loss is near a stationary point, where they do), at one backward
    pass per block more (vector-Jacobian products from each block's contribution). The paper's other fix, for
    saturated attention (the QK fix), recomputes a softmax where the patched node is a query or a key: a head's
    output is patched after its own softmax, to a value computed exactly (a mean, zero, another run's), so for
    these nodes AtP* is AtP with GradDrop.
``ig``
    integrated gradients along the straight path from the run's outputs to the ablated ones, the heads of
    one block moved together (EAP-IG's "activations" variant, Hanna et al. 2024, one path per block):
    ``mean_k f_h'(a_k)`` at the midpoints ``a_k = (k + 1/2) / m`` of ``m`` steps (``--ig-steps``; EAP-IG
    sums at ``k / m``, k = 1..m, from the corrupted end). A head alone on its path (:func:`path_slopes`)
    converges to its exact effect as ``1 / m^2`` (the midpoint rule); with its block, it says the head's
    share of the block's joint effect.
``quadratic``
    the second-order estimate, since the first order vanishes where the model is trained: ``f'(0) +
    f''(0) / 2``, taken as the slope half way, ``f'(1/2)`` (equal to third order, and exact where ``f`` is
    quadratic), each head alone: one forward and backward pass per head from its own block on.

Each is a sum over stories divided by the stories' predicted tokens, with the ratio estimator's standard
error (:class:`~storylens.engine.accumulate.RatioAccumulator`), as the exact effect is.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from storylens.core.batching import valid_mask
from storylens.core.errors import StorylensError
from storylens.core.heads import Head
from storylens.core.plain import Plain
from storylens.effects.audit import MODES, Effect, _sign_disagrees, exact_effects, story_losses
from storylens.effects.cost import block_flops, head_flops
from storylens.effects.exact import (
    COPY_BYTES,
    ExactPlan,
    _hidden,
    _repeat,
    copies_at_once,
    on_list,
    resample_donors,
)
from storylens.engine.accumulate import RatioAccumulator
from storylens.engine.encode import EncodedStory, StoryBatch
from storylens.engine.gradients import frozen_weights
from storylens.engine.ranks import rank_correlation
from storylens.engine.record import Rerun
from storylens.lm import AttentionLM, Hook, HookFn, ModelLike

ESTIMATORS = ("atp", "atp*", "ig", "quadratic")
IG_STEPS = 4  # ig's default steps (benchmarks/estimators.json: its audit changes little past it)

Target = Callable[[int], Any]  # block -> what its heads' outputs move towards: 0.0, [head, d] or [batch, pos, head, d]
# (logits of k copies of a batch, k) -> [k * batch] what is estimated (None: each story's summed next-token loss)
Metric = Callable[[torch.Tensor, int], torch.Tensor]


def _measured(lm: AttentionLM, ids: torch.Tensor, valid: torch.Tensor, metric: Metric | None, copies: int = 1):
    """``[copies * batch]``: ``metric`` (default: each story's summed next-token loss) on ``copies`` copies of
    the batch, run as they are (with whatever edits are on)."""
    ids = ids.repeat(copies, 1)
    if metric is None:
        return story_losses(lm, ids, valid.repeat(copies, 1))
    logits = lm.forward(ids)
    assert logits is not None
    return metric(logits, copies)


def _target(mode: str, means: torch.Tensor | None, donors: list[torch.Tensor] | None) -> Target:
    if mode == "zero":
        return lambda layer: 0.0
    if mode == "mean":
        assert means is not None
        return lambda layer: means[layer]
    assert donors is not None
    return lambda layer: donors[layer]


def _mover(alpha: torch.Tensor, target: Any) -> HookFn:
    """A ``hook_z`` edit: ``z + alpha (target - z)`` after the opening token, ``alpha`` ``[rows, head]``
    (a leaf: its gradient is each head's ``df/da``), ``target`` 0, ``[head, d]`` or ``[rows', pos, head, d]``
    (``rows'`` dividing ``rows``: copies of a batch)."""

    def move(z: torch.Tensor, hook: Hook) -> torch.Tensor | None:  # [rows, pos, head, d]
        t = target
        if torch.is_tensor(t):
            t = t.to(device=z.device, dtype=z.dtype)
            if t.dim() == 4 and t.shape[0] != z.shape[0]:
                t = t.repeat(z.shape[0] // t.shape[0], 1, 1, 1)
        after = torch.ones(z.shape[1], device=z.device, dtype=z.dtype)
        after[0] = 0.0
        return z + alpha.to(z.dtype)[:, None, :, None] * (t - z) * after[None, :, None, None]

    return move


def slopes_at_zero(
    lm: AttentionLM, ids: torch.Tensor, valid: torch.Tensor, target: Target, drop: bool = False,
    metric: Metric | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``f'(0)`` of every head, ``[batch, layer, head]`` float64 (AtP); with ``drop``, also ``[drop, batch,
    layer, head]``: the same with the gradient through block ``drop``'s contribution to the residual stream
    (its output minus its input) dropped: for a head of block ``l``, unchanged for ``drop < l``, zero for
    ``drop == l``, and less the vector-Jacobian product from that contribution for ``drop > l``."""
    B, L, H = ids.shape[0], lm.n_layer, lm.n_head
    with torch.inference_mode(False), frozen_weights(lm.module), torch.enable_grad():
        ids = ids.clone()  # not an inference tensor (a recording runs in inference mode)
        alphas = [torch.zeros(B, H, device=ids.device, dtype=lm.dtype, requires_grad=True) for _ in range(L)]
        edits = [(f"blocks.{i}.attn.hook_z", _mover(alphas[i], target(i))) for i in range(L)]
        with lm.hooks(edits), lm.keep_block_outputs(range(L) if drop else ()) as kept:
            total = _measured(lm, ids, valid.clone(), metric).sum()
        if not drop:
            g = _or_zeros(torch.autograd.grad(total, alphas, allow_unused=True), alphas)
            return torch.stack(g, 1).to(torch.float64).cpu(), None
        if len(kept) != L:
            raise StorylensError(f"atp*: {lm.name}'s blocks cannot be reached (GradDrop needs each block's output)")
        hs = [_hidden(kept[i]) for i in range(L)]
        grads = _or_zeros(torch.autograd.grad(total, alphas + hs, retain_graph=True, allow_unused=True), alphas + hs)
        g, G = grads[:L], grads[L:]
        atp = torch.stack(g, 1)  # [B, L, H]
        dropped = atp.unsqueeze(0).repeat(L, 1, 1, 1)  # [drop, B, L, H]
        for j in range(L):
            if L > 1:  # one block: nothing to drop (AtP* is AtP's size)
                dropped[j, :, j] = 0.0
            if j == 0:
                continue
            contribution = hs[j] - hs[j - 1]  # what block j adds to the residual stream
            through = torch.autograd.grad(contribution, alphas[:j], G[j], retain_graph=True, allow_unused=True)
            for i, v in enumerate(_or_zeros(through, alphas[:j])):
                dropped[j, :, i] = g[i] - v
    return atp.detach().to(torch.float64).cpu(), dropped.detach().to(torch.float64).cpu()


def _or_zeros(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients with zeros where the loss does not depend on the tensor (a head whose output nothing reads)."""
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, like, strict=True)]


def path_slopes(
    lm: AttentionLM,
    ids: torch.Tensor,
    valid: torch.Tensor,
    layer: int,
    paths: Sequence[tuple[Sequence[int], float]],
    target: Target,
    start: Any | None,
    budget: int = COPY_BYTES,
    metric: Metric | None = None,
) -> torch.Tensor:
    """``[path, batch, head]`` float64: at each of ``paths`` (heads of block ``layer`` moved together, to
    ``a``), each head's ``df/da`` (read for the path's own heads). The paths run as copies of the batch, as
    many at once as fit ``budget``, from ``start`` (what block ``layer - 1`` returned: blocks before it do not
    run again; None: every block)."""
    B, H = ids.shape[0], lm.n_head
    width = _hidden(start).shape[-1] if start is not None else lm.head_output_weights(0).shape[0]
    k = copies_at_once(lm, 3 * ids.numel(), width, len(paths), budget)  # a backward holds about 3x a forward
    with torch.inference_mode(False), frozen_weights(lm.module), torch.enable_grad():
        ids, valid = ids.clone(), valid.clone()
        out = torch.zeros(len(paths), B, H, dtype=torch.float64)
        for first in range(0, len(paths), k):
            part = paths[first : first + k]
            alpha = torch.zeros(len(part), B, H, device=ids.device, dtype=lm.dtype)
            for i, (heads, a) in enumerate(part):
                alpha[i, :, list(heads)] = a
            alpha.requires_grad_()
            edit = [(f"blocks.{layer}.attn.hook_z", _mover(alpha.view(len(part) * B, H), target(layer)))]
            begin = _repeat(start, len(part), B) if start is not None else None
            with lm.hooks(edit), lm.skip_blocks(layer, begin) if begin is not None else nullcontext():
                total = _measured(lm, ids, valid, metric, len(part)).sum()
            (g,) = torch.autograd.grad(total, alpha)
            out[first : first + len(part)] = g.to(torch.float64).cpu()
    return out


def _kept_outputs(lm: AttentionLM, ids: torch.Tensor) -> dict[int, Any]:
    """What every block returned on ``ids``, without a graph (the paths' starting points)."""
    with torch.inference_mode(False), torch.no_grad(), lm.keep_block_outputs(range(lm.n_layer)) as kept:
        lm.forward(ids.clone(), logits=False)
    return dict(kept)


def estimate_batch(
    lm: AttentionLM,
    ids: torch.Tensor,
    valid: torch.Tensor,
    estimator: str,
    target: Target,
    steps: int = IG_STEPS,
    budget: int = COPY_BYTES,
    metric: Metric | None = None,
) -> torch.Tensor:
    """``[batch, layer, head]`` float64: each story's ``estimator`` estimate of each head's change in its
    summed loss, or in ``metric`` (for ``atp*``: ``[drop, batch, layer, head]``, the sizes taken over the
    stories)."""
    L, H = lm.n_layer, lm.n_head
    if estimator in ("atp", "atp*"):
        atp, dropped = slopes_at_zero(lm, ids, valid, target, drop=estimator == "atp*", metric=metric)
        return atp if dropped is None else dropped
    kept = _kept_outputs(lm, ids)
    out = torch.zeros(ids.shape[0], L, H, dtype=torch.float64)
    for layer in range(L):
        start = kept.get(layer - 1) if layer > 0 else None
        if estimator == "ig":
            points = [(k + 0.5) / steps for k in range(steps)]
            out[:, layer] = path_slopes(
                lm, ids, valid, layer, [(range(H), a) for a in points], target, start, budget, metric
            ).mean(0)
        elif estimator == "quadratic":
            s = path_slopes(lm, ids, valid, layer, [([h], 0.5) for h in range(H)], target, start, budget, metric)
            out[:, layer] = torch.stack([s[h, :, h] for h in range(H)], -1)
        else:
            raise StorylensError(f"--estimator: one of {', '.join(ESTIMATORS)} (got {estimator!r})")
    return out


class EstimateAccumulator:
    """One estimator's estimates per mode, streamed like the exact effect's: ``[layer, head]`` columns
    ``<estimator>_<mode>`` and ``_se``. For ``atp*`` the sums are kept per dropped block, and the column is
    ``sum_j |r_j| / (L - 1)`` of their pooled ratios ``r_j``, its error bounded by ``sum_j se_j / (L - 1)``
    (the triangle inequality: the terms' correlations unknown, the bound holds whatever they are)."""

    def __init__(self, n_layer: int, n_head: int, estimator: str, modes: Sequence[str]):
        if estimator not in ESTIMATORS:
            raise StorylensError(f"--estimator: one of {', '.join(ESTIMATORS)} (got {estimator!r})")
        self.n_layer, self.n_head, self.estimator, self.modes = n_layer, n_head, estimator, tuple(modes)
        shape = (n_layer, n_layer, n_head) if estimator == "atp*" else (n_layer, n_head)
        self.sums = {m: RatioAccumulator(shape) for m in self.modes}

    def add(self, per_mode: dict[str, torch.Tensor], tokens: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        for m in self.modes:
            c = per_mode[m]
            if self.estimator == "atp*":
                c = c.permute(1, 0, 2, 3)  # [batch, drop, layer, head]
            rows = keep if m == "resample" and keep is not None else slice(None)
            self.sums[m].add(c[rows], tokens[rows])

    def merge(self, other: EstimateAccumulator) -> EstimateAccumulator:
        if (other.estimator, other.modes, other.n_layer, other.n_head) != (
            self.estimator, self.modes, self.n_layer, self.n_head,
        ):  # fmt: skip
            raise ValueError("merge: another estimator, modes or heads")
        for m in self.modes:
            self.sums[m].merge(other.sums[m])
        return self

    def columns(self) -> dict[str, torch.Tensor]:
        cols = {}
        for m in self.modes:
            r, se = self.sums[m].result()
            if self.estimator == "atp*":
                r, se = graddrop_sizes(r, se)
            cols[f"{column_stem(self.estimator)}_{m}"], cols[f"{column_stem(self.estimator)}_{m}_se"] = r, se
        return cols

    def counts(self) -> dict[str, int]:
        return {m: self.sums[m].count for m in self.modes}

    def state(self) -> dict:
        return {"shape": [self.n_layer, self.n_head], "estimator": self.estimator, "modes": list(self.modes)} | {
            m: self.sums[m].state() for m in self.modes
        }

    @classmethod
    def from_state(cls, state: dict) -> EstimateAccumulator:
        try:
            n_layer, n_head = state["shape"]
            made = cls(n_layer, n_head, state["estimator"], tuple(state["modes"]))
            shape = (n_layer, n_layer, n_head) if made.estimator == "atp*" else (n_layer, n_head)
            made.sums = {m: RatioAccumulator.from_state(state[m], shape) for m in made.modes}
        except (KeyError, TypeError, ValueError, StorylensError) as e:
            raise ValueError(f"estimate state: {e}") from None
        return made


def graddrop_sizes(r: torch.Tensor, se: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AtP*'s estimate from the per-dropped-block estimates ``r`` ``[drop, layer, head]`` and their errors:
    ``sum_j |r_j| / (L - 1)`` (one of the L terms, the head's own block dropped, is zero), the error bounded by
    ``sum_j se_j / (L - 1)``; a model of one block has nothing to drop: ``|AtP|``."""
    L = r.shape[0]
    if L == 1:
        return r[0].abs(), se[0]  # the only term is the head's own block: AtP itself, unsigned
    return r.abs().sum(0) / (L - 1), se.sum(0) / (L - 1)


def column_stem(estimator: str) -> str:
    """An estimator's columns' stem: ``atp*`` -> ``atpstar`` (a column name is a plain word)."""
    return estimator.replace("*", "star")


class EstimateMeasure(Rerun):
    """An estimator as a measure of :func:`~storylens.engine.record.record` beside the exact one
    (:class:`~storylens.effects.exact.ExactMeasure`): the same ablations (``plan``: modes, means, donors),
    estimated per batch after the recording; :attr:`acc` over every story, :attr:`audited` over those the
    exact effect measured (``plan.stories``), for the audit. ``audit_only``: the audit alone (``score --causal``
    audits the AtP columns its gradient pass gives over every story): batches with no story the exact
    effect measured are skipped and :attr:`acc` stays empty."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        estimator: str,
        plan: ExactPlan,
        steps: int = IG_STEPS,
        audit_only: bool = False,
    ):
        self.plan, self.estimator, self.steps, self.audit_only = plan, estimator, steps, audit_only
        self.acc = EstimateAccumulator(n_layer, n_head, estimator, plan.modes)
        self.audited = EstimateAccumulator(n_layer, n_head, estimator, plan.modes)

    def rerun(self, lm: AttentionLM, batch: StoryBatch, chunk: Sequence[EncodedStory]) -> None:
        plan = self.plan
        inside = torch.tensor([plan.stories is None or s.index < plan.stories for s in batch.stories])
        if self.audit_only and not inside.any():
            return
        lengths = batch.lengths.cpu()
        ids, valid = batch.ids, valid_mask(lengths, batch.ids.shape[1])
        valid = valid.to(ids.device)
        donors, keep = None, None
        if "resample" in plan.modes:
            donors, keep = resample_donors(lm, ids, batch.stories, chunk, plan.seed)
            donors = [d.clone() for d in donors]  # not inference tensors: the estimate differentiates through them
        per_mode = {
            m: estimate_batch(lm, ids, valid, self.estimator, _target(m, plan.means, donors), self.steps, plan.budget)
            for m in plan.modes
        }
        tokens = (lengths - 1).to(torch.float64)
        if not self.audit_only:
            self.acc.add(per_mode, tokens, keep)
        if inside.any():
            rows = inside.nonzero().flatten()
            self.audited.add(
                {m: v[:, rows] if self.estimator == "atp*" else v[rows] for m, v in per_mode.items()},
                tokens[rows],
                None if keep is None else keep[rows],
            )


def estimate_head_effects(
    model: ModelLike,
    stories_ids: Sequence[Sequence[int]],
    estimator: str,
    modes: Sequence[str] = MODES,
    *,
    means: torch.Tensor | None = None,
    seed: int = 0,
    steps: int = IG_STEPS,
    batch_size: int = 16,
    budget: int = COPY_BYTES,
) -> EstimateAccumulator:
    """Every head's ``estimator`` estimate over ``stories_ids`` per mode (the module docstring), the stories
    one chunk as :func:`~storylens.effects.exact.exact_head_effects` takes them (the same means and donors)."""

    def make(n_layer: int, n_head: int, plan: ExactPlan) -> EstimateMeasure:
        return EstimateMeasure(n_layer, n_head, estimator, plan, steps)

    return on_list(model, stories_ids, modes, means, seed, batch_size, budget, make).acc


# ---------------------------------------------------------------- the audit against the exact effect


@dataclass(frozen=True)
class Disagreement(Plain):
    head: str
    estimate: Effect
    exact: Effect


@dataclass(frozen=True)
class Missed(Plain):
    """AtP*'s false-negative diagnostic: heads outside the estimator's top ``top`` (by size), ``drawn`` of them
    at random with their exact effect: the largest exact effect among them against the smallest inside, and
    at 95 % how many of the ``outside`` heads could have an exact effect past that smallest one (none seen in
    ``drawn``: the rule of three, ``3 / drawn`` of them; all measured: the count)."""

    top: int
    outside: int
    drawn: int
    largest_missed: str | None
    largest_missed_nats: float | None
    smallest_in_top_nats: float
    past_it_seen: int
    could_hide: int


@dataclass(frozen=True)
class EstimatorAudit(Plain):
    estimator: str
    mode: str
    rho: float | None  # Spearman's, over every head measured both ways
    heads: int
    disagree: tuple[Disagreement, ...]  # opposite signs, each beyond 2 se from zero
    missed: Missed | None
    n_stories: int


def audit_estimate(
    estimator: str,
    mode: str,
    estimate: dict[Head, Effect],
    exact: dict[Head, Effect],
    n_stories: int,
    *,
    top: int = 5,
    draws: int | None = None,
    seed: int = 0,
) -> EstimatorAudit:
    """``estimate`` against ``exact`` over the heads both hold: rho, the sign disagreements, and the false
    negatives outside the estimate's top ``top`` by size (``draws`` of them drawn at random, seeded; None:
    every one). ``atp*``'s estimate is a size (no sign): its rho is against ``|exact|``, and no sign is compared."""
    heads = sorted(h for h in estimate if h in exact)
    signed = estimator != "atp*"
    target = [exact[h].nats if signed else abs(exact[h].nats) for h in heads]
    rho = rank_correlation([estimate[h].nats for h in heads], target)
    disagree = tuple(
        Disagreement(h.label, estimate[h], exact[h]) for h in heads if signed and _sign_disagrees(estimate[h], exact[h])
    )
    return EstimatorAudit(
        estimator, mode, rho, len(heads), disagree, _missed(estimate, exact, top, draws, seed), n_stories
    )


def _missed(
    estimate: dict[Head, Effect], exact: dict[Head, Effect], top: int, draws: int | None, seed: int
) -> Missed | None:
    ranked = sorted(estimate, key=lambda h: (-abs(estimate[h].nats), h))
    inside, outside = ranked[:top], ranked[top:]
    if not inside or not outside or any(h not in exact for h in inside):
        return None
    measured = [h for h in outside if h in exact]
    drawn = measured if draws is None else random.Random(seed).sample(measured, min(draws, len(measured)))
    if not drawn:
        return None
    floor = min(abs(exact[h].nats) for h in inside)
    past = [h for h in drawn if abs(exact[h].nats) > floor]
    worst = max(drawn, key=lambda h: abs(exact[h].nats))
    if len(drawn) == len(outside):
        hide = len(past)
    else:
        hide = min(len(outside), round(len(outside) * (len(past) + 3) / len(drawn)))  # at most, about 95 %
    return Missed(top, len(outside), len(drawn), worst.label, exact[worst].nats, floor, len(past), hide)


def estimate_blocks(L: int, H: int, estimator: str, steps: int = IG_STEPS) -> float:
    """Blocks a token runs through for one mode of ``estimator`` (a backward pass counted as two forwards):
    ``atp`` a forward and a backward; ``atp*`` and one vector-Jacobian product per block ``j`` through blocks
    ``< j``; ``ig`` per block, ``steps`` forward-and-backward passes from it on; ``quadratic`` one per head."""
    tail = sum(L - layer for layer in range(L))  # blocks from each block on, summed
    if estimator == "atp":
        return 3.0 * L
    if estimator == "atp*":
        return 3.0 * L + 2.0 * sum(range(L))
    if estimator == "ig":
        return L + 3.0 * steps * tail
    return L + 3.0 * H * tail


def estimate_cost(lm: AttentionLM, tokens: float, estimator: str, modes: Sequence[str], steps: int = IG_STEPS) -> float:
    """``estimator``'s floating-point operations over ``tokens`` tokens in all (counted as the ablations are)."""
    blocks = estimate_blocks(lm.n_layer, lm.n_head, estimator, steps) + (lm.n_layer if "resample" in modes else 0)
    heads = {"atp": 3, "atp*": 3, "ig": 3 * steps * lm.n_layer, "quadratic": 3 * lm.n_head * lm.n_layer}[estimator]
    return tokens * len(modes) * (blocks * block_flops(lm) + heads * head_flops(lm))


def audits_of(
    parts_exact: dict[str, torch.Tensor], audited: EstimateAccumulator, n_stories: int, seed: int = 0
) -> list[EstimatorAudit]:
    """Per mode, ``audited``'s estimate against the exact columns ``parts_exact`` (the same stories)."""
    est = audited.columns()
    stem = column_stem(audited.estimator)
    return [
        audit_estimate(
            audited.estimator,
            m,
            effects_of(est, f"{stem}_{m}"),
            effects_of(parts_exact, f"exact_{m}"),
            n_stories,
            seed=seed,
        )  # fmt: skip
        for m in audited.modes
    ]


def audit_lines(audits: Sequence[EstimatorAudit]) -> list[str]:
    """The estimators' audits for a terminal: rho, the disagreements, the false negatives."""
    out = []
    for a in audits:
        rho = "n/a" if a.rho is None else f"{a.rho:.2f}"
        line = f"{a.estimator} ({a.mode} ablation) against the exact effect on {a.n_stories} stories: rho {rho} over {a.heads} heads"
        if a.disagree:
            line += "; opposite signs beyond both errors: " + ", ".join(d.head for d in a.disagree)
        m = a.missed
        if m is not None:
            line += (
                f"; outside its top {m.top}, the largest exact effect is {m.largest_missed} "
                f"({m.largest_missed_nats:+.4f} nats; the top's smallest {m.smallest_in_top_nats:+.4f}), "
                f"{m.past_it_seen} of {m.drawn} measured past it"
            )
        out.append(line)
    return out


def effects_of(columns: dict[str, torch.Tensor], name: str) -> dict[Head, Effect]:
    """``{head: Effect}`` of a ``[layer, head]`` column and its ``_se`` twin."""
    col, se = columns[name], columns[name + "_se"]
    L, H = col.shape
    return {Head(i, j): Effect(float(col[i, j]), float(se[i, j])) for i in range(L) for j in range(H)}


def exact_on(
    lm: AttentionLM, stories_ids: Sequence[Sequence[int]], heads: Sequence[Head], mode: str, means
) -> dict[Head, Effect]:
    """The exact effect of ``heads`` alone (the false-negative diagnostic where not every head was measured)."""
    got = exact_effects(lm, stories_ids, list(heads), (mode,), means=means)
    return {h: got[h, mode] for h in heads}
