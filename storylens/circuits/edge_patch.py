"""Edge patching: a model run with the edges of a set carrying their ablated values (EAP-IG's ``evaluate_graph``),
the exact runs behind :mod:`storylens.circuits.faithfulness` and :mod:`storylens.circuits.oracle`.

A circuit ``C`` is a set of edges; every edge outside it carries the corrupt run's value.
Each receiver ``v`` then reads ``x_v = x - sum_{u -> v not in C} (a[u] - a_corrupt[u])``: the residual stream of
this run less, for each ablated edge into it, the writer's output in this run against its output on the
corrupt prompt (EAP-IG's ``evaluate_graph``). Where most edges into ``v`` are ablated it reads, equally,
``x_v = base_v + sum_{u -> v in C} (a[u] - a_corrupt[u])``, ``base_v`` the residual stream with every edge
ablated (:class:`Bases`: the same for every circuit of a batch, made once by :func:`ablated_bases`); a receiver
cut from everything reads ``base_v`` itself, and its head's query, key or value is the one made once from it.

Every head's query, key and value input and every MLP's input can differ, so one forward pass carries ``1 + R``
copies of each pair along the batch (``R`` a block's receivers): the first is the run; at each block, copy ``r``
gets receiver ``r``'s input at ``hook_resid_pre`` (the MLP's copy its input through ``hook_attn_out``), and the run
takes from it only that receiver's output (its head's slice of ``hook_q``/``hook_k``/``hook_v``, or
``hook_mlp_out``); the logits read the run's last residual, edited alike. With no edge ablated this is the clean
run; with every edge ablated, the corrupt one.

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

import torch

from storylens.circuits.bases import Away, Bases, ablated_bases, block_hooks, mark_misread, norms_of
from storylens.circuits.edges import Graph, Metric, edge_mask, graph_of, logits_of
from storylens.lm import AttentionLM, Hook


def _dense(adds: int, receivers: int, rows: int) -> bool:
    """Whether ``receivers``' inputs, ``adds`` diffs in all, are made by one matrix product over ``rows`` diffs
    rather than by additions: the product once the additions are at least ``(4 + receivers) / 6`` of its rows (a
    row read costs about two thirds of an addition's pass, each receiver's multiply-adds on it about a sixth). Of
    the splits tried side by side on the 30 x 9 Llama and GPT-2 small (this; the product from a fifth of the rows a
    receiver, the old rule; only from twice the additions; always) it was the fastest on both."""
    return 6 * adds >= (4 + receivers) * rows


class _EdgePatcher:
    """The hooks of one edge-patched pass over a batch of ``b`` rows (the module docstring): ``ablated``
    ``[writer, receiver]`` (True: the edge carries the ablated value), ``away(i, a)`` writer ``i``'s output ``a``
    ``[batch, pos, d_model]`` in this run less its ablated value (on the corrupt prompt, or its mean), ``bases``
    the residual stream with every edge ablated (None where no receiver reads it: :func:`needs_bases`).

    Receivers of a block whose ablated edges are the same read the same input, so they share a copy, and one
    with none ablated reads the run itself (copy 0): a small circuit (most receivers cut from everything) or
    every edge but one (the oracle) needs two or three copies, not one per receiver. :attr:`copies` is the most
    any block needs; a block needing fewer fills the rest with the run's input. Only the diffs some receiver
    reads are made."""

    def __init__(self, lm: AttentionLM, ablated: torch.Tensor, away: Away, b: int, bases: Bases | None):
        self.lm, self.graph, self.b, self.bases = lm, graph_of(lm), b, bases
        self.ablated, self.away = ablated.cpu(), away
        self.written = 0  # writers whose output this pass has seen
        self.x0: torch.Tensor | None = None  # the run's block input
        self.slots = [self._slots(layer) for layer in range(lm.n_layer)]  # per block: receiver -> copy (0: the run)
        self.copies = 1 + max(max(s) for s in self.slots)
        self.plans = [self._plan(r) for r in range(len(self.graph.receivers))]
        self.kept = sorted({i for _, idx in self.plans for i in idx})  # the writers whose own diff a receiver needs
        self.rows = {w: i for i, w in enumerate(self.kept)}  # writer -> its row of buf
        self.buf: torch.Tensor | None = None  # [kept writers, batch, pos, d_model]: their diffs, filled in order
        self.cut_rows = self.ablated[self.kept].float()  # [kept writers, receiver]: 1 where the edge is ablated

    def _cut(self, receiver: int) -> tuple[bool, ...]:
        return tuple(self.ablated[: self.graph.upstream(receiver), receiver].tolist())

    def _plan(self, receiver: int) -> tuple[str, list[int]]:
        """How ``receiver``'s input is made: ``("none", [])`` nothing ablated; ``("cut", writers)`` the run's less
        those writers' diffs; ``("kept", writers)`` the base (every edge ablated) and those writers' diffs (fewer
        to add; none: the base itself)."""
        cut = self._cut(receiver)
        n_cut = sum(cut)
        if n_cut == 0:
            return "none", []
        if n_cut <= len(cut) - n_cut:
            return "cut", [i for i, c in enumerate(cut) if c]
        return "kept", [i for i, c in enumerate(cut) if not c]

    def _base(self, where: str, layer: int = 0) -> torch.Tensor | None:
        """The stream with every edge ablated at block ``layer``'s input (``pre``) or middle (``mid``), or the
        end (``post``); None where no receiver reads it."""
        if self.bases is None:
            return None
        return self.bases.post if where == "post" else getattr(self.bases, where)[layer]

    def _alone(self, receiver: int) -> bool:
        """Whether ``receiver`` is cut from every writer: it reads the base itself."""
        return self.plans[receiver] == ("kept", [])

    def _slots(self, layer: int) -> list[int]:
        """Block ``layer``'s receivers' copies: 0 where nothing into it is ablated, else one copy per distinct set
        of ablated edges (the MLP's always its own: its input comes through ``hook_attn_out``)."""
        first, per = self._first(layer), self.graph.per_block
        seen: dict[tuple[bool, ...], int] = {}
        out = []
        for r in range(per - 1):
            cut = self._cut(first + r)
            out.append(0 if not any(cut) else seen.setdefault(cut, len(seen) + 1))
        out.append(0 if not any(self._cut(first + per - 1)) else len(seen) + 1)
        return out

    def _input(self, x: torch.Tensor, receiver: int, base: torch.Tensor | None) -> torch.Tensor:
        """``x`` less the ablated edges' diffs into ``receiver`` (``base``: the stream there, every edge ablated)."""
        return self._inputs(x, [receiver], base)[0]

    def _inputs(self, x: torch.Tensor, receivers: list[int], base: torch.Tensor | None) -> list[torch.Tensor]:
        """:meth:`_input` of each of ``receivers``: the kept writers' diffs they take off ``x`` or add to ``base``,
        weighed by one matrix product over the rows of :attr:`buf` filled so far (a loop of additions cost a pass
        over ``[batch, pos, d_model]`` per edge)."""
        plans = [self.plans[r] for r in receivers]
        k = bisect.bisect_left(self.kept, self.written)  # the kept writers seen so far: a prefix of the rows
        dense = k and _dense(sum(len(idx) for _, idx in plans), len(receivers), k)
        if dense:
            assert self.buf is not None
            cut = self.cut_rows[:k, receivers].T  # [receiver, k]: every row k is upstream of these receivers
            by_cut = torch.tensor([m == "cut" for m, _ in plans], dtype=torch.bool)[:, None]
            coef = torch.where(by_cut, -cut, 1.0 - cut)
            coef = coef.to(device=self.buf.device, dtype=self.buf.dtype)
            sums = (coef @ self.buf[:k].reshape(k, -1)).view(len(receivers), *self.buf.shape[1:])
        out = []
        for j, (mode, idx) in enumerate(plans):
            if mode == "none":
                out.append(x)
                continue
            start = x if mode == "cut" else base
            assert start is not None  # a receiver made from the base: needs_bases said so
            if not idx:
                out.append(start.to(x.dtype))
                continue
            if dense:
                out.append(start.to(x.dtype) + sums[j].to(x.dtype))
                continue
            assert self.buf is not None
            sign = -1.0 if mode == "cut" else 1.0
            y = torch.add(start, self.buf[self.rows[idx[0]]], alpha=sign)
            for i in idx[1:]:
                y.add_(self.buf[self.rows[i]], alpha=sign)
            out.append(y.to(x.dtype))
        return out

    def _first(self, layer: int) -> int:
        return layer * self.graph.per_block

    def _mlp(self, layer: int) -> int:  # block ``layer``'s MLP receiver
        return self._first(layer) + self.graph.per_block - 1

    def _add(self, a: torch.Tensor) -> None:
        """The next writer's output ``a``: its diff kept where a receiver reads it, else only counted."""
        if self.written in self.rows:
            self._add_diff(self.written, self.away(self.written, a))
        self.written += 1

    def _head_diffs(self, layer: int, z: torch.Tensor, w_o: torch.Tensor) -> None:
        """Block ``layer``'s heads' diffs from their ``z`` ``[batch, pos, head, d_head]`` (:meth:`Away.heads`),
        through their slices of ``W_O`` ``[head, d_head, d_model]`` straight into their rows of :attr:`buf` (those
        some receiver reads: consecutive rows, as the kept writers are in order), one product."""
        start = self.written
        heads = [h for h in range(z.shape[2]) if start + h in self.rows]
        self.written = start + z.shape[2]
        if not heads:
            return
        dz = self.away.heads(layer, z)[:, :, heads]  # [batch, pos, kept heads, d_head]
        b, p = dz.shape[:2]
        buf = self._buffer((b, p, w_o.shape[-1]), dz)
        first = self.rows[start + heads[0]]
        out = buf[first : first + len(heads)].view(len(heads), b * p, -1)
        with torch.no_grad():  # an exact run: no graph (out= takes none)
            torch.bmm(dz.permute(2, 0, 1, 3).reshape(len(heads), b * p, -1), w_o[heads], out=out)

    def _buffer(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """:attr:`buf`, ``[kept writers, *shape]``, made at the first diff (the bases' spare passed on where it fits:
        a fresh one each run is a page fault per 4 kB written)."""
        if self.buf is None:
            n, held = len(self.kept), self.bases
            spare = None if held is None else held.spare
            if spare is None or len(spare) < n or spare.shape[1:] != shape or spare.dtype != like.dtype:
                if held is not None:
                    held.spare = None  # a smaller one let go of before the new one is made
                spare = torch.empty(n, *shape, dtype=like.dtype, device=like.device)
            if held is not None:
                held.spare = spare
            self.buf = spare[:n]
        return self.buf

    def _add_diff(self, i: int, d: torch.Tensor) -> None:
        """Writer ``i``'s diff, kept in its row of :attr:`buf` (so a small circuit, or every edge but a few, never
        holds ``[batch, pos, writer, d_model]``)."""
        self._buffer(tuple(d.shape), d)[self.rows[i]] = d

    def resid_pre(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, layer = self.b, hook.layer
        x0 = x[:b]
        if layer == 0:
            self._add(x0)
        self.x0 = x0
        copies = [x0] * self.copies
        slots, first = self.slots[layer], self._first(layer)
        firsts = {s: first + r for r, s in reversed(list(enumerate(slots[:-1]))) if s}  # a receiver per copy
        for s, x in zip(firsts, self._inputs(x0, list(firsts.values()), self._base("pre", layer))):
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
        self._head_diffs(hook.layer, z[: self.b], w_o)

    def attn_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, m = self.b, self.slots[hook.layer][-1]
        if not m:
            return x
        assert self.x0 is not None
        mid = self.x0 + x[:b]
        x = x.clone()
        x[m * b : (m + 1) * b] = self._input(mid, self._mlp(hook.layer), self._base("mid", hook.layer)) - self.x0
        return x

    def mlp_out(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        b, m = self.b, self.slots[hook.layer][-1]
        if m:
            x = x.clone()
            x[:b] = x[m * b : (m + 1) * b]
        self._add(x[:b])
        return x

    def resid_post(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        return self._input(x[: self.b], len(self.graph.receivers) - 1, self._base("post"))  # the run alone

    def hooks(self) -> list[tuple[str, object]]:
        return block_hooks(self, self.lm.n_layer, ("resid_pre", "q", "k", "v", "z", "attn_out", "mlp_out"))


def _copied(
    lm: AttentionLM, ids: torch.Tensor, metric: Metric, ablated: torch.Tensor, away: Away, bases: Bases | None
) -> torch.Tensor:
    patcher = _EdgePatcher(lm, ablated, away, ids.shape[0], bases)
    with lm.hooks(patcher.hooks()):  # type: ignore[arg-type]
        logits = logits_of(lm, ids.repeat(patcher.copies, 1), metric, patcher.copies)
    return metric(logits[: ids.shape[0]]).double()


class _ProjectedPatcher(_EdgePatcher):
    """The same edge-patched pass with one copy of the batch (the module docstring): receivers of a block that share
    a cut share one normalised input, from which each head's slice of the projection is made; a head cut from
    everything takes its slice of the base's (:attr:`Bases.proj`, where kept)."""

    def __init__(
        self,
        lm: AttentionLM,
        ablated: torch.Tensor,
        away: Away,
        b: int,
        bases: Bases | None,
        norms: list[torch.nn.Module],
    ):
        super().__init__(lm, ablated, away, b, bases)
        self.copies, self.norms = 1, norms
        self.normed: dict[int, torch.Tensor] = {}  # copy -> this block's input for it, normalised
        # the blocks past the first with a head's input patched: there the model's own projections are not run
        # (lm.unrun_projections), every head is made here, those of the run from the input they would have read
        self.unrun_wanted = [i for i in range(1, lm.n_layer) if any(self.slots[i][:-1])]
        self.unrun: set[int] = set()
        self.inputs: dict[int, torch.Tensor] = {}  # block -> the run's normalised input, its projections'
        self.mlp_input: tuple[torch.Tensor, torch.Tensor] | None = None  # (the run's, the MLP receiver's)
        self.failed = False

    def resid_pre(self, x: torch.Tensor, hook: Hook) -> torch.Tensor:
        layer = hook.layer
        if layer == 0:
            self._add(x)
        self.x0, self.normed = x, {}
        slots, first = self.slots[layer], self._first(layer)
        firsts = {s: first + r for r, s in reversed(list(enumerate(slots[:-1]))) if s}  # a receiver per copy
        if self.bases is not None and self.bases.proj:
            firsts = {s: r for s, r in firsts.items() if not self._alone(r)}
        for s, y in zip(firsts, self._inputs(x, list(firsts.values()), self._base("pre", layer))):
            self.normed[s] = self.norms[layer](y)
        if layer == 0:
            self.normed[0] = self.norms[0](x)  # for the check in _project
        return x

    def _project(self, x: torch.Tensor, hook: Hook, part: str, offset: int) -> torch.Tensor:
        slots = self.slots[hook.layer][offset : offset + x.shape[2]]
        unrun = hook.layer in self.unrun  # x not made by the model: every head is made here
        if not any(slots) and hook.layer and not unrun:
            return x
        w, bias = self.lm.projection_weights(hook.layer, part)  # [n, d_model, d_head], [n, d_head]
        w = w.to(x.dtype)
        if (
            hook.layer == 0
            and part == "q"
            and not _rebuilt(x[:, :, 0], self.normed[0], w[0], None if bias is None else bias[0])
        ):
            self.failed = True
        heads = [i for i, s in enumerate(slots) if s and s in self.normed]
        alone = [i for i, s in enumerate(slots) if s and s not in self.normed]  # cut from everything: the base's
        if not heads and not alone and not unrun:
            return x
        if unrun:  # the run's own heads from the input the projection was given, one product
            own = [i for i, s in enumerate(slots) if not s]
            if own:
                y = self.inputs[hook.layer] @ w[own].transpose(0, 1).flatten(1)  # [batch, pos, own * d_head]
                y = y.view(*x.shape[:2], len(own), -1)
                x[:, :, own] = y if bias is None else y + bias[own].to(y.dtype)
        else:
            x = x.clone()
        if alone:
            assert self.bases is not None
            x[:, :, alone] = self.bases.proj[hook.layer][part][:, :, alone].to(x.dtype)
        if not heads:
            return x
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
            self.mlp_input = (mid, self._input(mid, self._mlp(hook.layer), self._base("mid", hook.layer)))
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
        return self._input(x, len(self.graph.receivers) - 1, self._base("post"))


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


def needs_bases(graph: Graph, ablated: torch.Tensor) -> bool:
    """Whether a run with the edges ``ablated`` ``[writer, receiver]`` reads :class:`Bases`: some receiver is cut
    from more of its writers than it keeps (every edge but a few, the oracle's runs, reads none)."""
    mask = edge_mask(graph)
    cut = (ablated.cpu() & mask).sum(0)
    return bool((2 * cut > mask.sum(0)).any())


def _given_mlps(patcher: _ProjectedPatcher) -> dict[int, torch.Tensor]:
    """The MLPs cut from every edge, each with its output on the stream with every edge ablated, its input, where
    the bases know it (:attr:`Bases.outputs`): not run (the curve's smallest circuits cut most MLPs so)."""
    outputs, per = None if patcher.bases is None else patcher.bases.outputs, patcher.graph.n_head + 1
    alone = [layer for layer in range(patcher.graph.n_layer) if patcher._alone(patcher._mlp(layer))]
    return {} if outputs is None else {layer: outputs((layer + 1) * per) for layer in alone}  # M{layer + 1}


@torch.no_grad()
def patch_edges(
    lm: AttentionLM,
    ids: torch.Tensor,
    metric: Metric,
    ablated: torch.Tensor,
    away: Away,
    bases: Bases | None = None,
) -> torch.Tensor:
    """``metric`` ``[batch]`` (float64) on ``ids`` with the edges ``ablated`` ``[writer, receiver]`` carrying
    their ablated values (``away``: :class:`_EdgePatcher`; ``bases``: :func:`ablated_bases`'s, made here where not
    given and read): with one copy of the batch where the model's structure is read (:class:`_ProjectedPatcher`),
    else a copy per distinct receiver input."""
    if bases is None and needs_bases(graph_of(lm), ablated):
        bases = ablated_bases(lm, ids, metric, away)
    norms = norms_of(lm)
    if norms is None:
        return _copied(lm, ids, metric, ablated, away, bases)
    patcher = _ProjectedPatcher(lm, ablated, away, ids.shape[0], bases, norms[0])
    handles = [n.register_forward_pre_hook(patcher.mlp_norm) for n in norms[1]]
    try:
        with (
            lm.hooks(patcher.hooks()),  # type: ignore[arg-type]
            lm.given_mlp_outputs(_given_mlps(patcher)),
            lm.unrun_projections(patcher.unrun_wanted, patcher.inputs) as patcher.unrun,
        ):
            logits = logits_of(lm, ids, metric)
    finally:
        for h in handles:
            h.remove()
    if patcher.failed:
        mark_misread(lm)
        return _copied(lm, ids, metric, ablated, away, bases)
    return metric(logits).double()


@torch.no_grad()
def circuit_metrics(
    lm: AttentionLM,
    ids: torch.Tensor,
    metric: Metric,
    circuits: list[torch.Tensor],
    away: Away,
    ablated_run: torch.Tensor | None = None,
    stream: Bases | None = None,
    clean_run: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[circuit, batch]``: :func:`patch_edges` with every edge outside each circuit (``[writer, receiver]`` bool,
    True in it) ablated, each distinct circuit run once, on one :class:`Bases` for them all where any reads it:
    ``stream`` where the caller has them (a counterfactual's: :func:`corrupt_stream`), else made by
    :func:`ablated_bases` (whose pass is the run itself: a circuit that keeps every edge takes its metric, else a
    forward gives it); one that keeps none is the ablated run (``ablated_run``, its metric ``[batch]``, where the
    caller made it; else patched like any other); one that keeps every edge is the clean run (``clean_run``, its
    metric ``[batch]``, where the caller has it). The curve's smallest sizes often prune to nothing and its largest
    keeps all."""
    graph = graph_of(lm)
    mask = edge_mask(graph)
    kept = [c.cpu() & mask for c in circuits]
    keys = [c.flatten().numpy().tobytes() for c in kept]
    every = [torch.equal(c, mask) for c in kept]
    patched = [not e and (ablated_run is None or bool(c.any())) for c, e in zip(kept, every)]
    read = any(p and needs_bases(graph, ~c) for c, p in zip(kept, patched))
    bases = (stream or ablated_bases(lm, ids, metric, away)) if read else None
    done: dict[bytes, torch.Tensor] = {}
    for c, key, e, p in zip(kept, keys, every, patched):
        if key in done:
            continue
        if p:
            done[key] = patch_edges(lm, ids, metric, ~c, away, bases)
        elif e:
            if clean_run is not None:
                done[key] = clean_run.double()
            elif bases is None or bases.metric is None:
                done[key] = metric(logits_of(lm, ids, metric)).double()
            else:
                done[key] = bases.metric
        else:
            assert ablated_run is not None
            done[key] = ablated_run.double()
    return torch.stack([done[key].cpu() for key in keys])
