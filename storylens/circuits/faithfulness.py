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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storylens.circuits.edges import EdgeScores, Graph, fitting_pairs, graph_of, run_pass, writer_outputs
from storylens.core.errors import StorylensError
from storylens.core.plain import Plain
from storylens.effects.patching import BATCH_PAIRS, Pair, PairBatch, mean_se, pair_batches, pair_metric
from storylens.lm import AttentionLM, Hook, ModelLike, wrap

PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's circuit sizes
BOOTSTRAP = 1000  # resamples of the pairs for the errors of f, CPR and CMD


def _per_block(graph: Graph) -> int:
    return graph.n_head + 2 * graph.n_kv + 1


class _EdgePatcher:
    """The hooks of one edge-patched pass over a batch of ``b`` pairs (the module docstring): ``ablated``
    ``[writer, receiver]`` (True: the edge carries the corrupt value), ``corrupt`` the writers' outputs on the
    corrupt prompts ``[batch, pos, writer, d_model]``."""

    def __init__(self, lm: AttentionLM, ablated: torch.Tensor, corrupt: torch.Tensor, b: int):
        self.lm, self.graph, self.b = lm, graph_of(lm), b
        self.ablated, self.corrupt = ablated, corrupt
        self.diff: list[torch.Tensor] = []  # per writer so far: its output in this run less on the corrupt prompt
        self.x0: torch.Tensor | None = None  # the run's block input

    def _input(self, x: torch.Tensor, receiver: int) -> torch.Tensor:
        """``x`` less the ablated edges' differences into ``receiver``."""
        n = self.graph.upstream(receiver)
        cut = self.ablated[:n, receiver].to(x.device)
        if not cut.any():
            return x
        d = torch.stack(self.diff[:n], 2)[:, :, cut]  # [batch, pos, cut writers, d_model]
        return x - d.sum(2).to(x.dtype)

    def _first(self, layer: int) -> int:
        return layer * _per_block(self.graph)

    def resid_pre(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, layer = self.b, hook.layer
        x0 = x[:b]
        if layer == 0:
            self.diff.append(x0 - self.corrupt[:, :, 0].to(x.dtype))
        self.x0 = x0
        copies = [x0] + [self._input(x0, self._first(layer) + r) for r in range(_per_block(self.graph) - 1)]
        return torch.cat(copies + [x0], 0)  # the MLP's copy: its input comes through hook_attn_out

    def _take(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        """The run's rows of ``x [copies x batch, pos, n, d]``: slot ``i`` from copy ``1 + offset + i``."""
        b, x = self.b, x.clone()
        for i in range(x.shape[2]):
            r = 1 + offset + i
            x[:b, :, i] = x[r * b : (r + 1) * b, :, i]
        return x

    def q(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._take(x, 0)

    def k(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._take(x, self.graph.n_head)

    def v(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._take(x, self.graph.n_head + self.graph.n_kv)

    def z(self, z: torch.Tensor, hook: Hook) -> None:
        w_o = self.lm.head_output_weights(hook.layer).to(z.dtype)
        out = torch.einsum("bphd,hdm->bphm", z[: self.b], w_o)
        start = len(self.diff)
        for h in range(out.shape[2]):
            self.diff.append(out[:, :, h] - self.corrupt[:, :, start + h].to(z.dtype))

    def attn_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, m = self.b, _per_block(self.graph)  # the MLP's copy is the last
        assert self.x0 is not None
        mid = self.x0 + x[:b]
        x = x.clone()
        x[m * b :] = self._input(mid, self._first(hook.layer) + m - 1) - self.x0
        return x

    def mlp_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, m = self.b, _per_block(self.graph)
        x = x.clone()
        x[:b] = x[m * b :]
        self.diff.append(x[:b] - self.corrupt[:, :, len(self.diff)].to(x.dtype))
        return x

    def resid_post(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        x = x.clone()
        x[: self.b] = self._input(x[: self.b], len(self.graph.receivers) - 1)
        return x

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
def patch_edges(lm: AttentionLM, b: PairBatch, ablated: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """The metric ``[batch]`` (float64) with the edges ``ablated`` ``[writer, receiver]`` carrying the corrupt
    run's values (``corrupt``: the writers' outputs there, :func:`~storylens.circuits.edges.writer_outputs`)."""
    patcher = _EdgePatcher(lm, ablated, corrupt, b.clean.shape[0])
    copies = 1 + _per_block(patcher.graph)
    with lm.hooks(patcher.hooks()):  # type: ignore[arg-type]
        logits = lm.forward(b.clean.repeat(copies, 1))
    assert logits is not None
    return pair_metric(logits[: b.clean.shape[0]], b).double()


def _corrupt_writers(lm: AttentionLM, b: PairBatch) -> torch.Tensor:
    _, seen = run_pass(lm, b.corrupt, b, grad=False)
    return writer_outputs(lm, seen)


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
        corrupt = _corrupt_writers(lm, b)
        out.append(torch.stack([patch_edges(lm, b, ~c, corrupt).cpu() for c in circuits]))
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


def _curve(metrics: torch.Tensor, clean: torch.Tensor, corrupt: torch.Tensor, x: Sequence[float]):
    """``f`` per size and the two areas from per-pair metrics ``[size, pair]`` (means taken over the pairs)."""
    m, c0, c1 = metrics.mean(1), clean.mean(), corrupt.mean()
    f = (m - c1) / (c0 - c1)
    xs = torch.tensor(x, dtype=torch.float64)
    width = xs[1:] - xs[:-1]
    cpr = (width * (f[1:] + f[:-1]) / 2).sum()
    cmd = (width * ((1 - f[1:]).abs() + (1 - f[:-1]).abs()) / 2).sum()
    return f, cpr, cmd


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
    total = scores.graph.n_edges
    sizes = [int(p * total) for p in percentages]
    circuits = [top_circuit(scores, n) for n in sizes]
    empty = torch.zeros_like(circuits[0])
    everything = ~scores.mean.isnan()
    metrics = edge_metrics(model, pairs, [*circuits, empty, everything], batch_size=batch_size)
    per, corrupt, clean = metrics[: len(sizes)], metrics[-2], metrics[-1]
    f, cpr, cmd = _curve(per, clean, corrupt, percentages)
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, per.shape[1], (BOOTSTRAP, per.shape[1]), generator=gen)
    boot = [_curve(per[:, d], clean[d], corrupt[d], percentages) for d in draws]
    fs = torch.stack([x[0] for x in boot])
    return Faithfulness(
        list(percentages), sizes, [int(c.sum()) for c in circuits], f.tolist(), fs.std(0).tolist(),
        float(cpr), float(torch.stack([x[1] for x in boot]).std()), float(cmd),
        float(torch.stack([x[2] for x in boot]).std()), float(clean.mean()), float(mean_se(clean[:, None])[1]),
        float(corrupt.mean()), float(mean_se(corrupt[:, None])[1]),
    )  # fmt: skip
