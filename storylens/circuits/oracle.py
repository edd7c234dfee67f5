"""The edge scores audited by exact edge patching on a sample of edges: the top edges by |score| and as many drawn
at random from the rest, each ablated alone and run (one patched pass each); Spearman's rho between score and
exact effect, and the edges where the two have opposite signs beyond both errors, named."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storylens.circuits.edges import EdgeScores
from storylens.circuits.faithfulness import edge_metrics, pooled_mean
from storylens.core.plain import Plain
from storylens.effects.patching import Pair, spearman
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


def oracle_choice(scores: EdgeScores, k: int = ORACLE_EDGES, seed: int = 0) -> list[tuple[int, str]]:
    """The top ``k`` edges by ``|score|`` and ``k`` drawn at random from the others: ``(flat index into [writer,
    receiver], "top" | "random")``."""
    mean, real = scores.mean, ~scores.mean.isnan()
    order = torch.argsort(mean.abs().nan_to_num(-1.0).flatten(), descending=True, stable=True)
    order = order[real.flatten()[order]]
    top, rest = order[:k], order[k:]
    gen = torch.Generator().manual_seed(seed)
    drawn = rest[torch.randperm(len(rest), generator=gen)[: min(k, len(rest))]]
    return [(int(i), "top") for i in top] + [(int(i), "random") for i in drawn]


def without_each(scores: EdgeScores, chosen: list[tuple[int, str]]) -> list[torch.Tensor]:
    """For each chosen edge, the circuit of every edge but it (``[writer, receiver]`` bool)."""
    real, width = ~scores.mean.isnan(), scores.mean.shape[1]
    out = []
    for i, _ in chosen:
        c = real.clone()
        c[i // width, i % width] = False
        out.append(c)
    return out


def oracle_of(scores: EdgeScores, chosen: list[tuple[int, str]], effects: torch.Tensor, n: torch.Tensor) -> Oracle:
    """The audit from each chosen edge's exact effect per row ``effects`` ``[edge, row]`` (the metric with it
    alone ablated less the metric with nothing ablated), rows counting ``n`` (1 a pair, a story its tokens)."""
    rows, disagree = [], []
    w, r, width = scores.graph.writers, scores.graph.receivers, scores.mean.shape[1]
    for (i, why), eff in zip(chosen, effects):
        u, v = i // width, i % width
        e_mean, e_se = pooled_mean(eff, n)
        row = OracleRow(w[u], r[v], why, float(scores.mean[u, v]), float(scores.se[u, v]), e_mean, e_se)
        rows.append(row)
        if row.score * row.exact < 0 and abs(row.score) > 2 * row.score_se and abs(row.exact) > 2 * row.exact_se:
            disagree.append(f"{row.writer} -> {row.receiver}")
    rho = spearman([x.score for x in rows], [x.exact for x in rows]) if len(rows) > 2 else None
    return Oracle(rows, rho, disagree)


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
    chosen = oracle_choice(scores, k, seed)
    runs = [~scores.mean.isnan(), *without_each(scores, chosen)]
    metrics = edge_metrics(model, pairs, runs, batch_size=batch_size, clean=scores.clean_for(pairs))
    effects = metrics[1:] - metrics[0]  # [edge, pair]
    return oracle_of(scores, chosen, effects, torch.ones(effects.shape[1], dtype=torch.float64))
