"""A circuit's stability: the circuit of a given size found again on bootstrap resamples of the pairs (the
Jaccard index of the edge sets with the whole set's circuit, and the core found in every resample with its
faithfulness)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storylens.circuits.edges import EdgeScores
from storylens.circuits.faithfulness import edge_metrics, prune
from storylens.core.plain import Plain
from storylens.effects.patching import Pair
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


def _top(mean: torch.Tensor, n: int) -> torch.Tensor:
    flat = mean.abs().nan_to_num(-1.0).flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[torch.argsort(flat, descending=True, stable=True)[:n]] = True
    return keep.view_as(mean) & ~mean.isnan()


def stability(
    model: ModelLike, pairs: Sequence[Pair], scores: EdgeScores, n: int, *, resamples: int = RESAMPLES, seed: int = 0,
    batch_size: int = 32,
) -> Stability:  # fmt: skip
    """The module docstring: the resamples reuse each pair's scores (no model run); the core's faithfulness
    is one patched pass over the pairs."""
    graph = scores.graph
    whole = prune(graph, _top(scores.mean, n))
    gen = torch.Generator().manual_seed(seed)
    found, jac = [], []
    for _ in range(resamples):
        draw = torch.randint(0, scores.per_pair.shape[0], (scores.per_pair.shape[0],), generator=gen)
        c = prune(graph, _top(scores.per_pair[draw].mean(0), n))
        found.append(c)
        union = (c | whole).sum().item()
        jac.append((c & whole).sum().item() / union if union else 1.0)
    core = torch.stack(found).all(0)
    every = ~scores.mean.isnan()
    m = edge_metrics(model, pairs, [core, torch.zeros_like(core), every], batch_size=batch_size).mean(1)
    f = float((m[0] - m[1]) / (m[2] - m[1]))
    js = torch.tensor(jac, dtype=torch.float64)
    sd = float(js.std()) if len(jac) > 1 else None
    return Stability(n, int(whole.sum()), resamples, float(js.mean()), sd, int(core.sum()), f)
