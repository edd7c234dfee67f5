"""The exact effect's plan for ``storylens score`` (:class:`~storylens.effects.exact.ExactPlan`): which stories it
covers, what it costs (said before the scoring, refused past the ablation budget), and mean ablation's means.

``--exact MODES`` measures every head's exact effect on every story (or the first ``--exact-stories N``).
``--causal`` alone measures it too, in mean ablation, on as many of the first stories as cost at most
:data:`~storylens.effects.cost.TRUTH_BUDGET` of the scoring pass or
:data:`~storylens.effects.cost.TRUTH_FLOOR_FLOPS` (the report's ablation budget, as ``--audit`` takes it), and
AtP again on those stories with the same means: the AtP columns are shown beside their audit against the exact
effect (summary.json's ``estimators``). Where not one story fits, it says so and the columns stay unaudited.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from itertools import islice

import torch

from storylens.core.errors import StorylensError, UsageError
from storylens.core.progress import ProgressLines
from storylens.corpus.options import ScoreOptions
from storylens.data.sources import StorySource
from storylens.effects.ablation import head_output_means
from storylens.effects.backups import BACKUP_STORIES
from storylens.effects.cost import (
    ABLATION_LIMIT_FLOPS,
    OVER_BUDGET_FLAG,
    TRUTH_BUDGET,
    TRUTH_FLOOR_FLOPS,
    AblationCost,
    block_flops,
    check_ablation_budget,
)
from storylens.effects.estimators import estimate_cost
from storylens.effects.exact import LENGTH_STORIES, ExactPlan, exact_cost, fitting_stories
from storylens.engine.encode import encode_stories
from storylens.lm import AttentionLM

BY_BUDGET = f"as many as cost at most {TRUTH_BUDGET:.0%} of the scoring pass or {TRUTH_FLOOR_FLOPS / 1e12:g} TFLOP"


def exact_plan(
    lm: AttentionLM, source: StorySource, names: frozenset[str], n_total: int, opts: ScoreOptions
) -> ExactPlan | None:
    """The exact effect's plan (None: ``--causal``'s default fits no story, said on stderr): its cost over the
    stories it will cover (their length estimated from the first :data:`~storylens.effects.exact.LENGTH_STORIES`),
    said on stderr before the scoring and past the ablation budget refused unless ``over_budget`` (naming the
    ``--exact-stories`` that fits); then, for mean ablation, every head's mean output over every story it covers
    (a pass of its own, streamed: the mean is that of the stories measured, not a sample's; :func:`corpus_means`)."""
    modes = opts.exact_modes
    first = encode_stories(lm, list(islice(iter(source), min(LENGTH_STORIES, n_total))), names)
    mean_length = sum(len(e.ids) for e in first) / len(first)
    asked = opts.exact or opts.exact_stories is not None
    limit = opts.exact_stories if asked else default_exact_stories(lm, mean_length, n_total, opts)
    if limit == 0:
        print(
            f"storylens: score --causal: every head's exact effect not measured: not one story fits the default "
            f"budget ({BY_BUDGET}); the AtP columns go unaudited (--exact-stories N measures it on N stories)",
            file=sys.stderr,
            flush=True,
        )
        return None
    covered = min(n_total, limit or n_total)
    cost, more = _costs(lm, mean_length, covered, n_total, opts)
    what = _what(opts, covered, n_total)
    if cost.flops > ABLATION_LIMIT_FLOPS and not opts.over_budget:
        left = ABLATION_LIMIT_FLOPS - more - (covered * mean_length if "mean" in modes else 0) * _pass(lm)
        fits = fitting_stories(lm, mean_length, modes, left) if left > 0 else 0
        raise UsageError(
            f"{what}: {cost.describe()}, past the budget of {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP; "
            + (f"pass --exact-stories {fits:,} (fits it) or " if fits else "pass ")
            + f"{OVER_BUDGET_FLAG} to run it anyway"
        )
    check_ablation_budget(cost, what, over=True)  # said on stderr
    means = corpus_means(lm, source, names, covered, opts) if "mean" in modes else None
    stories = limit if asked else (covered if covered < n_total else None)
    return ExactPlan(modes, means, covered if means is not None else 0, stories, opts.seed)


def _pass(lm: AttentionLM) -> float:
    """A forward pass's blocks, a token (the means' pass)."""
    return lm.n_layer * block_flops(lm)


def _costs(
    lm: AttentionLM, mean_length: float, covered: int, n_total: int, opts: ScoreOptions
) -> tuple[AblationCost, float]:
    """The whole cost (the exact effect over ``covered`` stories with its means' pass, and the rest), and the
    rest alone: an estimator on every story, AtP's audit on the covered ones, the backups' two passes."""
    modes = opts.exact_modes
    cost = exact_cost(lm, covered * mean_length, modes, covered * mean_length if "mean" in modes else 0)
    more = 0.0
    if opts.estimator is not None:
        more += estimate_cost(lm, n_total * mean_length, opts.estimator, modes, opts.ig_steps)
    if opts.causal and opts.estimator != "atp":
        more += estimate_cost(lm, covered * mean_length, "atp", modes)
    if opts.backups:
        more += 2 * exact_cost(lm, min(covered, BACKUP_STORIES) * mean_length, modes).flops
    return replace(cost, flops=cost.flops + more, passes=cost.passes + more / max(cost.scoring, 1.0)), more


def _what(opts: ScoreOptions, covered: int, n_total: int) -> str:
    """What the cost is of, as said before the scoring."""
    if opts.exact:
        what = f"score --exact {','.join(opts.exact)}: every head on the first {covered:,} stories"
    elif opts.exact_stories is not None:
        what = f"score --causal: every head's exact effect (mean ablation) on the first {covered:,} stories"
    else:
        what = (
            f"score --causal: every head's exact effect (mean ablation) on the first {covered:,} of {n_total:,} "
            f"stories ({BY_BUDGET}; --exact: every story)"
        )
    if opts.estimator is not None:
        what += f", --estimator {opts.estimator} on all {n_total:,}"
    if opts.causal and opts.estimator != "atp":
        what += ", AtP again there for its audit"
    if opts.backups:
        what += f", --backups {opts.backups} on the first {min(covered, BACKUP_STORIES):,}"
    return what


def default_exact_stories(lm: AttentionLM, mean_length: float, n_total: int, opts: ScoreOptions) -> int:
    """``--causal``'s exact effect by default: how many of the first stories (of ``mean_length`` tokens) it and
    AtP's audit there cost at most ``max(TRUTH_BUDGET x the scoring pass, TRUTH_FLOOR_FLOPS)``, within the
    ablation budget with the rest asked (an estimator, backups); 0 where not one fits."""
    allowed = min(max(TRUTH_BUDGET * n_total * mean_length * _pass(lm), TRUTH_FLOOR_FLOPS), ABLATION_LIMIT_FLOPS)
    per_story = _costs(lm, mean_length, 1, 0, opts)[0].flops
    rest = _costs(lm, mean_length, 0, n_total, opts)[0].flops
    return min(n_total, max(0, int((allowed - rest) // per_story)))


def corpus_means(
    lm: AttentionLM, source: StorySource, names: frozenset[str], n: int, opts: ScoreOptions
) -> torch.Tensor:
    """Every head's mean output ``[layer, head, d]`` over every position after the opening token of the source's
    first ``n`` stories, streamed a chunk at a time (:func:`~storylens.effects.ablation.head_output_means` per
    chunk, weighted by its positions, summed in float64)."""
    total: torch.Tensor | None = None
    count = 0
    stories = islice(iter(source), n)
    lines = ProgressLines("exact: the heads' means", n, enabled=opts.progress)
    while chunk := list(islice(stories, opts.chunk_stories)):
        ids = [e.ids for e in encode_stories(lm, chunk, names) if len(e.ids) >= 2]
        lines.update(len(chunk))
        if not ids:
            continue
        positions = sum(len(s) - 1 for s in ids)
        part = head_output_means(lm, ids, batch_size=opts.batch_size, include_marker=False).to(torch.float64)
        total = part * positions if total is None else total + part * positions
        count += positions
    if total is None:
        raise StorylensError("--exact mean: no story of two tokens or more to take the heads' means over")
    return (total / count).to(torch.float32 if lm.dtype != torch.float64 else torch.float64)
