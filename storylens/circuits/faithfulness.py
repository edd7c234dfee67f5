"""Circuits of edges, run exactly (edge patching), and their faithfulness (MIB's circuit track, Mueller et al.
2025): the graph and the edge scores are :mod:`storylens.circuits.edges`'.

**Edge patching.** A circuit ``C`` is a set of edges; every edge outside it carries the corrupt run's value.
Each receiver ``v`` then reads ``x_v = x - sum_{u -> v not in C} (a[u] - a_corrupt[u])``: the residual stream of
this run less, for each ablated edge into it, the writer's output in this run against its output on the
corrupt prompt (EAP-IG's ``evaluate_graph``). Every head's query, key and value input and every MLP's input
can differ, so one forward pass carries ``1 + R`` copies of each pair along the batch (``R`` a block's
receivers): the first is the run; at each block, copy ``r`` gets receiver ``r``'s input at ``hook_resid_pre``
(the MLP's copy its input through ``hook_attn_out``), and the run takes from it only that receiver's output
(its head's slice of ``hook_q``/``hook_k``/``hook_v``, or ``hook_mlp_out``); the logits read the run's last
residual, edited alike. With no edge ablated this is the clean run; with every edge ablated, the corrupt one.

**Faithfulness** of a circuit: ``f = (m(C) - m(empty)) / (m(model) - m(empty))`` on the pairs' mean metric,
``m(empty)`` every edge ablated (the corrupt metric), ``m(model)`` none (the clean one). Circuits of the top
``n`` edges by ``|score|`` at MIB's sizes (0.1 % .. 100 % of the edges, ``n = int(pct x edges)``), pruned
as EAP-IG's ``Graph.prune`` does (a node without an edge in and out leaves, with its edges, until none does);
CPR is the area under ``f`` over the edge fraction (trapezoids), CMD the area of ``|1 - f|``; each with a
bootstrap standard error over the pairs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from storylens.circuits.edges import EdgeScores, Graph, Metric, fitting_pairs, graph_of, run_pass, writer_outputs
from storylens.core.errors import StorylensError
from storylens.core.plain import Plain
from storylens.effects.patching import BATCH_PAIRS, Pair, PairBatch, pair_batches, pair_metric
from storylens.engine.accumulate import pooled_ratio
from storylens.lm import AttentionLM, Hook, ModelLike, wrap

PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's circuit sizes
BOOTSTRAP = 1000  # resamples of the pairs for the errors of f, CPR and CMD
Away = Callable[[int, torch.Tensor], torch.Tensor]  # writer, its output here -> that output less its ablated value


def _per_block(graph: Graph) -> int:
    return graph.n_head + 2 * graph.n_kv + 1


class _EdgePatcher:
    """The hooks of one edge-patched pass over a batch of ``b`` rows (the module docstring): ``ablated``
    ``[writer, receiver]`` (True: the edge carries the ablated value), ``away(i, a)`` writer ``i``'s output ``a``
    ``[batch, pos, d_model]`` in this run less its ablated value (on the corrupt prompt, or its mean).

    Receivers of a block whose ablated edges are the same read the same input, so they share a copy, and one
    with none ablated reads the run itself (copy 0): a small circuit (most receivers cut from everything) or
    every edge but one (the oracle) needs two or three copies, not one per receiver. :attr:`copies` is the most
    any block needs; a block needing fewer fills the rest with the run's input."""

    def __init__(self, lm: AttentionLM, ablated: torch.Tensor, away: Away, b: int):
        self.lm, self.graph, self.b = lm, graph_of(lm), b
        self.ablated, self.away = ablated.cpu(), away
        self.diff: list[torch.Tensor] = []  # per writer so far: its output here less its ablated value (or None)
        self.before: torch.Tensor | None = None  # the sum of every diff so far
        self.x0: torch.Tensor | None = None  # the run's block input
        self.slots = [self._slots(layer) for layer in range(lm.n_layer)]  # per block: receiver -> copy (0: the run)
        self.copies = 1 + max(max(s) for s in self.slots)
        self.plans = [self._plan(r) for r in range(len(self.graph.receivers))]
        self.kept = {i for _, idx in self.plans for i in idx}  # the writers whose own diff a receiver needs

    def _cut(self, receiver: int) -> tuple[bool, ...]:
        return tuple(bool(x) for x in self.ablated[: self.graph.upstream(receiver), receiver])

    def _plan(self, receiver: int) -> tuple[str, list[int]]:
        """How ``receiver``'s input is made: ``("none", [])`` nothing ablated; ``("cut", writers)`` the run's less
        those writers' diffs; ``("kept", writers)`` the run's less every upstream diff but those (fewer to add)."""
        cut = self._cut(receiver)
        n_cut = sum(cut)
        if n_cut == 0:
            return "none", []
        if n_cut <= len(cut) - n_cut:
            return "cut", [i for i, c in enumerate(cut) if c]
        return "kept", [i for i, c in enumerate(cut) if not c]

    def _slots(self, layer: int) -> list[int]:
        """Block ``layer``'s receivers' copies: 0 where nothing into it is ablated, else one copy per distinct set
        of ablated edges (the MLP's always its own: its input comes through ``hook_attn_out``)."""
        first, per = self._first(layer), _per_block(self.graph)
        seen: dict[tuple[bool, ...], int] = {}
        out = []
        for r in range(per - 1):
            cut = self._cut(first + r)
            out.append(0 if not any(cut) else seen.setdefault(cut, len(seen) + 1))
        out.append(0 if not any(self._cut(first + per - 1)) else len(seen) + 1)
        return out

    def _input(self, x: torch.Tensor, receiver: int, total: torch.Tensor) -> torch.Tensor:
        """``x`` less the ablated edges' differences into ``receiver`` (``total``: every upstream writer's summed)."""
        mode, idx = self.plans[receiver]
        if mode == "none":
            return x
        part = torch.zeros_like(total)
        for i in idx:
            part = part + self.diff[i]
        return x - (part if mode == "cut" else total - part).to(x.dtype)

    def _first(self, layer: int) -> int:
        return layer * _per_block(self.graph)

    def _add_diff(self, d: torch.Tensor) -> None:
        """Writer ``len(self.diff)``'s diff: into the running total, and kept alone only where a receiver needs it
        (so a small circuit, or every edge but a few, never holds ``[batch, pos, writer, d_model]``)."""
        self.before = d.clone() if self.before is None else self.before + d
        self.diff.append(d if len(self.diff) in self.kept else None)  # type: ignore[arg-type]

    def resid_pre(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, layer = self.b, hook.layer
        x0 = x[:b]
        if layer == 0:
            self._add_diff(self.away(0, x0))
        self.x0 = x0
        assert self.before is not None
        copies = [x0] * self.copies
        slots, first = self.slots[layer], self._first(layer)
        for r, s in enumerate(slots[:-1]):
            if s:
                copies[s] = self._input(x0, first + r, self.before)
        return torch.cat(copies, 0)  # the MLP's copy: its input comes through hook_attn_out

    def _take(self, x: torch.Tensor, hook: Hook, offset: int) -> torch.Tensor:
        """The run's rows of ``x [copies x batch, pos, n, d]``: slot ``i`` from its receiver's copy."""
        b, slots = self.b, self.slots[hook.layer]
        if not any(slots[offset : offset + x.shape[2]]):
            return x
        x = x.clone()
        for i in range(x.shape[2]):
            r = slots[offset + i]
            if r:
                x[:b, :, i] = x[r * b : (r + 1) * b, :, i]
        return x

    def q(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._take(x, hook, 0)

    def k(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._take(x, hook, self.graph.n_head)

    def v(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._take(x, hook, self.graph.n_head + self.graph.n_kv)

    def z(self, z: torch.Tensor, hook: Hook) -> None:
        w_o = self.lm.head_output_weights(hook.layer).to(z.dtype)
        out = torch.einsum("bphd,hdm->bphm", z[: self.b], w_o)
        start = len(self.diff)
        for h in range(out.shape[2]):
            self._add_diff(self.away(start + h, out[:, :, h]))

    def attn_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, m = self.b, self.slots[hook.layer][-1]
        if not m:
            return x
        assert self.x0 is not None and self.before is not None
        mid = self.x0 + x[:b]
        x = x.clone()
        x[m * b : (m + 1) * b] = (
            self._input(mid, self._first(hook.layer) + len(self.slots[0]) - 1, self.before) - self.x0
        )
        return x

    def mlp_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, m = self.b, self.slots[hook.layer][-1]
        if m:
            x = x.clone()
            x[:b] = x[m * b : (m + 1) * b]
        self._add_diff(self.away(len(self.diff), x[:b]))
        return x

    def resid_post(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        assert self.before is not None
        return self._input(x[: self.b], len(self.graph.receivers) - 1, self.before)  # the run alone to the logits

    def hooks(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for i in range(self.lm.n_layer):
            out += [
                (f"blocks.{i}.hook_resid_pre", self.resid_pre),
                (f"blocks.{i}.attn.hook_q", self.q),
                (f"blocks.{i}.attn.hook_k", self.k),
                (f"blocks.{i}.attn.hook_v", self.v),
                (f"blocks.{i}.attn.hook_z", self.z),
                (f"blocks.{i}.hook_attn_out", self.attn_out),
                (f"blocks.{i}.hook_mlp_out", self.mlp_out),
            ]
        return out + [(f"blocks.{self.lm.n_layer - 1}.hook_resid_post", self.resid_post)]


@torch.no_grad()
def patch_edges(lm: AttentionLM, ids: torch.Tensor, metric: Metric, ablated: torch.Tensor, away: Away) -> torch.Tensor:
    """``metric`` ``[batch]`` (float64) on ``ids`` with the edges ``ablated`` ``[writer, receiver]`` carrying
    their ablated values (``away``: :class:`_EdgePatcher`)."""
    patcher = _EdgePatcher(lm, ablated, away, ids.shape[0])
    with lm.hooks(patcher.hooks()):  # type: ignore[arg-type]
        logits = lm.forward(ids.repeat(patcher.copies, 1))
    assert logits is not None
    return metric(logits[: ids.shape[0]]).double()


def _corrupt_away(lm: AttentionLM, b: PairBatch, metric: Metric) -> Away:
    """Each writer's output less its output on the corrupt prompts."""
    _, seen = run_pass(lm, b.corrupt, metric, grad=False)
    corrupt = writer_outputs(lm, seen)  # [batch, pos, writer, d_model]
    return lambda i, a: a - corrupt[:, :, i].to(a.dtype)


def edge_metrics(
    model: ModelLike, pairs: Sequence[Pair], circuits: Sequence[torch.Tensor], *, batch_size: int = BATCH_PAIRS
) -> torch.Tensor:
    """``[circuit, pair]``: the metric with every edge outside each circuit (``[writer, receiver]`` bool, True
    in the circuit) ablated."""
    lm = wrap(model)
    if not pairs:
        raise StorylensError("circuit: no pairs")
    out = []
    for b in pair_batches(lm, list(pairs), fitting_pairs(lm, list(pairs), batch_size)):
        metric = functools.partial(pair_metric, b=b)
        away = _corrupt_away(lm, b, metric)
        out.append(torch.stack([patch_edges(lm, b.clean, metric, ~c, away).cpu() for c in circuits]))
    return torch.cat(out, 1)


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
    """The faithfulness curve of ``scores``' top circuits on ``pairs`` (the module docstring)."""
    sizes = [int(p * scores.graph.n_edges) for p in percentages]
    circuits = [top_circuit(scores, n) for n in sizes]
    empty = torch.zeros_like(circuits[0])
    everything = ~scores.mean.isnan()
    metrics = edge_metrics(model, pairs, [*circuits, empty, everything], batch_size=batch_size)
    ones = torch.ones(metrics.shape[1], dtype=torch.float64)
    kept = [int(c.sum()) for c in circuits]
    return curve_of(metrics[: len(sizes)], metrics[-1], metrics[-2], ones, sizes, kept, percentages, seed)
