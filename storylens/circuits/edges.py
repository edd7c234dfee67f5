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

from dataclasses import dataclass

import torch

from storylens.core.errors import StorylensError
from storylens.effects.patching import BATCH_PAIRS, Pair, PairBatch, mean_se, pair_batches, pair_metric
from storylens.lm import AttentionLM, Hook, ModelLike, wrap

KINDS = ("q", "k", "v")  # a head's inputs


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

    def upstream(self, receiver: int) -> int:
        """How many writers (a prefix of :attr:`writers`) receiver number ``receiver`` reads."""
        per_block = 2 * self.n_kv + self.n_head + 1
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
    receiver does not read the writer), ``per_pair`` ``[pair, writer, receiver]``."""

    graph: Graph
    per_pair: torch.Tensor
    mean: torch.Tensor
    se: torch.Tensor

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


def writer_outputs(lm: AttentionLM, seen: dict, minus: dict | None = None) -> torch.Tensor:
    """``[batch, pos, writer, d_model]``: what every writer put into the residual stream on one run (less what it
    put in on the run ``minus``), filled in place, block by block: the only buffer of that size."""
    x = seen["pre"][0]
    graph = graph_of(lm)
    out = torch.empty(*x.shape[:2], len(graph.writers), x.shape[-1], dtype=x.dtype, device=x.device)
    runs = [seen] if minus is None else [seen, minus]
    with torch.no_grad():
        out[:, :, 0] = x if minus is None else x - minus["pre"][0]
        for layer in range(lm.n_layer):
            w_o = lm.head_output_weights(layer).detach().to(x.dtype)  # [head, d_head, d_model]
            first = 1 + layer * (lm.n_head + 1)
            z = runs[0]["z"][layer] if minus is None else runs[0]["z"][layer] - minus["z"][layer]
            out[:, :, first : first + lm.n_head] = torch.einsum("bphd,hdm->bphm", z, w_o)
            mlp = runs[0]["mlp"][layer] if minus is None else runs[0]["mlp"][layer] - minus["mlp"][layer]
            out[:, :, first + lm.n_head] = mlp
    return out


def run_pass(
    lm: AttentionLM, ids: torch.Tensor, b: PairBatch, grad: bool, edit: tuple[str, int, torch.Tensor] | None = None
) -> tuple[torch.Tensor, dict]:
    """One pass: the metric ``[batch]`` and every hook's tensor as the model used it (on the clean run with
    ``grad``: a zero leaf added at each residual point, so that gradients reach it); ``edit``: ``(kind, block,
    shift)`` adds ``shift`` to that hook's tensor (``pre`` at block 0: the input; ``z``; ``mlp``) first."""
    seen: dict[str, dict[int, torch.Tensor]] = {k: {} for k in _names(lm)}
    leaves: dict[str, dict[int, torch.Tensor]] = {"pre": {}, "attn": {}, "post": {}}

    def keeper(kind: str):
        def keep(x: torch.Tensor, hook: Hook) -> torch.Tensor:
            layer = hook.layer if kind != "post" else 0
            if edit is not None and edit[:2] == (kind, layer):
                x = x + edit[2].to(x.dtype)
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

    hooks = [(n, keeper(kind)) for kind, names in _names(lm).items() for n in names]
    with torch.enable_grad() if grad else torch.no_grad(), lm.hooks(hooks):
        logits = lm.forward(ids)
        assert logits is not None
        metric = pair_metric(logits, b)
        missing = [k for k, v in seen.items() if len(v) != len(_names(lm)[k])]
        if missing:
            raise StorylensError(f"{lm.name}: the hook points {', '.join(missing)} did not fire in every block")
        if grad:
            outputs = [t for k in (*KINDS, "mlp") for t in seen[k].values()] + list(leaves["post"].values())
            metric.sum().backward(inputs=outputs, retain_graph=True)  # each receiver's own path: below
    seen["leaves"] = leaves  # type: ignore[assignment]
    return metric.detach(), seen


def _receiver_grads(lm: AttentionLM, seen: dict, layer: int) -> torch.Tensor:
    """``[batch, pos, receiver, d_model]``: block ``layer``'s receivers' gradients ``g_v`` (the module docstring)."""
    leaves = seen["leaves"]
    out = []
    for kind in KINDS:
        t = seen[kind][layer]  # [batch, pos, head or kv head, d_head], its .grad the metric's
        for h in range(t.shape[2]):
            g = torch.zeros_like(t)
            g[:, :, h] = t.grad[:, :, h]
            (x,) = torch.autograd.grad(t, leaves["pre"][layer], grad_outputs=g, retain_graph=True)
            out.append(x)
    mlp = seen["mlp"][layer]
    (x,) = torch.autograd.grad(mlp, leaves["attn"][layer], grad_outputs=mlp.grad, retain_graph=True, allow_unused=True)
    if x is None:  # a parallel block: the MLP reads the block's input
        (x,) = torch.autograd.grad(mlp, leaves["pre"][layer], grad_outputs=mlp.grad, retain_graph=True)
    out.append(x)
    return torch.stack(out, 2)


METHODS = ("eap", "eap-ig-inputs", "eap-ig-activations")
DIFF_BYTES = 256 << 20  # the writers' difference buffer a batch may hold: pairs per batch chosen to fit
IG_STEPS = 5  # EAP-IG's integration steps by default (Hanna et al. 2024 use 5 on GPT-2's greater-than)


def _edits(lm: AttentionLM, method: str, steps: int, clean: dict, corrupt: dict) -> list:
    """Where each gradient is taken (EAP-IG's code): ``eap`` the clean run; ``eap-ig-inputs`` the input moved from
    the corrupt one to the clean one, ``k / steps`` of the way for ``k = 0 .. steps - 1``; ``eap-ig-activations``
    each node in turn (the input, a block's heads together, an MLP) moved so, ``k = 1 .. steps``."""
    if method == "eap":
        return [None]
    nodes = [("pre", 0)] + [(kind, layer) for layer in range(lm.n_layer) for kind in ("z", "mlp")]
    ks = range(steps) if method == "eap-ig-inputs" else range(1, steps + 1)
    nodes = nodes[:1] if method == "eap-ig-inputs" else nodes
    out = []
    for kind, layer in nodes:
        diff = (corrupt[kind][layer] - clean[kind][layer]).detach()
        out += [(kind, layer, (1 - k / steps) * diff) for k in ks]
    return out


def _contract(lm: AttentionLM, graph: Graph, run: dict, delta: torch.Tensor) -> torch.Tensor:
    """``[batch, writer, receiver]`` float64: the differences ``delta`` against every receiver's gradient on the
    gradient pass ``run``, one block's receivers at a time (each against the writers it can read)."""
    scores = torch.zeros(delta.shape[0], len(graph.writers), len(graph.receivers), dtype=torch.float64)
    per_block = 2 * lm.n_kv_head + lm.n_head + 1
    for layer in range(lm.n_layer):
        up = graph.upstream(layer * per_block + per_block - 1)  # its MLP's writers: the most of the block
        g = _receiver_grads(lm, run, layer)  # [batch, pos, receivers, d_model]
        cols = slice(layer * per_block, (layer + 1) * per_block)
        scores[:, :up, cols] = torch.einsum("bpwd,bprd->bwr", delta[:, :, :up], g).double().cpu()
    g = run["leaves"]["post"][0].grad  # the logits' receiver
    scores[:, :, -1] = torch.einsum("bpwd,bpd->bw", delta, g).double().cpu()
    return scores


def fitting_pairs(lm: AttentionLM, pairs: list[Pair], batch_size: int) -> int:
    """Pairs per batch: at most ``batch_size``, and as many as keep ``[batch, pos, writer, d_model]`` within
    :data:`DIFF_BYTES` (at least one)."""
    tokens = max(len(p.clean_ids) for p in pairs)
    d_model = lm.head_output_weights(0).shape[-1]
    per_pair = tokens * len(graph_of(lm).writers) * d_model * torch.finfo(lm.dtype).bits // 8
    return max(1, min(batch_size, DIFF_BYTES // max(per_pair, 1)))


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
    n_recv, n_writ = len(graph.receivers), len(graph.writers)
    per_pair = []
    for b in pair_batches(lm, pairs, fitting_pairs(lm, pairs, batch_size)):
        _, corrupt = run_pass(lm, b.corrupt, b, grad=False)
        if method == "eap":  # the gradient pass is the clean run: its activations are the clean ones
            _, run = run_pass(lm, b.clean, b, grad=True)
            delta = writer_outputs(lm, corrupt, minus=run)  # [batch, pos, writer, d_model], the model's dtype
            scores = _contract(lm, graph, run, delta)
            edits: list = [None]
        else:
            _, clean = run_pass(lm, b.clean, b, grad=False)
            delta = writer_outputs(lm, corrupt, minus=clean)
            edits = _edits(lm, method, steps, clean, corrupt)
            scores = torch.zeros(b.clean.shape[0], n_writ, n_recv, dtype=torch.float64)
            for e in edits:  # one gradient pass at a time
                scores += _contract(lm, graph, run_pass(lm, b.clean, b, grad=True, edit=e)[1], delta)
        per_pair.append(scores / len(edits))
    s = torch.cat(per_pair)  # [pair, writer, receiver]
    mask = torch.zeros(n_writ, n_recv, dtype=torch.bool)
    for v in range(n_recv):
        mask[: graph.upstream(v), v] = True
    s = s.masked_fill(~mask, float("nan"))
    mean, se = mean_se(s)
    return EdgeScores(graph, s, mean, se)
