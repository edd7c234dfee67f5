"""The edge scores audited by exact edge patching on a sample of edges: the top edges by |score| and as many drawn
at random from the rest, each ablated alone and run (one patched pass each); Spearman's rho between score and
exact effect, and the edges where the two have opposite signs beyond both errors, named."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storylens.circuits.edges import EdgeScores
from storylens.circuits.faithfulness import edge_metrics
from storylens.core.plain import Plain
from storylens.effects.patching import Pair, mean_se, spearman
from storylens.lm import ModelLike

ORACLE_EDGES = 10  # the top edges by |score|, and as many drawn at random from the rest


@dataclass(frozen=True)
class OracleRow(Plain):
    """One audited edge: its score and its exact single-edge effect (the metric with only it ablated, less
    the clean metric), each with its error over pairs; ``why``: ``top`` or ``random``."""

    writer: str
    receiver: str
    why: str
    score: float
    score_se: float
    exact: float
    exact_se: float


@dataclass(frozen=True)
class Oracle(Plain):
    rows: list[OracleRow]
    rho: float | None
    disagree: list[str]  # "writer -> receiver" where score and exact have opposite signs beyond both errors


def edge_oracle(
    model: ModelLike,
    pairs: Sequence[Pair],
    scores: EdgeScores,
    *,
    k: int = ORACLE_EDGES,
    seed: int = 0,
    batch_size: int = 32,
) -> Oracle:
    """The top ``k`` edges by ``|score|`` and ``k`` drawn at random from the others, each ablated alone and run."""
    mean, real = scores.mean, ~scores.mean.isnan()
    order = torch.argsort(mean.abs().nan_to_num(-1.0).flatten(), descending=True, stable=True)
    order = order[real.flatten()[order]]
    top, rest = order[:k], order[k:]
    gen = torch.Generator().manual_seed(seed)
    drawn = rest[torch.randperm(len(rest), generator=gen)[: min(k, len(rest))]]
    chosen = [(int(i), "top") for i in top] + [(int(i), "random") for i in drawn]
    width = mean.shape[1]
    circuits = [real.clone()]
    for i, _ in chosen:
        c = real.clone()
        c[i // width, i % width] = False
        circuits.append(c)
    metrics = edge_metrics(model, pairs, circuits, batch_size=batch_size)
    effects = metrics[1:] - metrics[0]  # [edge, pair]
    rows, disagree = [], []
    w, r = scores.graph.writers, scores.graph.receivers
    for (i, why), eff in zip(chosen, effects):
        u, v = i // width, i % width
        e_mean, e_se = mean_se(eff[:, None])
        row = OracleRow(w[u], r[v], why, float(mean[u, v]), float(scores.se[u, v]), float(e_mean), float(e_se))
        rows.append(row)
        if row.score * row.exact < 0 and abs(row.score) > 2 * row.score_se and abs(row.exact) > 2 * row.exact_se:
            disagree.append(f"{row.writer} -> {row.receiver}")
    rho = spearman([x.score for x in rows], [x.exact for x in rows]) if len(rows) > 2 else None
    return Oracle(rows, rho, disagree)
