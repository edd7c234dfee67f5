"""A circuit's stability: the circuit of a given size found again on bootstrap resamples of the pairs (the
Jaccard index of the edge sets with the whole set's circuit, and the core found in every resample with its
faithfulness), and on a second file of pairs for the same behaviour (a paraphrase of the task: the circuits
found this way change under resampling and paraphrase, arXiv 2510.00845)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storylens.circuits.edges import EdgeScores, Graph
from storylens.circuits.faithfulness import edge_metrics, prune
from storylens.core.plain import Plain
from storylens.effects.patching import Pair, mean_se, task_verdict
from storylens.lm import ModelLike

RESAMPLES = 50  # bootstrap resamples of the pairs for stability


@dataclass(frozen=True)
class Stability(Plain):
    """The circuit of ``n`` edges (asked; ``kept`` after pruning) found again on ``resamples`` bootstrap
    resamples of the pairs: the Jaccard index with the whole set's circuit (mean and standard deviation over
    resamples), the core (edges in every resample's circuit) and its faithfulness on every pair."""

    n: int
    kept: int
    resamples: int
    jaccard: float
    jaccard_sd: float | None  # None from one resample
    core: int
    core_f: float
    core_f_se: float | None = None  # over bootstrap resamples of the pairs (None: one pair; absent in older files)


def f_with_se(m: torch.Tensor, circuit: int, empty: int, full: int, gen: torch.Generator, resamples: int = RESAMPLES):
    """Faithfulness ``(m(C) - m(empty)) / (m(model) - m(empty))`` from per-pair metrics ``m [condition, pair]`` (rows
    ``circuit``, ``empty``, ``full``), and its standard error over bootstrap resamples of the pairs (the spread of
    the ratio recomputed on each; None from one pair)."""

    def f(rows: torch.Tensor) -> float:
        mean = rows.mean(-1)
        return float((mean[circuit] - mean[empty]) / (mean[full] - mean[empty]))

    n = m.shape[1]
    if n < 2:
        return f(m), None
    boot = torch.tensor([f(m[:, torch.randint(0, n, (n,), generator=gen)]) for _ in range(resamples)])
    finite = boot[boot.isfinite()]
    return f(m), (float(finite.std()) if len(finite) > 1 else None)


def _top(mean: torch.Tensor, n: int) -> torch.Tensor:
    flat = mean.abs().nan_to_num(-1.0).flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[torch.argsort(flat, descending=True, stable=True)[:n]] = True
    return keep.view_as(mean) & ~mean.isnan()


def resampled(graph: Graph, mean: torch.Tensor, resamples, n: int) -> tuple[torch.Tensor, list[float], torch.Tensor]:
    """The circuit of ``n`` edges (pruned) by ``mean`` ``[writer, receiver]``, the Jaccard index with it of each
    resample's (``resamples``: each one's mean scores), and the core: the edges every resample's circuit holds."""
    whole = prune(graph, _top(mean, n))
    found, jac = [], []
    for m in resamples:
        c = prune(graph, _top(m.masked_fill(mean.isnan(), float("nan")), n))
        found.append(c)
        union = (c | whole).sum().item()
        jac.append((c & whole).sum().item() / union if union else 1.0)
    return whole, jac, torch.stack(found).all(0)


def stability_of(
    n: int, whole: torch.Tensor, jac: list[float], core: torch.Tensor, core_f: float, core_f_se: float | None = None
) -> Stability:
    js = torch.tensor(jac, dtype=torch.float64)
    sd = float(js.std()) if len(jac) > 1 else None
    return Stability(n, int(whole.sum()), len(jac), float(js.mean()), sd, int(core.sum()), core_f, core_f_se)


def stability(
    model: ModelLike, pairs: Sequence[Pair], scores: EdgeScores, n: int, *, resamples: int = RESAMPLES, seed: int = 0,
    batch_size: int = 32,
) -> Stability:  # fmt: skip
    """The module docstring: the resamples reuse each pair's scores (no model run); the core's faithfulness
    is one patched pass over the pairs."""
    gen = torch.Generator().manual_seed(seed)
    rows = scores.per_pair.shape[0]
    draws = (torch.randint(0, rows, (rows,), generator=gen) for _ in range(resamples))
    whole, jac, core = resampled(scores.graph, scores.mean, (scores.per_pair[d].mean(0) for d in draws), n)
    every = ~scores.mean.isnan()
    m = edge_metrics(
        model, pairs, [core, torch.zeros_like(core), every], batch_size=batch_size, clean=scores.clean_for(pairs)
    )
    return stability_of(n, whole, jac, core, *f_with_se(m, 0, 1, 2, gen, resamples))


@dataclass(frozen=True)
class SecondPairs(Plain):
    """The circuit of the same size (``n`` asked, pruned) found on a second file of pairs (``source``, ``pairs``;
    whether the model does that task, ``verdict``, first): its Jaccard index with the first file's circuit, and its
    spread over ``resamples`` bootstrap resamples of the second file; the edges both circuits hold (``shared``) and
    the faithfulness on the first file's pairs of that shared part and of the second file's circuit."""

    source: str
    pairs: int
    verdict: str
    kept: int
    jaccard: float
    jaccard_sd: float | None  # None without resamples
    resamples: int
    shared: int
    shared_f: float
    second_f: float
    shared_f_se: float | None = None  # over bootstrap resamples of the first file's pairs (None: one pair)
    second_f_se: float | None = None


def second_pairs(
    model: ModelLike, pairs: Sequence[Pair], scores: EdgeScores, other_pairs: Sequence[Pair], other: EdgeScores,
    n: int, *, source: str, resamples: int = RESAMPLES, seed: int = 0, batch_size: int = 32,
) -> SecondPairs:  # fmt: skip
    """The module docstring: ``other`` the edge scores on ``other_pairs`` by the same method. Two patched passes
    over the second file (whether the model does it) and three over the first (the shared part, the second
    circuit, the ends)."""
    graph = scores.graph
    gen = torch.Generator().manual_seed(seed)
    rows = other.per_pair.shape[0]
    draws = [torch.randint(0, rows, (rows,), generator=gen) for _ in range(resamples if rows > 1 else 0)]
    mine, theirs = prune(graph, _top(scores.mean, n)), prune(graph, _top(other.mean, n))
    jac = resampled(graph, scores.mean, (other.per_pair[d].mean(0) for d in draws), n)[1] if draws else []
    union = (mine | theirs).sum().item()
    shared = mine & theirs
    every = ~scores.mean.isnan()
    runs = [shared, theirs, torch.zeros_like(every), every]
    m = edge_metrics(model, pairs, runs, batch_size=batch_size, clean=scores.clean_for(pairs))
    (shared_f, shared_se), (second_f, second_se) = (f_with_se(m, c, 2, 3, gen, resamples) for c in (0, 1))
    known = other.clean_for(other_pairs)  # the second file's clean metrics, as its scoring passes made them
    clean, se = mean_se(
        known if known is not None else edge_metrics(model, other_pairs, [every], batch_size=batch_size)[0]
    )
    sd = float(torch.tensor(jac, dtype=torch.float64).std()) if len(jac) > 1 else None
    return SecondPairs(
        source=source, pairs=len(other_pairs), verdict=task_verdict(float(clean), float(se), len(other_pairs)),
        kept=int(theirs.sum()), jaccard=(mine & theirs).sum().item() / union if union else 1.0, jaccard_sd=sd,
        resamples=len(jac), shared=int(shared.sum()), shared_f=shared_f, second_f=second_f, shared_f_se=shared_se,
        second_f_se=second_se,
    )  # fmt: skip
