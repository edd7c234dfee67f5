"""``storylens patch`` beyond AtP and exact patching: an estimator beside them (:mod:`storylens.effects.estimators`,
the path from the clean run's head outputs to the corrupt run's, the metric the pairs' logit difference) and the
heads that stand in for others (:mod:`storylens.effects.backups`: the K heads of largest exact effect patched
together, every other head patched again with them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from storylens.core.errors import UsageError
from storylens.core.heads import Head
from storylens.core.modes import eval_mode
from storylens.effects.estimators import ESTIMATORS, IG_STEPS, estimate_batch, graddrop_sizes
from storylens.effects.patching import (
    Pair,
    PairBatch,
    PatchBackups,
    PatchResult,
    _run_keep,
    mean_se,
    pair_batches,
    pair_metric,
    patch_heads,
    spearman,
)
from storylens.lm import AttentionLM, Hook, ModelLike, wrap


def patch_more(
    model: ModelLike,
    pairs: Sequence[Pair],
    *,
    exact: str | int | None = None,
    progress=None,
    estimator: str | None = None,
    ig_steps: int = IG_STEPS,
    backups: int = 0,
) -> PatchResult:
    """:func:`~storylens.effects.patching.patch_heads`, then ``estimator``'s estimate of every head (None: none)
    and, with ``backups`` K > 0, every head's backup gain once the K of largest exact effect are patched."""
    if estimator is not None and estimator not in ESTIMATORS:
        raise UsageError(f"--estimator: one of {', '.join(ESTIMATORS)} (got {estimator!r})")
    if backups < 0:
        raise UsageError(f"--backups: a whole number of heads, 0 or more (got {backups})")
    lm = wrap(model)
    result = patch_heads(lm, pairs, exact=exact, progress=progress)
    if estimator is not None:
        result = with_estimate(lm, pairs, result, estimator, ig_steps)
    return with_backups(lm, pairs, result, backups) if backups else result


def _estimate(lm: AttentionLM, b: PairBatch, z_corrupt: Sequence[torch.Tensor], estimator: str, steps: int):
    """One batch's ``estimator`` estimates, ``[pair, layer, head]`` (atp*: ``[drop, pair, layer, head]``): the
    clean run's outputs moved towards the corrupt run's, the metric the pairs' logit difference."""

    def metric(logits: torch.Tensor, copies: int) -> torch.Tensor:
        many = PairBatch(b.clean.repeat(copies, 1), b.corrupt.repeat(copies, 1), b.last.repeat(copies),
                      b.answer.repeat(copies), b.wrong.repeat(copies))  # fmt: skip
        return pair_metric(logits, many).double()

    valid = torch.ones_like(b.clean, dtype=torch.bool)
    return estimate_batch(lm, b.clean, valid, estimator, lambda layer: z_corrupt[layer], steps, metric=metric)


def with_estimate(lm: AttentionLM, pairs: Sequence[Pair], result: PatchResult, estimator: str, steps: int = IG_STEPS):
    """``result`` with ``estimator``'s estimate of every head's patching effect beside AtP and exact."""
    per_pair = []
    with eval_mode(lm.module):
        for b in pair_batches(lm, pairs):
            _, z_corrupt, _ = _run_keep(lm, b.corrupt, b)
            per_pair.append(_estimate(lm, b, z_corrupt, estimator, steps))
    return _summed(result, estimator, torch.cat(per_pair, dim=-3).cpu())


def _summed(result: PatchResult, estimator: str, per_pair: torch.Tensor) -> PatchResult:
    """``result`` with every head's estimate (mean over pairs, standard error over pairs; atp*: the mean of
    the per-block sizes, its error bounded by the mean of their errors) and its rho against exact."""
    mean, se = mean_se(per_pair.transpose(0, 1) if estimator == "atp*" else per_pair)  # over pairs
    if estimator == "atp*":
        mean, se = graddrop_sizes(mean, se)
    heads = tuple(
        replace(h, estimate=float(mean[h.layer, h.index]), estimate_se=float(se[h.layer, h.index]))
        for h in result.heads
    )
    sized = estimator == "atp*"  # AtP*'s estimate is a size: ranked against |exact|
    both = [(float(h.estimate or 0.0), abs(h.exact) if sized else h.exact) for h in heads if h.exact is not None]
    rho = spearman([a for a, _ in both], [e for _, e in both])
    return replace(result, heads=heads, estimator=estimator, estimate_spearman=rho)


@torch.no_grad()
def _patched(lm: AttentionLM, b: PairBatch, heads: Sequence[Head], z_corrupt) -> torch.Tensor:
    """``[batch]``: the clean run's metric with ``heads``' outputs taken from the corrupt run."""
    by_layer: dict[int, list[int]] = {}
    for h in heads:
        by_layer.setdefault(h.layer, []).append(h.head)

    def patch(z: torch.Tensor, hook: Hook) -> torch.Tensor:
        z = z.clone()
        for head in by_layer[hook.layer]:
            z[:, :, head] = z_corrupt[hook.layer][:, :, head]
        return z

    with lm.hooks([(f"blocks.{layer}.attn.hook_z", patch) for layer in by_layer]):
        logits = lm.forward(b.clean, logits=b.last)
    assert logits is not None
    return pair_metric(logits, b).double()


def with_backups(lm: AttentionLM, pairs: Sequence[Pair], result: PatchResult, k: int) -> PatchResult:
    """``result`` with every head's backup gain once the ``k`` heads of largest |exact| effect are patched
    together (storylens.effects.backups: [m(K + h) - m(K)] - [m(h) - m({})] per pair) and what the model
    repairs. Every head is patched alone here (whatever ``result`` patched exactly), then with the ``k``."""
    every = list(Head.every(lm.n_layer, lm.n_head))
    batches = pair_batches(lm, pairs)
    singles = []
    with eval_mode(lm.module):
        for b in batches:
            _, z_corrupt, _ = _run_keep(lm, b.corrupt, b)
            clean, _, _ = _run_keep(lm, b.clean, b)
            singles.append(torch.stack([_patched(lm, b, [h], z_corrupt) - clean for h in every], -1))
    single = torch.cat(singles).cpu().view(-1, lm.n_layer, lm.n_head)  # [pair, layer, head]: m(h) - m({})
    removed = sorted(every, key=lambda h: (-abs(float(single[:, h.layer, h.head].mean())), h))[:k]
    gains, joints = [], []
    with eval_mode(lm.module):
        for b in batches:
            _, z_corrupt, _ = _run_keep(lm, b.corrupt, b)
            clean, _, _ = _run_keep(lm, b.clean, b)
            base = _patched(lm, b, removed, z_corrupt)
            joints.append(base - clean)
            g = torch.full((len(b.last), lm.n_layer, lm.n_head), float("nan"), dtype=torch.float64)
            for h in every:
                if h not in removed:
                    g[:, h.layer, h.head] = _patched(lm, b, [*removed, h], z_corrupt) - base
            gains.append(g)
    cond = torch.cat(gains).cpu()
    gain_mean, gain_se = mean_se(cond - single)
    joint = torch.cat(joints).cpu()
    separate = torch.stack([single[:, h.layer, h.head] for h in removed], -1).sum(-1)
    (j, j_se), (sep, sep_se), (rep, rep_se) = (mean_se(x) for x in (joint, separate, separate - joint))
    heads = tuple(
        replace(h, backup_gain=None if Head(h.layer, h.index) in removed else float(gain_mean[h.layer, h.index]),
                backup_gain_se=None if Head(h.layer, h.index) in removed else float(gain_se[h.layer, h.index]))
        for h in result.heads
    )  # fmt: skip
    info = PatchBackups(
        tuple(h.label for h in removed), float(j), float(j_se), float(sep), float(sep_se), float(rep), float(rep_se)
    )
    return replace(result, heads=heads, backups=info)
