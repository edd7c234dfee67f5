"""Edge attribution patching (EAP; Syed et al. 2023): every edge of the model's graph scored on a task of
clean/corrupt pairs (:mod:`storylens.effects.patching`'s pairs and metric), by one clean forward and backward
pass and one corrupt forward pass per batch.

**The graph** (EAP-IG's, Hanna et al. 2024). Writers: the input (the residual stream entering block 0:
token and position embeddings), every head (its output through its slice of the output projection,
``z_h W_O^h``) and every MLP (``hook_mlp_out``). Receivers: every head's query input (one per query head),
key and value inputs (one per key/value head: with grouped key/value heads an edge goes to the group its
query heads share, nothing is ungrouped), every MLP's input and the logits. A receiver reads every writer
before it: a head of block ``l`` the input and blocks ``0 .. l - 1``; the MLP of block ``l`` also block
``l``'s heads; the logits everything. Biases are in no writer: they are the same in both runs.

**The score** of edge ``u -> v``, per pair: ``sum_t (a_corrupt[u]_t - a_clean[u]_t) . g_v[t]``, where
``g_v = dm / d x_v`` is the metric's gradient with respect to the receiver's own copy of the residual stream
(the copy only ``v`` reads: through the block's normalisation, frozen at nothing, into its projection) on the
clean run. It estimates, to first order, the change in the metric when only that edge carries the corrupt
run's value (noising, as ``patch`` does). ``g_v`` comes from hooks: a zero leaf added to the residual stream
where the receiver reads it (``hook_resid_pre`` for heads, ``hook_attn_out`` for the MLP that reads the sum
after attention, the last ``hook_resid_post`` for the logits), the metric's gradient on the receiver's output
(``hook_q``, ``hook_k``, ``hook_v``, ``hook_mlp_out``) taken back through that receiver alone to the leaf.
The scores of every edge into a receiver sum to the receiver's input-level AtP, ``(x_corrupt - x_clean) .
g_v``, since the residual stream is the sum of the writers and the biases (checked in the tests).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from storylens.circuits.prefix import after_shared_start, start_ordered
from storylens.circuits.receivers import KINDS, mlp_input_leaves, receiver_grads, receiver_grads_at
from storylens.core.errors import StorylensError
from storylens.effects.patching import BATCH_PAIRS, Pair, PairMetric, mean_se, pair_batches, pairs_digest
from storylens.engine.gradients import BlockCost
from storylens.lm import AttentionLM, Hook, ModelLike, wrap


@dataclass(frozen=True)
class Graph:
    """The writers and receivers of a model of ``n_layer`` blocks, ``n_head`` query heads, ``n_kv`` key/value
    heads (labels as people read them: ``input``, ``L{block}H{head}``, ``M{block}``, counting from 1; a
    key/value receiver of a grouped model ``L{block}KV{group}.k``). ``reads[v]``: the writers receiver ``v`` reads."""

    n_layer: int
    n_head: int
    n_kv: int

    @property
    def writers(self) -> list[str]:
        out = ["input"]
        for layer in range(self.n_layer):
            out += [f"L{layer + 1}H{h + 1}" for h in range(self.n_head)] + [f"M{layer + 1}"]
        return out

    def _kv_label(self, layer: int, g: int, kind: str) -> str:
        if self.n_kv == self.n_head:
            return f"L{layer + 1}H{g + 1}.{kind}"
        return f"L{layer + 1}KV{g + 1}.{kind}"

    def receivers_of(self, layer: int) -> list[str]:
        """Block ``layer``'s receivers in order: the query inputs, the key and the value inputs, the MLP's."""
        q = [f"L{layer + 1}H{h + 1}.q" for h in range(self.n_head)]
        kv = [self._kv_label(layer, g, kind) for kind in ("k", "v") for g in range(self.n_kv)]
        return q + kv + [f"M{layer + 1}"]

    @property
    def receivers(self) -> list[str]:
        return [r for layer in range(self.n_layer) for r in self.receivers_of(layer)] + ["logits"]

    @property
    def per_block(self) -> int:
        """A block's receivers: its query, key and value inputs and its MLP's."""
        return self.n_head + 2 * self.n_kv + 1

    def upstream(self, receiver: int) -> int:
        """How many writers (a prefix of :attr:`writers`) receiver number ``receiver`` reads."""
        per_block = self.per_block
        layer, i = divmod(receiver, per_block)
        if layer == self.n_layer:  # the logits
            return len(self.writers)
        mlp = i == per_block - 1
        return 1 + layer * (self.n_head + 1) + (self.n_head if mlp else 0)

    @property
    def n_edges(self) -> int:
        return sum(self.upstream(r) for r in range(len(self.receivers)))


def graph_of(lm: AttentionLM) -> Graph:
    return Graph(lm.n_layer, lm.n_head, lm.n_kv_head)


@dataclass
class EdgeScores:
    """Every edge's EAP score: ``mean`` and ``se`` ``[writer, receiver]`` over the pairs (NaN where the
    receiver does not read the writer), ``per_pair`` ``[pair, writer, receiver]``; ``clean`` ``[pair]`` float64,
    each pair's metric on its clean run as the scoring passes computed it, and ``pairs`` the digest of the pairs
    it was made on (:func:`pairs_digest`; both None where not known: a corpus's scores): the exact runs on the same
    pairs take it (:meth:`clean_for`) instead of a forward of their own."""

    graph: Graph
    per_pair: torch.Tensor
    mean: torch.Tensor
    se: torch.Tensor
    clean: torch.Tensor | None = None
    pairs: str | None = None

    def clean_for(self, pairs: Sequence[Pair]) -> torch.Tensor | None:
        """:attr:`clean` where ``pairs`` are those the scores were made on (in that order), else None."""
        return self.clean if self.pairs is not None and self.pairs == pairs_digest(pairs) else None

    def edges(self) -> list[tuple[str, str, float, float]]:
        """``(writer, receiver, mean, se)`` for every edge, in the graph's order."""
        w, r = self.graph.writers, self.graph.receivers
        return [
            (w[u], r[v], float(self.mean[u, v]), float(self.se[u, v]))
            for v in range(len(r))
            for u in range(self.graph.upstream(v))
        ]


def _names(lm: AttentionLM) -> dict[str, list[str]]:
    L = range(lm.n_layer)
    return {
        "pre": [f"blocks.{i}.hook_resid_pre" for i in L],
        "attn": [f"blocks.{i}.hook_attn_out" for i in L],
        "mlp": [f"blocks.{i}.hook_mlp_out" for i in L],
        "z": [f"blocks.{i}.attn.hook_z" for i in L],
        **{kind: [f"blocks.{i}.attn.hook_{kind}" for i in L] for kind in KINDS},
        "post": [f"blocks.{lm.n_layer - 1}.hook_resid_post"],
    }


def writer_outputs(
    lm: AttentionLM,
    seen: dict,
    minus: dict | None = None,
    at: slice = slice(None),
    up: int | None = None,
    writer_first: bool = False,
) -> torch.Tensor:
    """``[batch, pos, writer, d_model]`` (``writer_first``: ``[batch, writer, pos, d_model]``, so that one
    writer's outputs over the positions are one row for a matrix product): what every writer put into the
    residual stream on one run (less what it put in on the run ``minus``), filled in place, block by block; ``at``
    only those positions, ``up`` only the first writers. The only buffer of that size (:class:`_Delta` keeps it
    within :data:`DIFF_BYTES`)."""
    x = seen["pre"][0][:, at]
    graph = graph_of(lm)
    up = len(graph.writers) if up is None else up
    b, p, d = x.shape
    buf = torch.empty(*((b, up, p, d) if writer_first else (b, p, up, d)), dtype=x.dtype, device=x.device)
    out = buf if writer_first else buf.permute(0, 2, 1, 3)  # [batch, writer, pos, d_model] either way below

    def get(kind: str, layer: int) -> torch.Tensor:
        t = seen[kind][layer][:, at]
        return t if minus is None else t - minus[kind][layer][:, at]

    with torch.no_grad():
        out[:, 0] = get("pre", 0)
        for layer in range(lm.n_layer):
            first = 1 + layer * (lm.n_head + 1)
            if first >= up:
                break
            w_o = lm.head_output_weights(layer).detach().to(x.dtype)  # [head, d_head, d_model]
            heads = min(lm.n_head, up - first)
            out[:, first : first + heads] = torch.einsum("bphd,hdm->bhpm", get("z", layer)[:, :, :heads], w_o[:heads])
            if first + lm.n_head < up:
                out[:, first + lm.n_head] = get("mlp", layer)
    return buf


class _Delta:
    """The writers' ablated-minus-run outputs of one batch, ``[batch, writer, pos, d_model]``, handed out by
    position slices: held whole where that fits :data:`DIFF_BYTES`, else made again slice by slice (no buffer of
    that size is ever held whole: one 2,000-token story on a 30-block model would need 1.4 GB)."""

    def __init__(self, lm: AttentionLM, ablated: dict, run: dict, budget: int | None = None):
        self.lm, self.ablated, self.run = lm, ablated, run
        x = run["pre"][0]
        self.batch, self.positions = x.shape[0], x.shape[1]
        per_position = self.batch * len(graph_of(lm).writers) * x.shape[-1] * x.element_size()
        self.step = max(1, min(self.positions, (DIFF_BYTES if budget is None else budget) // max(per_position, 1)))
        whole = self.step == self.positions
        self.whole = writer_outputs(lm, ablated, minus=run, writer_first=True) if whole else None

    def slices(self, up: int):
        """``(positions, [batch, up, slice, d_model])`` covering every position."""
        for t0 in range(0, self.positions, self.step):
            at = slice(t0, min(t0 + self.step, self.positions))
            if self.whole is not None:
                yield at, self.whole[:, :up]
            else:
                yield at, writer_outputs(self.lm, self.ablated, minus=self.run, at=at, up=up, writer_first=True)


Metric = Callable[[torch.Tensor], torch.Tensor]  # the logits [batch, pos, vocab] -> the metric per row [batch]


def logits_of(lm: AttentionLM, ids: torch.Tensor, metric: Metric, repeats: int = 1) -> torch.Tensor:
    """``lm``'s logits on ``ids`` (``repeats`` copies of a batch, stacked) where ``metric`` reads them: at one
    position a row where it says which (``metric.at`` ``[batch]``: :class:`~storylens.effects.patching.PairMetric`,
    the output head then a product over the vocabulary at one position, not every one), else everywhere."""
    at = getattr(metric, "at", None)
    logits = lm.forward(ids, logits=True if at is None else at.repeat(repeats))
    assert logits is not None
    return logits


def _keeper(kind: str, seen: dict, leaves: dict, grad: bool, edit) -> Callable:
    """A hook keeping ``kind``'s tensor in ``seen`` as the model used it, ``edit`` applied first; with ``grad`` a
    zero leaf added at a residual point (``leaves``), or the tensor's gradient retained."""

    def keep(x: torch.Tensor, hook: Hook) -> torch.Tensor | None:
        layer = hook.layer if kind != "post" else 0
        edited = edit is not None and edit[:2] == (kind, layer)
        if edited:
            x = x + edit[2].to(x.dtype)
        elif not grad:  # kept as it is: the model's own tensor, not put back (a fused projection is not rebuilt)
            seen[kind][layer] = x
            return None
        if grad and kind in leaves:
            leaf = torch.zeros_like(x, requires_grad=True)
            leaves[kind][layer] = leaf
            x = x + leaf
        elif grad:
            x = x.clone()
            x.retain_grad()
        seen[kind][layer] = x
        return x

    return keep


def run_pass(
    lm: AttentionLM,
    ids: torch.Tensor,
    metric: Metric,
    grad: bool,
    edit: tuple[str, int, torch.Tensor] | None = None,
    kinds: tuple[str, ...] | None = None,
) -> tuple[torch.Tensor, dict]:
    """One pass: ``metric`` ``[batch]`` and every hook's tensor as the model used it (on the clean run with
    ``grad``: a zero leaf added at each residual point, so that gradients reach it, and one graph through the
    whole model: :func:`gradient_blocks` holds one block's); ``edit``: ``(kind, block, shift)`` adds ``shift`` to
    that hook's tensor (``pre`` at block 0: the input; ``z``; ``mlp``) first; ``kinds``: only those tensors kept
    (without a graph: :data:`WRITTEN`, what the writers' outputs are made of)."""
    names = {k: v for k, v in _names(lm).items() if kinds is None or k in kinds}
    seen: dict[str, dict[int, torch.Tensor]] = {k: {} for k in names}
    leaves: dict[str, dict[int, torch.Tensor]] = {"pre": {}, "attn": {}, "post": {}, "mlp_in": {}}
    hooks = [(n, _keeper(kind, seen, leaves, grad, edit)) for kind, ns in names.items() for n in ns]
    mlp = mlp_input_leaves(lm, range(lm.n_layer), seen, leaves) if grad else contextlib.nullcontext()
    with torch.enable_grad() if grad else torch.no_grad(), lm.hooks(hooks), mlp:
        value = metric(logits_of(lm, ids, metric))
        missing = [k for k, v in seen.items() if len(v) != len(names[k])]
        if missing:
            raise StorylensError(f"{lm.name}: the hook points {', '.join(missing)} did not fire in every block")
        if grad:
            outputs = [t for k in (*KINDS, "mlp") for t in seen[k].values()] + list(leaves["post"].values())
            outputs += list(leaves["mlp_in"].values())
            value.sum().backward(inputs=outputs, retain_graph=True)  # each receiver's own path: below
    seen["leaves"] = leaves  # type: ignore[assignment]
    return value.detach(), seen


WRITTEN = ("pre", "z", "mlp")  # the hook tensors the writers' outputs are made of (and every edit's)


class _Stop(Exception):
    """Raised by a hook at a block's output: the rest of the model is not needed."""


def _block_graph(lm: AttentionLM, ids: torch.Tensor, metric: Metric, edit, layer: int, before, up) -> dict:
    """Block ``layer`` run again with a graph, from ``before`` (what block ``layer - 1`` returned; None for the
    first), its receivers' hooks as :func:`run_pass` sets them (one block's), and backpropagated: from the metric
    for the last block (``up`` None), else from ``up``, the metric's gradient on the block's output."""
    seen: dict[str, dict[int, torch.Tensor]] = {k: {} for k in _names(lm)}
    leaves: dict[str, dict[int, torch.Tensor]] = {"pre": {}, "attn": {}, "post": {}, "mlp_in": {}}
    top = up is None
    names = {kind: [n for n in ns if n.startswith(f"blocks.{layer}.")] for kind, ns in _names(lm).items()}
    hooks = [(n, _keeper(kind, seen, leaves, True, edit)) for kind, ns in names.items() for n in ns]
    got: dict[str, torch.Tensor] = {}

    def stop(x: torch.Tensor, hook: Hook) -> None:
        got["out"] = x
        raise _Stop

    if not top:
        hooks.append((f"blocks.{layer}.hook_resid_post", stop))
    skip = lm.skip_blocks(layer, before) if layer else contextlib.nullcontext()
    with torch.enable_grad(), lm.hooks(hooks), skip, mlp_input_leaves(lm, range(layer, layer + 1), seen, leaves):
        grads: torch.Tensor | None = None
        try:
            value = metric(logits_of(lm, ids, metric)).sum()
        except _Stop:
            value, grads = got["out"], up
        outputs = [seen[k][layer] for k in (*KINDS, "mlp")] + [leaves["pre"][layer]] + list(leaves["post"].values())
        outputs += list(leaves["mlp_in"].values())
        torch.autograd.backward(value, grad_tensors=grads, inputs=outputs, retain_graph=True)
    seen["leaves"] = leaves  # type: ignore[assignment]
    return seen


_COSTS: weakref.WeakKeyDictionary[torch.nn.Module, BlockCost] = weakref.WeakKeyDictionary()


def _block_cost(lm: AttentionLM, blocks: list[torch.nn.Module], ids: torch.Tensor) -> BlockCost:
    """What one block's graph holds (:class:`~storylens.engine.gradients.BlockCost`), measured once a model."""
    if lm.module not in _COSTS:
        _COSTS[lm.module] = BlockCost.measure(lm, blocks, ids[:1, : min(16, ids.shape[1])].clone())
    return _COSTS[lm.module]


def _graph_fits(lm: AttentionLM, blocks: list[torch.nn.Module], ids: torch.Tensor) -> bool:
    """Whether every block's graph on ``ids`` fits :data:`CIRCUIT_GRAPH_BYTES`: then the gradient pass is one
    forward with a graph and one backward, not a forward and every block run again."""
    return lm.n_layer * _block_cost(lm, blocks, ids).batch(ids) <= CIRCUIT_GRAPH_BYTES


def gradient_blocks(
    lm: AttentionLM, ids: torch.Tensor, metric: Metric, edit=None
) -> tuple[dict, torch.Tensor, Iterator[tuple[int, torch.Tensor]], torch.Tensor]:
    """The gradient pass, one block's graph at a time (where the whole model's fits :data:`CIRCUIT_GRAPH_BYTES`, or its
    blocks are not known: one graph, one backward): ``(run, g_logits, blocks, value)``: the run's hook tensors (as
    :func:`run_pass` keeps them, without a graph), the logits receiver's gradient ``[batch, pos, d_model]``,
    ``(layer, [batch, pos, receiver, d_model])`` from the last block to the first (each block run again from what
    the block before returned, kept by one forward pass without a graph), and the run's ``metric`` ``[batch]``. A
    model whose blocks are not known (:meth:`~storylens.lm.AttentionLM.blocks` None) gets one graph through the
    whole model."""
    blocks = lm.blocks()
    if blocks is None or len(blocks) != lm.n_layer or _graph_fits(lm, blocks, ids):
        value, run = run_pass(lm, ids, metric, grad=True, edit=edit)
        grads = ((layer, receiver_grads(lm, run, layer)) for layer in reversed(range(lm.n_layer)))
        return run, run["leaves"]["post"][0].grad, grads, value
    with lm.keep_block_outputs(range(lm.n_layer)) as kept:
        value, run = run_pass(lm, ids, metric, grad=False, edit=edit, kinds=WRITTEN)
    kept = dict(kept)
    last = _block_graph(lm, ids, metric, edit, lm.n_layer - 1, kept.get(lm.n_layer - 2), None)

    def walk() -> Iterator[tuple[int, torch.Tensor]]:
        here = last
        for layer in reversed(range(lm.n_layer)):
            yield layer, receiver_grads(lm, here, layer)
            if layer:
                up = here["leaves"]["pre"][layer].grad
                here = _block_graph(lm, ids, metric, edit, layer - 1, kept.get(layer - 2), up)

    return run, last["leaves"]["post"][0].grad, walk(), value


METHODS = ("eap", "eap-ig-inputs", "eap-ig-activations")
DIFF_BYTES = 256 << 20  # the writers' difference buffer a batch may hold: pairs per batch chosen to fit
GRAD_SUM_BYTES = 512 << 20  # EAP-IG's receivers' gradients summed over its passes, held where they fit
CIRCUIT_GRAPH_BYTES = 256 << 20  # the whole model's graph (autograd's saved tensors) a batch may hold
CONTRACT_BYTES = 32 << 20  # the receivers' gradients the contraction holds for a slice of positions
CONTRACT_GROUPS = 6  # matrix products a slice: groups of blocks, the rectangles around the triangle of edges
IG_STEPS = 5  # EAP-IG's integration steps by default (Hanna et al. 2024 use 5 on GPT-2's greater-than)


def _edits(lm: AttentionLM, method: str, steps: int, clean: dict, corrupt: dict) -> list:
    """Where each gradient is taken (EAP-IG's code): ``eap-ig-inputs`` the input moved from the corrupt one to the
    clean one, ``k / steps`` of the way for ``k = 0 .. steps - 1``; ``eap-ig-activations`` each node in turn (the
    input, a block's heads together, an MLP) moved so, ``k = 1 .. steps``. One ``(kind, block, shifts)`` a node:
    the shift to add to that hook's tensor at each step, ``[steps * batch, ...]`` (step-major), for one gradient
    pass over the batch repeated ``steps`` times."""
    nodes = [("pre", 0)] + [(kind, layer) for layer in range(lm.n_layer) for kind in ("z", "mlp")]
    ks = range(steps) if method == "eap-ig-inputs" else range(1, steps + 1)
    nodes = nodes[:1] if method == "eap-ig-inputs" else nodes
    out = []
    for kind, layer in nodes:
        diff = (corrupt[kind][layer] - clean[kind][layer]).detach()
        out.append((kind, layer, torch.cat([(1 - k / steps) * diff for k in ks])))
    return out


class _Repeated:
    """``metric`` on a batch of ``rows`` repeated ``n`` times (step-major): each repeat's rows get the metric of the
    batch's rows; it reads the logits where ``metric`` does (:func:`logits_of`)."""

    def __init__(self, metric: Metric, rows: int, n: int):
        self.metric, self.rows = metric, rows
        at = getattr(metric, "at", None)
        if at is not None:
            self.at = at.repeat(n)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.metric(part) for part in logits.split(self.rows)])


def _folded(g: torch.Tensor, rows: int) -> torch.Tensor:
    """``[repeats * rows, ...]`` summed over the repeats: ``[rows, ...]``."""
    return g.reshape(-1, rows, *g.shape[1:]).sum(0)


def _products(d: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``[batch, writer, receiver]`` float64: ``d`` ``[batch, writer, pos, d_model]`` against ``g`` ``[batch, pos,
    receiver, d_model]``, summed over positions and width: one batched matrix product (the writers' rows are laid
    out whole; an einsum over ``[batch, pos, writer, d_model]`` was five times slower on a CPU)."""
    b, w, p, m = d.shape
    g = g.permute(0, 2, 1, 3).reshape(b, -1, p * m)  # [batch, receiver, pos * d_model]: a copy, receivers are few
    return torch.bmm(d.reshape(b, w, p * m), g.transpose(1, 2)).double().cpu()


def _contract(lm: AttentionLM, graph: Graph, g_logits: torch.Tensor, grads, delta: _Delta) -> torch.Tensor:
    """``[batch, writer, receiver]`` float64: the differences ``delta`` against every receiver's gradient
    (``grads``: :func:`gradient_blocks`'), one block's receivers at a time (each against the writers it can read),
    summed over position slices."""
    scores = torch.zeros(delta.batch, len(graph.writers), len(graph.receivers), dtype=torch.float64)
    per_block = graph.per_block
    for layer, g in grads:  # g [batch, pos, receivers, d_model]
        up = graph.upstream(layer * per_block + per_block - 1)  # its MLP's writers: the most of the block
        cols = slice(layer * per_block, (layer + 1) * per_block)
        for at, d in delta.slices(up):
            scores[:, :up, cols] += _products(d, g[:, at])
        del g
    for at, d in delta.slices(len(graph.writers)):
        scores[:, :, -1:] += _products(d, g_logits[:, at, None])
    return scores


Piece = Callable[[int, slice, torch.Tensor], bool]  # block, positions, out: its receivers' gradients put there


def _contract_chunked(graph: Graph, g_logits: torch.Tensor, piece: Piece, delta: _Delta) -> torch.Tensor | None:
    """:func:`_contract`'s scores, a slice of positions at a time, where the differences are held whole and every
    block's receivers' gradients can be made at any positions (``piece(block, positions, out)`` puts them into
    ``out`` ``[receiver, batch, pos, d_model]``, False where it cannot): the slice's differences against every
    receiver's gradient there, per pair in :data:`CONTRACT_GROUPS` matrix products over groups of blocks (each
    group's receivers against the writers its last reads; the few products of a writer with a receiver that does
    not read it are dropped by the mask). A block at a time reads every earlier writer's differences from memory
    once a block; here once a slice for all of them. At most :data:`CONTRACT_BYTES` of gradients are held."""
    if delta.whole is None:
        return None
    d = delta.whole  # [batch, writer, pos, d_model]
    b, w, p, m = d.shape
    n_recv, per_block = len(graph.receivers), graph.per_block
    step = max(1, min(p, CONTRACT_BYTES // max(b * n_recv * m * d.element_size(), 1)))
    bounds = [round(graph.n_layer * i / CONTRACT_GROUPS) for i in range(CONTRACT_GROUPS + 1)]
    groups = [
        (x * per_block, n_recv if y == graph.n_layer else y * per_block) for x, y in zip(bounds, bounds[1:]) if y > x
    ]
    scores = torch.zeros(b, w, n_recv, dtype=torch.float64, device=d.device)
    for t0 in range(0, p, step):
        at = slice(t0, min(t0 + step, p))
        g = torch.empty(n_recv, b, at.stop - t0, m, dtype=d.dtype, device=d.device)  # [receiver, batch, pos, d_model]
        for layer in range(graph.n_layer):
            if not piece(layer, at, g[layer * per_block : (layer + 1) * per_block]):
                return None
        g[-1] = g_logits[:, at]
        for i in range(b):
            dd, gg = d[i, :, at].reshape(w, -1), g[:, i].reshape(n_recv, -1)  # views: [writer | receiver, pos * d]
            for c0, c1 in groups:
                up = graph.upstream(c1 - 1)
                scores[i, :up, c0:c1] += (dd[:up] @ gg[c0:c1].T).double()
    return (scores * edge_mask(graph).to(scores.device)).cpu()


def batch_scores(
    lm: AttentionLM, ids: torch.Tensor, metric: Metric, ablate: Callable[[dict], dict], method: str, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's edge scores by ``method`` (:func:`eap_scores`), ``[batch, writer, receiver]`` float64, and the
    metric of its clean run ``[batch]`` float64 (made on the way); ``ablate(run)``: the hook tensors of the ablated
    run (the corrupt prompt's, or means) given the clean run's."""
    graph = graph_of(lm)
    if method == "eap":  # the gradient pass is the clean run: its activations are the clean ones
        run, g_logits, grads, value = gradient_blocks(lm, ids, metric)
        delta = _Delta(lm, ablate(run), run)
        chunked = _contract_chunked(graph, g_logits, functools.partial(receiver_grads_at, lm, run), delta)
        scores = chunked if chunked is not None else _contract(lm, graph, g_logits, grads, delta)
        return scores, value.double()
    value, clean = run_pass(lm, ids, metric, grad=False)
    ablated = ablate(clean)
    delta = _Delta(lm, ablated, clean)
    edits = _edits(lm, method, steps, clean, ablated)
    scores = torch.zeros(ids.shape[0], len(graph.writers), len(graph.receivers), dtype=torch.float64)
    rows, each = ids.shape[0], _steps_at_once(lm, ids, steps)
    summed = _GradSums() if _GradSums.fits(lm, ids) else None
    for kind, layer, shifts in edits:  # a node's steps, as many at once as one graph holds
        for k in range(0, steps, each):
            n = min(each, steps - k)
            e = (kind, layer, shifts[k * rows : (k + n) * rows])
            _, g_logits, grads, _ = gradient_blocks(lm, ids.repeat(n, 1), _Repeated(metric, rows, n), edit=e)
            folded = ((block, _folded(g, rows)) for block, g in grads)
            if summed is not None:  # the scores are linear in the gradients: summed first, contracted once
                summed.add(_folded(g_logits, rows), folded)
            else:
                scores += _contract(lm, graph, _folded(g_logits, rows), folded, delta)
    if summed is not None and summed.logits is not None:
        chunked = _contract_chunked(graph, summed.logits, summed.at, delta)
        scores = chunked if chunked is not None else _contract(lm, graph, summed.logits, summed.blocks(), delta)
    return scores / (len(edits) * steps), value.double()


class _GradSums:
    """Every receiver's gradient summed over EAP-IG's gradient passes, ``[batch, pos, receiver, d_model]`` a
    block, where that fits :data:`GRAD_SUM_BYTES` (then one contraction with the differences a batch, not one a
    pass)."""

    def __init__(self) -> None:
        self.logits: torch.Tensor | None = None
        self.sums: dict[int, torch.Tensor] = {}

    @staticmethod
    def fits(lm: AttentionLM, ids: torch.Tensor) -> bool:
        d_model = lm.head_output_weights(0).shape[-1]
        receivers = len(graph_of(lm).receivers)
        return ids.numel() * receivers * d_model * torch.finfo(lm.dtype).bits // 8 <= GRAD_SUM_BYTES

    def add(self, g_logits: torch.Tensor, grads) -> None:
        self.logits = g_logits if self.logits is None else self.logits.add_(g_logits)
        for layer, g in grads:
            self.sums[layer] = g if layer not in self.sums else self.sums[layer].add_(g)

    def at(self, layer: int, at: slice, out: torch.Tensor) -> bool:
        out.copy_(self.sums[layer][:, at].permute(2, 0, 1, 3))
        return True

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        for layer in sorted(self.sums, reverse=True):
            yield layer, self.sums.pop(layer)


def _steps_at_once(lm: AttentionLM, ids: torch.Tensor, steps: int) -> int:
    """EAP-IG's steps of one node taken in one gradient pass over the batch repeated: as many as keep the whole
    model's graph within :data:`CIRCUIT_GRAPH_BYTES` (one pass with a graph and one backward
    each, the contraction once), else one (block by block)."""
    blocks = lm.blocks()
    if blocks is None or len(blocks) != lm.n_layer:
        return 1
    graph = lm.n_layer * _block_cost(lm, blocks, ids).batch(ids)  # the whole model's graph on the batch once
    return 1 if graph > CIRCUIT_GRAPH_BYTES else max(1, min(steps, int(CIRCUIT_GRAPH_BYTES // max(graph, 1))))


def _given(ablated: dict, run: dict) -> dict:
    """The ablated run's hook tensors, whatever the clean run's (a corrupt prompt's run, made beforehand)."""
    return ablated


def edge_mask(graph: Graph) -> torch.Tensor:
    """``[writer, receiver]`` bool: True where the receiver reads the writer (an edge)."""
    mask = torch.zeros(len(graph.writers), len(graph.receivers), dtype=torch.bool)
    for v in range(len(graph.receivers)):
        mask[: graph.upstream(v), v] = True
    return mask


def fitting_pairs(lm: AttentionLM, pairs: list[Pair], batch_size: int, graph: bool = True) -> int:
    """Pairs per batch: at most ``batch_size``, and as many as keep ``[batch, pos, writer, d_model]`` within
    :data:`DIFF_BYTES` and, with ``graph`` (a gradient pass), the whole model's graph within
    :data:`CIRCUIT_GRAPH_BYTES` (at least one; where one pair's graph does not fit, the gradient pass holds one
    block's at a time). The exact runs hold no graph: their batches are the larger, and a run's fixed costs (its
    hooks, a small product per block) are spread over more pairs."""
    tokens = max(len(p.clean_ids) for p in pairs)
    d_model = lm.head_output_weights(0).shape[-1]
    per_pair = tokens * len(graph_of(lm).writers) * d_model * torch.finfo(lm.dtype).bits // 8
    fit = DIFF_BYTES // max(per_pair, 1)
    blocks = lm.blocks()
    if graph and blocks is not None and len(blocks) == lm.n_layer:
        held = lm.n_layer * _block_cost(lm, blocks, torch.tensor([pairs[0].clean_ids])).batch(torch.zeros(1, tokens))
        fit = min(fit, int(CIRCUIT_GRAPH_BYTES // max(held, 1)))
    return max(1, min(batch_size, fit))


def eap_scores(
    model: ModelLike, pairs: list[Pair], *, method: str = "eap", steps: int = IG_STEPS, batch_size: int = BATCH_PAIRS
) -> EdgeScores:
    """Every edge's score on ``pairs`` (from :func:`~storylens.effects.patching.encode_pairs`) by ``method`` of
    :data:`METHODS` (``steps``: EAP-IG's), the mean over pairs with its standard error (module docstring): the
    writers' corrupt-minus-clean outputs against the receivers' gradients, averaged over where those are taken
    (:func:`_edits`). Each product summed over positions and width in the model's dtype, then kept in float64. A
    batch holds one ``[batch, pos, writer, d_model]`` buffer of the differences, its pairs chosen to fit
    :data:`DIFF_BYTES`, and one block's receivers' gradients at a time."""
    lm = wrap(model)
    if not pairs:
        raise StorylensError("eap: no pairs")
    if method not in METHODS or steps < 1:
        raise StorylensError(
            f"edge scores: a method of {', '.join(METHODS)} and 1 step or more (got {method}, {steps})"
        )
    graph = graph_of(lm)
    per_pair, clean = [], []
    ordered, back = start_ordered(pairs)  # pairs alike batched together
    for whole in pair_batches(lm, ordered, fitting_pairs(lm, ordered, batch_size)):
        with after_shared_start(lm, whole) as b:  # the start every pair shares run once: no difference there
            metric = PairMetric(b)
            _, corrupt = run_pass(lm, b.corrupt, metric, grad=False, kinds=WRITTEN)
            scores, value = batch_scores(lm, b.clean, metric, functools.partial(_given, corrupt), method, steps)
            per_pair.append(scores)
            clean.append(value.cpu())
    s = torch.cat(per_pair)[back].masked_fill(~edge_mask(graph), float("nan"))  # [pair, writer, receiver]
    mean, se = mean_se(s)
    return EdgeScores(graph, s, mean, se, torch.cat(clean)[back], pairs_digest(pairs))
