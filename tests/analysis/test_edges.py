"""Edge attribution patching (storylens.circuits.edges) in float64 on tiny seeded GPT-2, GPT-Neo, Llama with
grouped key/value heads and the native model: an edge's score is the metric's derivative along that edge
alone, taken here with autograd through public hook points the test drives itself (the writer's
corrupt-minus-clean output added, scaled by eps, to the residual stream, the receiver's projection or MLP run
on it in a pass of its own, and only that receiver's output put into the clean run); the scores into a
receiver sum to that derivative along the whole residual difference; the graph's edge count. The same
float64 chain rule in another order (and through the same float32 softmax where transformers' eager attention
takes one): rounding of sums of a few thousand float64 products, about 1e-14 of the score at most; the bound
is 1e-9 of it. transformers' LlamaRMSNorm works in float32 whatever the model's dtype, and storylens pulls the
receivers' gradients back through a norm itself, in the model's dtype: here that norm runs in float64 (patched for
these tests, the ``float64_rms`` fixture), so both sides are float64 chain rules."""

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("float64_rms")  # the module docstring

from storylens.circuits.edges import Graph, eap_scores
from storylens.effects.patching import pair_batches, pair_metric


def _seen(lm, ids, names, edit=None):
    """A pass with ``edit`` ({hook name: fn(x) -> x}) applied, and the tensors at ``names``, as used."""
    seen = {}

    def hook(name):
        def fn(x, h):
            x = edit[name](x) if edit and name in edit else x
            seen[name] = x.detach().clone()
            return x

        return fn

    with torch.no_grad(), lm.hooks([(n, hook(n)) for n in {*names, *(edit or {})}]):
        logits = lm.forward(ids)
    return logits, seen


def _writer(lm, b, writer):
    """The writer's corrupt-minus-clean output into the residual stream, ``[batch, pos, d_model]``."""
    kind, layer, h = writer
    name = f"blocks.{layer}.attn.hook_z" if kind == "head" else f"blocks.{layer}.hook_mlp_out"
    diffs = []
    for ids in (b.corrupt, b.clean):
        _, seen = _seen(lm, ids, [name])
        x = seen[name]
        diffs.append(x[:, :, h] @ lm.head_output_weights(layer)[h] if kind == "head" else x)
    return diffs[0] - diffs[1]


def _along(lm, ids, metric, receiver, delta):
    """d metric / d eps per row of ``ids``, with ``eps * delta`` reaching only ``receiver`` (layer, hook, index): a first
    pass with it added to the residual stream where the receiver reads it gives the receiver's output, and only
    that output (that head's slice) is put into a second, clean pass; autograd through both, from hooks here."""
    layer, kind, idx = receiver
    at = f"blocks.{layer}.hook_resid_pre" if kind != "mlp" else f"blocks.{layer}.hook_attn_out"
    out_name = f"blocks.{layer}.attn.hook_{kind}" if kind != "mlp" else f"blocks.{layer}.hook_mlp_out"
    eps = torch.zeros(delta.shape[0], 1, 1, dtype=delta.dtype, requires_grad=True)
    moved = {}

    def shift(x, hook):
        return x + eps * delta

    def keep(x, hook):
        moved["out"] = x
        return x

    def put(x, hook):
        if idx is None:
            return moved["out"]
        x = x.clone()
        x[:, :, idx] = moved["out"][:, :, idx]
        return x

    with torch.enable_grad():
        with lm.hooks([(at, shift), (out_name, keep)]):
            lm.forward(ids)
        with lm.hooks([(out_name, put)]):
            m = metric(lm.forward(ids))
        (g,) = torch.autograd.grad(m.sum(), eps)
    return g.flatten()


def test_an_edge_score_is_the_metric_derivative_along_that_edge_alone(tiny, task_pairs):
    lm, pairs = tiny, task_pairs
    r = eap_scores(lm, pairs)
    g, w, rc = r.graph, r.graph.writers, r.graph.receivers
    (b,) = pair_batches(lm, pairs)
    last = lm.n_layer - 1
    cases = [
        (("head", 0, 1), (last, "q", lm.n_head - 1), f"L{last + 1}H{lm.n_head}.q"),
        (("mlp", 0, None), (last, "k", 0), g._kv_label(last, 0, "k")),
        (("head", 0, 2), (last, "v", lm.n_kv_head - 1), g._kv_label(last, lm.n_kv_head - 1, "v")),
        (("head", last, 0), (last, "mlp", None), f"M{last + 1}"),
    ]
    for writer, receiver, label in cases:
        kind, layer, h = writer
        u = w.index(f"L{layer + 1}H{h + 1}" if kind == "head" else f"M{layer + 1}")
        want = _along(lm, b.clean, lambda x: pair_metric(x, b), receiver, _writer(lm, b, writer))
        got = r.per_pair[:, u, rc.index(label)]
        scale = want.abs().max().item()
        assert scale > 1e-9, label  # a real edge, not zeros compared
        assert (got - want).abs().max().item() <= 1e-9 * scale, label


def test_every_receiver_gradient_comes_from_the_one_backward(tiny, task_pairs, monkeypatch):
    """On the four families the query, key and value receivers' gradients come from the projections' weights and
    the norm's Jacobian, and the MLP's from a leaf of its own in the backward: no autograd call per receiver
    (those made a receiver cost a projection's backward each, 16 a block on a 30 x 9 Llama)."""
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    eap_scores(tiny, task_pairs)
    assert not calls


@pytest.mark.parametrize("method", ["eap", "eap-ig-inputs"])
def test_the_ways_of_holding_the_graph_give_the_same_scores(tiny, task_pairs, monkeypatch, method):
    """The whole model's graph at once, EAP-IG's steps together and its gradients summed before one contraction
    (what fits the budgets), contracted over every position at once and a position at a time, against one block's
    graph at a time, a step a pass and a contraction a pass, block by block (budgets of nothing): the same float64
    sums in another order; bound 1e-9 of the largest score."""
    from storylens.circuits import edges

    real, used = edges._contract_chunked, []
    monkeypatch.setattr(edges, "_contract_chunked", lambda *a: used.append(real(*a)) or used[-1])
    held = eap_scores(tiny, task_pairs, method=method, steps=3)
    assert edges._steps_at_once(tiny, torch.tensor([task_pairs[0].clean_ids]), 3) == 3  # all at once
    monkeypatch.setattr(edges, "CONTRACT_BYTES", 0)  # a slice of one position at a time
    sliced = eap_scores(tiny, task_pairs, method=method, steps=3)
    assert used and all(u is not None for u in used)  # both contracted over slices of positions
    monkeypatch.setattr(edges, "CIRCUIT_GRAPH_BYTES", 0)
    monkeypatch.setattr(edges, "GRAD_SUM_BYTES", 0)
    used.clear()
    blockwise = eap_scores(tiny, task_pairs, method=method, steps=3)
    assert not any(u is not None for u in used)  # block by block
    scale = held.mean.abs().nan_to_num(0).max().item()
    for other in (sliced, blockwise):
        assert (held.per_pair - other.per_pair).nan_to_num(0).abs().max().item() <= 1e-9 * scale


def test_the_scores_into_a_receiver_sum_to_the_derivative_along_the_whole_difference(tiny, task_pairs):
    """Every writer's difference together is the residual stream's (the biases are in both runs): the scores of
    every edge into a receiver sum to the derivative along the corrupt-minus-clean residual there."""
    lm, pairs = tiny, task_pairs
    r = eap_scores(lm, pairs)
    (b,) = pair_batches(lm, pairs)
    last = lm.n_layer - 1
    at = f"blocks.{last}.hook_resid_pre"
    delta = _seen(lm, b.corrupt, [at])[1][at] - _seen(lm, b.clean, [at])[1][at]
    v = r.graph.receivers.index(f"L{last + 1}H1.q")
    want = _along(lm, b.clean, lambda x: pair_metric(x, b), (last, "q", 0), delta)
    got = r.per_pair[:, : r.graph.upstream(v), v].sum(1)
    assert (got - want).abs().max().item() <= 1e-9 * want.abs().max().item()


def test_the_graph_counts_its_edges():
    """A receiver reads every writer before it; a grouped model has a key and a value receiver per group."""
    g = Graph(2, 4, 2)
    assert g.writers == ["input", "L1H1", "L1H2", "L1H3", "L1H4", "M1", "L2H1", "L2H2", "L2H3", "L2H4", "M2"]
    assert g.receivers_of(0) == ["L1H1.q", "L1H2.q", "L1H3.q", "L1H4.q", "L1KV1.k", "L1KV2.k", "L1KV1.v",
                                 "L1KV2.v", "M1"]  # fmt: skip
    # block 0: 8 receivers read the input, its MLP the input and 4 heads; block 1: 8 read 6, its MLP 10; logits 11
    assert g.n_edges == 8 * 1 + 5 + 8 * 6 + 10 + 11
    assert Graph(30, 9, 3).n_edges == sum((9 + 6) * (1 + 10 * b) + (1 + 10 * b + 9) for b in range(30)) + 1 + 10 * 30
    # the graph EAP-IG builds, ungrouped: 32,491 edges on GPT-2 small's shape, 123,211 on the 30 x 9 shape
    assert (Graph(12, 12, 12).n_edges, Graph(30, 9, 9).n_edges) == (32_491, 123_211)


@pytest.mark.slow  # four EAP-IG runs on each of four models
def test_eap_ig_takes_its_gradients_where_eap_ig_does(tiny, task_pairs):
    """EAP-IG's two forms, at one step: ``eap-ig-inputs`` takes its gradient at k = 0, the input moved all the way
    to the corrupt prompt's, which is the corrupt run, so its scores are minus EAP's on the pairs with clean and
    corrupt swapped; ``eap-ig-activations`` takes each node's at k = 1, the clean run, so its scores are EAP's. At
    more steps the scores move (the gradients are taken elsewhere). Float64 rounding: 1e-9 of the largest score."""
    from dataclasses import replace

    lm, pairs = tiny, task_pairs
    eap = eap_scores(lm, pairs)
    swapped = [
        replace(p, clean=p.corrupt, corrupt=p.clean, clean_ids=p.corrupt_ids, corrupt_ids=p.clean_ids) for p in pairs
    ]
    scale = eap.mean.abs().nan_to_num(0).max().item()
    inputs = eap_scores(lm, pairs, method="eap-ig-inputs", steps=1)
    against = eap_scores(lm, swapped)
    assert (inputs.per_pair + against.per_pair).nan_to_num(0).abs().max().item() <= 1e-9 * scale
    acts = eap_scores(lm, pairs, method="eap-ig-activations", steps=1)
    assert (acts.per_pair - eap.per_pair).nan_to_num(0).abs().max().item() <= 1e-9 * scale
    more = eap_scores(lm, pairs, method="eap-ig-inputs", steps=3)
    assert (more.per_pair - eap.per_pair).nan_to_num(0).abs().max().item() > 1e-6 * scale
