"""Circuits of edges, run exactly (edge patching), and their faithfulness (MIB's circuit track, Mueller et al.
2025): the graph and the edge scores are :mod:`storylens.circuits.edges`'.

**Edge patching** (every edge outside a circuit carrying its ablated value) is :mod:`storylens.circuits.edge_patch`'s.

**Faithfulness** of a circuit: ``f = (m(C) - m(empty)) / (m(model) - m(empty))`` on the pairs' mean metric,
``m(empty)`` every edge ablated (the corrupt metric), ``m(model)`` none (the clean one). Circuits of the top
``n`` edges by ``|score|`` at MIB's sizes (0.1 % .. 100 % of the edges, ``n = int(pct x edges)``), pruned
as EAP-IG's ``Graph.prune`` does (a node without an edge in and out leaves, with its edges, until none does);
CPR is the area under ``f`` over the edge fraction (trapezoids), CMD the area of ``|1 - f|``; each with a
bootstrap standard error over the pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storylens.circuits.bases import Away, Bases, corrupt_stream
from storylens.circuits.edge_patch import circuit_metrics
from storylens.circuits.edges import EdgeScores, Graph, Metric, fitting_pairs
from storylens.circuits.prefix import after_shared_start, start_ordered
from storylens.core.errors import StorylensError
from storylens.core.plain import Plain
from storylens.effects.patching import BATCH_PAIRS, Pair, PairBatch, PairMetric, pair_batches
from storylens.engine.accumulate import pooled_ratio
from storylens.lm import AttentionLM, ModelLike, wrap

PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's circuit sizes
BOOTSTRAP = 1000  # resamples of the pairs for the errors of f, CPR and CMD


def _corrupt_away(lm: AttentionLM, b: PairBatch, metric: Metric) -> tuple[Away, torch.Tensor, Bases]:
    """Each writer's output less its output on the corrupt prompts, the metric of that corrupt run (what the
    circuit with no edge gives), and the stream with every edge ablated, which is that run's
    (:func:`~storylens.circuits.bases.corrupt_stream`)."""
    value, away, stream = corrupt_stream(lm, b.corrupt, metric)
    return away, value, stream


def edge_metrics(
    model: ModelLike,
    pairs: Sequence[Pair],
    circuits: Sequence[torch.Tensor],
    *,
    batch_size: int = BATCH_PAIRS,
    clean: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[circuit, pair]``: the metric with every edge outside each circuit (``[writer, receiver]`` bool, True
    in the circuit) ablated; ``clean`` ``[pair]``: the pairs' clean metrics where the caller has them
    (:attr:`~storylens.circuits.edges.EdgeScores.clean` of scores on these pairs), what a circuit that keeps
    every edge gives, so no forward is run for it."""
    lm = wrap(model)
    if not pairs:
        raise StorylensError("circuit: no pairs")
    if clean is not None and clean.shape != (len(pairs),):
        raise StorylensError(f"circuit: {len(pairs)} pairs but {tuple(clean.shape)} clean metrics")
    out = []
    ordered, back = start_ordered(list(pairs))  # pairs alike batched together
    order = torch.argsort(back)  # ordered[i] is pairs[order[i]]
    done = 0
    for whole in pair_batches(lm, ordered, fitting_pairs(lm, ordered, batch_size, graph=False)):
        rows = order[done : done + whole.clean.shape[0]]
        done += len(rows)
        with after_shared_start(lm, whole) as b:  # the start every pair shares run once: no difference there
            metric = PairMetric(b)
            away, corrupt, stream = _corrupt_away(lm, b, metric)
            given = None if clean is None else clean[rows]
            out.append(circuit_metrics(lm, b.clean, metric, list(circuits), away, corrupt, stream, given))
    return torch.cat(out, 1)[:, back]


def prune(graph: Graph, keep: torch.Tensor) -> torch.Tensor:
    """``keep`` ``[writer, receiver]`` without the edges of nodes that have no edge in or no edge out, repeated
    until none is left (EAP-IG's ``Graph.prune``; the input always has its way in, the logits are always there)."""
    keep = keep.clone()
    owner = _receiver_owners(graph)  # receiver -> the writers (nodes) it feeds
    while True:
        has_out = keep.any(1)
        has_in = torch.zeros(len(graph.writers), dtype=torch.bool)
        for v, nodes in enumerate(owner):
            if keep[:, v].any():
                has_in[nodes] = True
        has_in[0] = True
        alive = has_out & has_in
        child = torch.tensor([bool(alive[nodes].any()) if nodes else True for nodes in owner])  # the logits: []
        new = keep & alive[:, None] & child[None, :]
        if torch.equal(new, keep):
            return keep
        keep = new


def _receiver_owners(graph: Graph) -> list[list[int]]:
    """For each receiver, the writers it belongs to: a head's query its head; a key/value receiver every query
    head of its group; an MLP's its MLP; the logits none."""
    out: list[list[int]] = []
    group = graph.n_head // graph.n_kv
    for layer in range(graph.n_layer):
        first = 1 + layer * (graph.n_head + 1)
        out += [[first + h] for h in range(graph.n_head)]
        for _ in ("k", "v"):
            out += [[first + g * group + i for i in range(group)] for g in range(graph.n_kv)]
        out.append([first + graph.n_head])
    return out + [[]]


def top_circuit(scores: EdgeScores, n: int) -> torch.Tensor:
    """The top ``n`` edges by ``|mean score|``, pruned (:func:`prune`): ``[writer, receiver]`` bool."""
    flat = scores.mean.abs().nan_to_num(-1.0).flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    if n > 0:
        keep[torch.argsort(flat, descending=True, stable=True)[:n]] = True
    keep &= ~scores.mean.isnan().flatten()
    return prune(scores.graph, keep.view_as(scores.mean))


@dataclass
class Faithfulness(Plain):
    """The faithfulness curve: per size (``percentages``), the edges asked (``n``) and kept after pruning
    (``kept``), ``f`` and its bootstrap error; ``cpr`` and ``cmd`` with theirs; ``clean``, ``corrupt`` the
    metric's means over the pairs with their standard errors."""

    percentages: list[float]
    n: list[int]
    kept: list[int]
    f: list[float]
    f_se: list[float]
    cpr: float
    cpr_se: float
    cmd: float
    cmd_se: float
    clean: float
    clean_se: float
    corrupt: float
    corrupt_se: float


def _curve(metrics: torch.Tensor, clean: torch.Tensor, corrupt: torch.Tensor, x: Sequence[float], n: torch.Tensor):
    """``f`` per size and the two areas from per-row metrics ``[size, row]``, each row counting ``n`` (1 a pair;
    a story its predicted tokens, its metric its summed loss): the means are pooled, ``sum m / sum n``."""
    total = n.sum()
    m, c0, c1 = metrics.sum(1) / total, clean.sum() / total, corrupt.sum() / total
    f = (m - c1) / (c0 - c1)
    xs = torch.tensor(x, dtype=torch.float64)
    width = xs[1:] - xs[:-1]
    cpr = (width * (f[1:] + f[:-1]) / 2).sum()
    cmd = (width * ((1 - f[1:]).abs() + (1 - f[:-1]).abs()) / 2).sum()
    return f, cpr, cmd


def curve_of(
    per: torch.Tensor, clean: torch.Tensor, corrupt: torch.Tensor, n: torch.Tensor, sizes: Sequence[int],
    kept: Sequence[int], percentages: Sequence[float] = PERCENTAGES, seed: int = 0,
) -> Faithfulness:  # fmt: skip
    """The faithfulness curve from the metrics of the circuits' runs ``per`` ``[size, row]``, the clean and
    ablated runs' ``[row]``, rows counting ``n`` (:func:`_curve`); errors by a bootstrap over the rows."""
    f, cpr, cmd = _curve(per, clean, corrupt, percentages, n)
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, per.shape[1], (BOOTSTRAP, per.shape[1]), generator=gen)
    boot = [_curve(per[:, d], clean[d], corrupt[d], percentages, n[d]) for d in draws]
    fs = torch.stack([x[0] for x in boot])
    c0, c0_se = pooled_mean(clean, n)
    c1, c1_se = pooled_mean(corrupt, n)
    one = per.shape[1] < 2  # a bootstrap of one row has no spread to show: the errors are not known
    f_se = [float("nan")] * len(sizes) if one else fs.std(0).tolist()
    cpr_se, cmd_se = (float("nan"),) * 2 if one else (float(torch.stack([x[k] for x in boot]).std()) for k in (1, 2))
    return Faithfulness(
        list(percentages), list(sizes), list(kept), f.tolist(), f_se, float(cpr), cpr_se, float(cmd), cmd_se,
        c0, c0_se, c1, c1_se,
    )  # fmt: skip


def pooled_mean(values: torch.Tensor, n: torch.Tensor) -> tuple[float, float]:
    """``sum values / sum n`` over rows and its standard error (the ratio estimator's over rows)."""
    v, w = values.double(), n.double()
    r, se = pooled_ratio(v.sum(), w.sum(), (v * v).sum(), (v * w).sum(), (w * w).sum(), len(v))
    return float(r), float(se)


def faithfulness(
    model: ModelLike,
    pairs: Sequence[Pair],
    scores: EdgeScores,
    *,
    percentages: Sequence[float] = PERCENTAGES,
    batch_size: int = BATCH_PAIRS,
    seed: int = 0,
) -> Faithfulness:
    """The faithfulness curve of ``scores``' top circuits on ``pairs`` (the module docstring); the clean run's
    metric is the scores' own where they were made on these pairs (:meth:`~storylens.circuits.edges.EdgeScores.clean_for`)."""
    sizes = [int(p * scores.graph.n_edges) for p in percentages]
    circuits = [top_circuit(scores, n) for n in sizes]
    empty = torch.zeros_like(circuits[0])
    everything = ~scores.mean.isnan()
    metrics = edge_metrics(
        model, pairs, [*circuits, empty, everything], batch_size=batch_size, clean=scores.clean_for(pairs)
    )
    ones = torch.ones(metrics.shape[1], dtype=torch.float64)
    kept = [int(c.sum()) for c in circuits]
    return curve_of(metrics[: len(sizes)], metrics[-1], metrics[-2], ones, sizes, kept, percentages, seed)
