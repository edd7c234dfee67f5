"""Edge patching: a model run with the edges of a set carrying their ablated values (EAP-IG's ``evaluate_graph``),
the exact runs behind :mod:`storylens.circuits.faithfulness` and :mod:`storylens.circuits.oracle`.

A circuit ``C`` is a set of edges; every edge outside it carries the corrupt run's value.
Each receiver ``v`` then reads ``x_v = x - sum_{u -> v not in C} (a[u] - a_corrupt[u])``: the residual stream of
this run less, for each ablated edge into it, the writer's output in this run against its output on the
corrupt prompt (EAP-IG's ``evaluate_graph``). Every head's query, key and value input and every MLP's input
can differ, so one forward pass carries ``1 + R`` copies of each pair along the batch (``R`` a block's
receivers): the first is the run; at each block, copy ``r`` gets receiver ``r``'s input at ``hook_resid_pre``
(the MLP's copy its input through ``hook_attn_out``), and the run takes from it only that receiver's output
(its head's slice of ``hook_q``/``hook_k``/``hook_v``, or ``hook_mlp_out``); the logits read the run's last
residual, edited alike. With no edge ablated this is the clean run; with every edge ablated, the corrupt one.

**One copy where the model's structure is read** (:class:`_ProjectedPatcher`, what runs on GPT-2, GPT-Neo, Llama
and the native model): a head's query, key or value is its input through the block's attention norm (the module
itself) and its own slice of the projection (:meth:`~storylens.lm.AttentionLM.projection_weights`), made beside
the run rather than by a copy of the whole block; the MLP's input is replaced where its norm reads it. One pass
then costs about a forward. Both are checked on every pass: the run's first head rebuilt so must equal the
model's within the rounding of its dot products, and the MLP's norm must read the run's residual stream after
attention to the last bit; where either fails the pass is made again with copies (and the model keeps them).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable

import torch

from storylens.circuits.edges import Graph, Metric, edge_mask, graph_of
from storylens.circuits.receivers import MLP_NORMS
from storylens.core.errors import StorylensError
from storylens.lm import AttentionLM, Hook

Away = Callable[[int, torch.Tensor], torch.Tensor]  # writer, its output here -> that output less its ablated value
DENSE_SHARE = 5  # receivers' inputs made by one matrix product once a fifth of the kept diffs are used (else adds)


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
        self.written = 0  # writers whose output this pass has seen
        self.before: torch.Tensor | None = None  # the sum of every diff so far
        self.x0: torch.Tensor | None = None  # the run's block input
        self.slots = [self._slots(layer) for layer in range(lm.n_layer)]  # per block: receiver -> copy (0: the run)
        self.copies = 1 + max(max(s) for s in self.slots)
        self.plans = [self._plan(r) for r in range(len(self.graph.receivers))]
        self.kept = sorted({i for _, idx in self.plans for i in idx})  # the writers whose own diff a receiver needs
        self.rows = {w: i for i, w in enumerate(self.kept)}  # writer -> its row of buf
        self.buf: torch.Tensor | None = None  # [kept writers, batch, pos, d_model]: their diffs, filled in order
        # the running sum is read only by a receiver made from "every diff but some" (a small circuit's); without one
        # (every edge but a few: the oracle, a large circuit) only the kept writers' diffs are made
        self.summed = any(mode == "kept" for mode, _ in self.plans)

    def _cut(self, receiver: int) -> tuple[bool, ...]:
        return tuple(self.ablated[: self.graph.upstream(receiver), receiver].tolist())

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
        return self._inputs(x, [receiver], total)[0]

    def _inputs(self, x: torch.Tensor, receivers: list[int], total: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`_input` of each of ``receivers``: the kept writers' diffs they add or take off, weighed by one
        matrix product over the rows of :attr:`buf` filled so far (a loop of additions cost a pass over
        ``[batch, pos, d_model]`` per edge)."""
        plans = [self.plans[r] for r in receivers]
        k = bisect.bisect_left(self.kept, self.written)  # the kept writers seen so far: a prefix of the rows
        dense = k and sum(len(idx) for _, idx in plans) * DENSE_SHARE >= len(receivers) * k
        if dense:
            assert self.buf is not None
            coef = torch.zeros(len(receivers), k, dtype=self.buf.dtype, device=self.buf.device)
            for j, (mode, idx) in enumerate(plans):
                coef[j, [self.rows[i] for i in idx]] = -1.0 if mode == "cut" else 1.0
            sums = (coef @ self.buf[:k].reshape(k, -1)).view(len(receivers), *self.buf.shape[1:])
        out = []
        for j, (mode, idx) in enumerate(plans):
            if mode == "none":
                out.append(x)
                continue
            if dense:
                part = sums[j]
            else:
                part = torch.zeros_like(total)
                for i in idx:
                    assert self.buf is not None
                    part.add_(self.buf[self.rows[i]], alpha=-1.0 if mode == "cut" else 1.0)
            out.append(x + (part if mode == "cut" else part - total).to(x.dtype))
        return out

    def _first(self, layer: int) -> int:
        return layer * _per_block(self.graph)

    def _wanted(self, i: int) -> bool:
        """Whether writer ``i``'s diff is read: into the running sum, or alone by a receiver."""
        return self.summed or i in self.rows

    def _add(self, a: torch.Tensor) -> None:
        """The next writer's output ``a``: its diff added (:meth:`_add_diff`) where it is read, else only counted."""
        if self._wanted(self.written):
            self._add_diff(self.written, self.away(self.written, a))
        self.written += 1

    def _total(self, like: torch.Tensor) -> torch.Tensor:
        """The running sum of the diffs (where no receiver reads it, ``like``: a stand-in never read)."""
        return like if self.before is None else self.before

    def _head_diffs(self, z: torch.Tensor, w_o: torch.Tensor) -> None:
        """A block's heads' outputs from ``z`` ``[batch, pos, head, d_head]``, each diff added where it is read
        (only those heads' outputs are made)."""
        start = self.written
        heads = [h for h in range(z.shape[2]) if self._wanted(start + h)]
        out = torch.einsum("bphd,hdm->bphm", z[:, :, heads], w_o[heads]) if heads else None
        for j, h in enumerate(heads):
            assert out is not None
            self._add_diff(start + h, self.away(start + h, out[:, :, j]))
        self.written = start + z.shape[2]

    def _add_diff(self, i: int, d: torch.Tensor) -> None:
        """Writer ``i``'s diff: into the running total, and kept alone only where a receiver needs it (so a small
        circuit, or every edge but a few, never holds ``[batch, pos, writer, d_model]``)."""
        self.before = d.clone() if self.before is None else self.before.add_(d)
        row = self.rows.get(i)
        if row is not None:
            if self.buf is None:
                self.buf = torch.empty(len(self.kept), *d.shape, dtype=d.dtype, device=d.device)
            self.buf[row] = d

    def resid_pre(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, layer = self.b, hook.layer
        x0 = x[:b]
        if layer == 0:
            self._add(x0)
        self.x0 = x0
        copies = [x0] * self.copies
        slots, first = self.slots[layer], self._first(layer)
        firsts = {s: first + r for r, s in reversed(list(enumerate(slots[:-1]))) if s}  # a receiver per copy
        for s, x in zip(firsts, self._inputs(x0, list(firsts.values()), self._total(x0))):
            copies[s] = x
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
        self._head_diffs(z[: self.b], w_o)

    def attn_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, m = self.b, self.slots[hook.layer][-1]
        if not m:
            return x
        assert self.x0 is not None
        mid = self.x0 + x[:b]
        x = x.clone()
        x[m * b : (m + 1) * b] = (
            self._input(mid, self._first(hook.layer) + len(self.slots[0]) - 1, self._total(mid)) - self.x0
        )
        return x

    def mlp_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, m = self.b, self.slots[hook.layer][-1]
        if m:
            x = x.clone()
            x[:b] = x[m * b : (m + 1) * b]
        self._add(x[:b])
        return x

    def resid_post(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._input(x[: self.b], len(self.graph.receivers) - 1, self._total(x[: self.b]))  # the run alone

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


def _copied(lm: AttentionLM, ids: torch.Tensor, metric: Metric, ablated: torch.Tensor, away: Away) -> torch.Tensor:
    patcher = _EdgePatcher(lm, ablated, away, ids.shape[0])
    with lm.hooks(patcher.hooks()):  # type: ignore[arg-type]
        logits = lm.forward(ids.repeat(patcher.copies, 1))
    assert logits is not None
    return metric(logits[: ids.shape[0]]).double()


class _ProjectedPatcher(_EdgePatcher):
    """The same edge-patched pass with one copy of the batch (the module docstring): receivers of a block that share
    a cut share one normalised input, from which each head's slice of the projection is made."""

    def __init__(self, lm: AttentionLM, ablated: torch.Tensor, away: Away, b: int, norms: list[torch.nn.Module]):
        super().__init__(lm, ablated, away, b)
        self.copies, self.norms = 1, norms
        self.normed: dict[int, torch.Tensor] = {}  # copy -> this block's input for it, normalised
        self.mlp_input: tuple[torch.Tensor, torch.Tensor] | None = None  # (the run's, the MLP receiver's)
        self.failed = False

    def resid_pre(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        layer = hook.layer
        if layer == 0:
            self._add(x)
        self.x0, self.normed = x, {}
        slots, first = self.slots[layer], self._first(layer)
        firsts = {s: first + r for r, s in reversed(list(enumerate(slots[:-1]))) if s}  # a receiver per copy
        for s, y in zip(firsts, self._inputs(x, list(firsts.values()), self._total(x))):
            self.normed[s] = self.norms[layer](y)
        if layer == 0:
            self.normed[0] = self.norms[0](x)  # for the check in _project
        return x

    def _project(self, x: torch.Tensor, hook: Hook, part: str, offset: int) -> torch.Tensor:
        slots = self.slots[hook.layer][offset : offset + x.shape[2]]
        if not any(slots) and hook.layer:
            return x
        w, bias = self.lm.projection_weights(hook.layer, part)  # [n, d_model, d_head], [n, d_head]
        w = w.to(x.dtype)
        if (
            hook.layer == 0
            and part == "q"
            and not _rebuilt(x[:, :, 0], self.normed[0], w[0], None if bias is None else bias[0])
        ):
            self.failed = True
        heads = [i for i, s in enumerate(slots) if s]
        if not heads:
            return x
        x = x.clone()
        ins = torch.stack([self.normed[slots[i]] for i in heads]).flatten(1, 2)  # [heads, batch * pos, d_model]
        y = torch.bmm(ins, w[heads]).view(len(heads), *x.shape[:2], -1)  # each head from its own input
        if bias is not None:
            y = y + bias[heads].to(y.dtype)[:, None, None]
        x[:, :, heads] = y.permute(1, 2, 0, 3)
        return x

    def q(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._project(x, hook, "q", 0)

    def k(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._project(x, hook, "k", self.graph.n_head)

    def v(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._project(x, hook, "v", self.graph.n_head + self.graph.n_kv)

    def attn_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        self.mlp_input = None
        if self.slots[hook.layer][-1]:
            assert self.x0 is not None
            mid = self.x0 + x
            self.mlp_input = (mid, self._input(mid, self._first(hook.layer) + len(self.slots[0]) - 1, self._total(mid)))
        return x

    def mlp_norm(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        """A pre-hook on the MLP's norm: its input replaced by the MLP receiver's, where it is the run's."""
        if self.mlp_input is None:
            return None
        mid, mine = self.mlp_input
        self.mlp_input = None
        if not args or not torch.equal(args[0], mid):
            self.failed = True
            return None
        return (mine.to(args[0].dtype), *args[1:])

    def mlp_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        self.failed = self.failed or self.mlp_input is not None  # its norm never read the MLP receiver's input
        self._add(x)
        return x

    def resid_post(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._input(x, len(self.graph.receivers) - 1, self._total(x))


def _rebuilt(got: torch.Tensor, normed: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether one head's projection ``got`` ``[batch, pos, d_head]`` is ``normed @ w (+ bias)`` within the
    rounding of two sums of ``d`` products in another order: ``2 d u`` of the sum of their magnitudes (``u`` the
    dtype's unit roundoff) each, twice over, plus the bias's rounding; a norm or a projection not as read here
    differs by the size of the values themselves."""
    mine = normed @ w
    if bias is not None:
        mine = mine + bias.to(mine.dtype)
    u = torch.finfo(got.dtype).eps / 2
    size = normed.abs() @ w.abs() + (0 if bias is None else bias.abs().to(mine.dtype))
    return bool(((got - mine).abs() <= 4 * (normed.shape[-1] + 1) * u * size + torch.finfo(got.dtype).tiny).all())


_COPIES: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose structure the one-copy pass misread


def _norms(lm: AttentionLM) -> tuple[list[torch.nn.Module], list[torch.nn.Module]] | None:
    """Every block's attention norm and MLP norm (:data:`~storylens.circuits.edges.MLP_NORMS`), where the
    projections' weights can be read; None where not."""
    blocks = lm.blocks()
    if blocks is None or len(blocks) != lm.n_layer or lm.module in _COPIES:
        return None
    attn = [lm.attention_norm(layer) for layer in range(lm.n_layer)]
    mlp = [
        next((getattr(b, n) for n in MLP_NORMS if isinstance(getattr(b, n, None), torch.nn.Module)), None)
        for b in blocks
    ]
    try:
        lm.projection_weights(0, "q")
    except StorylensError:
        return None
    if any(n is None for n in attn) or any(n is None for n in mlp):
        return None
    return attn, mlp  # type: ignore[return-value]


@torch.no_grad()
def patch_edges(lm: AttentionLM, ids: torch.Tensor, metric: Metric, ablated: torch.Tensor, away: Away) -> torch.Tensor:
    """``metric`` ``[batch]`` (float64) on ``ids`` with the edges ``ablated`` ``[writer, receiver]`` carrying
    their ablated values (``away``: :class:`_EdgePatcher`): with one copy of the batch where the model's structure
    is read (:class:`_ProjectedPatcher`), else a copy per distinct receiver input."""
    norms = _norms(lm)
    if norms is None:
        return _copied(lm, ids, metric, ablated, away)
    patcher = _ProjectedPatcher(lm, ablated, away, ids.shape[0], norms[0])
    handles = [n.register_forward_pre_hook(patcher.mlp_norm) for n in norms[1]]
    try:
        with lm.hooks(patcher.hooks()):  # type: ignore[arg-type]
            logits = lm.forward(ids)
    finally:
        for h in handles:
            h.remove()
    if patcher.failed:
        _COPIES.add(lm.module)
        return _copied(lm, ids, metric, ablated, away)
    assert logits is not None
    return metric(logits).double()


@torch.no_grad()
def circuit_metrics(
    lm: AttentionLM,
    ids: torch.Tensor,
    metric: Metric,
    circuits: list[torch.Tensor],
    away: Away,
    ablated_run: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[circuit, batch]``: :func:`patch_edges` with every edge outside each circuit (``[writer, receiver]`` bool,
    True in it) ablated, each distinct circuit run once: one that keeps every edge is the run itself (a bare
    forward), one that keeps none is the ablated run (``ablated_run``, its metric ``[batch]``, where the caller made
    it; else patched like any other). The curve's smallest sizes often prune to nothing and its largest keeps all."""
    mask = edge_mask(graph_of(lm))
    done: dict[bytes, torch.Tensor] = {}
    out = []
    for c in circuits:
        c = c.cpu() & mask
        key = c.flatten().numpy().tobytes()
        if key not in done:
            if torch.equal(c, mask):
                logits = lm.forward(ids)
                assert logits is not None
                done[key] = metric(logits).double()
            elif ablated_run is not None and not c.any():
                done[key] = ablated_run.double()
            else:
                done[key] = patch_edges(lm, ids, metric, ~c, away)
        out.append(done[key].cpu())
    return torch.stack(out)
