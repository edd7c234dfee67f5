"""Edge patching and faithfulness (storylens.circuits.faithfulness) in float64 on tiny seeded GPT-2, GPT-Neo, Llama
with grouped key/value heads and the native model: no edge ablated is the clean run, every edge the corrupt
run; one edge ablated equals the same edit made by hand through hooks the test drives (the writer's
corrupt-minus-clean output taken off the residual stream in a pass of its own, only that receiver's output put
into the clean run); pruning keeps only edges on a path from the input to the logits; the faithfulness curve's
ends."""

import pytest
import torch

pytest.importorskip("transformers")

from storylens.circuits.edges import Graph, eap_scores
from storylens.circuits.faithfulness import Faithfulness, edge_metrics, faithfulness, prune, top_circuit
from storylens.effects.patching import NAME_PAIRS, pair_batches, pair_metric, read_pairs


def _pass(lm, ids, edit):
    seen = {}

    def hook(name):
        def fn(x, h):
            x = edit[name](x) if name in edit else x
            seen[name] = x
            return x

        return fn

    with torch.no_grad(), lm.hooks([(n, hook(n)) for n in edit]):
        logits = lm.forward(ids)
    return logits, seen


def _writer(lm, ids, layer, h):
    _, seen = _pass(lm, ids, {f"blocks.{layer}.attn.hook_z": lambda z: z})
    return seen[f"blocks.{layer}.attn.hook_z"][:, :, h] @ lm.head_output_weights(layer)[h]


def _by_hand(lm, b, layer, h, receiver):
    """The metric with only edge L{layer}H{h} -> ``receiver`` (block, hook, slot) ablated, by hand."""
    d = _writer(lm, b.clean, layer, h) - _writer(lm, b.corrupt, layer, h)
    at_layer, kind, slot = receiver
    at = f"blocks.{at_layer}.hook_resid_pre" if kind != "mlp" else f"blocks.{at_layer}.hook_attn_out"
    out = f"blocks.{at_layer}.attn.hook_{kind}" if kind != "mlp" else f"blocks.{at_layer}.hook_mlp_out"
    _, moved = _pass(lm, b.clean, {at: lambda x: x - d, out: lambda x: x})
    new = moved[out].clone()

    def put(x):
        if slot is None:
            return new
        x = x.clone()
        x[:, :, slot] = new[:, :, slot]
        return x

    logits, _ = _pass(lm, b.clean, {out: put})
    return pair_metric(logits, b)


def test_none_is_the_clean_run_every_edge_the_corrupt_one_and_one_edge_the_edit_by_hand(tiny, task_pairs):
    """Float64 throughout: the residual stream rebuilt from its writers differs from the run's by rounding of a
    sum of some tens of terms of order 1 (about 1e-14); bounds 1e-9."""
    lm, pairs = tiny, task_pairs
    r = eap_scores(lm, pairs)
    g, every = r.graph, ~r.mean.isnan()
    (b,) = pair_batches(lm, pairs)
    last = lm.n_layer - 1
    cases = [
        (0, 1, (last, "q", lm.n_head - 1), f"L{last + 1}H{lm.n_head}.q"),
        (0, 2, (last, "k", lm.n_kv_head - 1), g._kv_label(last, lm.n_kv_head - 1, "k")),
        (0, 0, (last, "v", 0), g._kv_label(last, 0, "v")),
        (last, 3, (last, "mlp", None), f"M{last + 1}"),
    ]
    circuits = [every, torch.zeros_like(every)]
    for layer, h, _, label in cases:
        one = every.clone()
        one[g.writers.index(f"L{layer + 1}H{h + 1}"), g.receivers.index(label)] = False
        circuits.append(one)
    got = edge_metrics(lm, pairs, circuits)
    with torch.no_grad():
        clean, corrupt = pair_metric(lm.forward(b.clean), b), pair_metric(lm.forward(b.corrupt), b)
    assert (got[0] - clean).abs().max() <= 1e-9 and (got[1] - corrupt).abs().max() <= 1e-9
    assert (clean - corrupt).abs().min() > 1e-6  # the two ends differ: a real test of both
    from storylens.circuits import edge_patch  # edge_metrics takes the two ends from bare runs: patched, the same

    away, metric = edge_patch_away(lm, b), (lambda x: pair_metric(x, b))
    assert (edge_patch.patch_edges(lm, b.clean, metric, ~every, away) - clean).abs().max() <= 1e-9
    assert (edge_patch.patch_edges(lm, b.clean, metric, every, away) - corrupt).abs().max() <= 1e-9
    for (layer, h, receiver, label), row in zip(cases, got[2:]):
        want = _by_hand(lm, b, layer, h, receiver)
        assert (row - want).abs().max() <= 1e-9, label
        assert (row - clean).abs().max() > 1e-12, label  # the edge moved the metric


def test_the_one_copy_pass_is_the_pass_with_copies(tiny, task_pairs, monkeypatch):
    """On the four families the edge-patched pass runs one copy of the batch (each head's query, key and value made
    from its own input beside the run, the MLP's input replaced at its norm; in every block past the first the
    model's own projections not run, each head made beside it) and equals the pass that carries a copy per distinct
    receiver input, on random circuits of every size: the same float64 sums in another order (about 1e-14); bound
    1e-9."""
    import contextlib

    from storylens.circuits import bases as stream
    from storylens.circuits import edge_patch

    lm, pairs = tiny, task_pairs
    (b,) = pair_batches(lm, pairs)
    away = edge_patch_away(lm, b)
    mask = ~eap_scores(lm, pairs).mean.isnan()
    rows, unrun = [], []
    real, unrun_real = lm.forward, lm.unrun_projections
    monkeypatch.setattr(lm, "forward", lambda ids, **k: rows.append(ids.shape[0]) or real(ids, **k))

    @contextlib.contextmanager
    def seen_unrun(layers, inputs):
        with unrun_real(layers, inputs) as done:
            unrun.append(done)
            yield done

    monkeypatch.setattr(lm, "unrun_projections", seen_unrun)
    metric = lambda x: pair_metric(x, b)  # noqa: E731
    bases = edge_patch.ablated_bases(lm, b.clean, metric, away)
    gen = torch.Generator().manual_seed(0)
    for share in (0.05, 0.3, 0.8):
        cut = (torch.rand(mask.shape, generator=gen) > share) & mask
        rows.clear()
        fast = edge_patch.patch_edges(lm, b.clean, metric, cut, away, bases)
        assert rows == [b.clean.shape[0]]  # one copy, and no second pass with copies
        assert unrun[-1] == set(range(1, lm.n_layer))  # random cuts patch a head of every block
        slow = edge_patch._copied(lm, b.clean, metric, cut, away, bases)
        assert rows[-1] > b.clean.shape[0]  # the copies pass carried copies: the two differ in kind
        assert (fast - slow).abs().max().item() <= 1e-9, share
    assert lm.module not in stream.COPIES


def test_each_distinct_circuit_is_patched_once_and_the_two_ends_not_at_all(tiny, task_pairs, monkeypatch):
    """The curve's circuits repeat (its smallest sizes prune to nothing, its largest keeps every edge): each
    distinct one is patched once; every edge kept is a bare forward, none the corrupt run already made. The stream
    with every edge ablated is that corrupt run's own: no pass of its own, so a batch costs three forwards here."""
    from storylens.circuits import edge_patch

    lm, pairs = tiny, task_pairs
    every = ~eap_scores(lm, pairs).mean.isnan()
    some = every & (torch.rand(every.shape, generator=torch.Generator().manual_seed(1)) < 0.5)
    want = edge_metrics(lm, pairs, [some])[0]
    calls, runs = [], []
    real, forward = edge_patch.patch_edges, lm.forward
    monkeypatch.setattr(edge_patch, "patch_edges", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(edge_patch, "ablated_bases", None)  # a pass of its own would fail
    monkeypatch.setattr(lm, "forward", lambda ids, **k: runs.append(1) or forward(ids, **k))
    got = edge_metrics(lm, pairs, [every, torch.zeros_like(every), some, some.clone(), every])
    assert len(calls) == len(pair_batches(lm, pairs))  # `some` once per batch, nothing else
    assert len(runs) == 3 * len(calls)  # the corrupt run, the clean one, `some`'s
    assert torch.equal(got[2], want) and torch.equal(got[3], want) and torch.equal(got[0], got[4])
    assert (got[0] - got[1]).abs().min() > 1e-6


def test_the_scores_clean_runs_are_the_exact_runs_own(tiny, task_pairs, monkeypatch):
    """Edge scores keep each pair's clean metric from their own passes (EAP's gradient pass, EAP-IG's clean run):
    the exact runs on the same pairs take it for the circuit that keeps every edge and run no forward for it; on
    other pairs (another order, one fewer) it is not taken. Float64: the scores' pass (with a graph, or its
    blocks run apart) and a bare forward differ by the rounding of sums of some tens of terms of order 1 made in
    another order, about 1e-14; bound 1e-9 of the metric's size."""
    from storylens.core.errors import StorylensError

    lm, pairs = tiny, task_pairs
    for method in ("eap", "eap-ig-inputs"):
        r = eap_scores(lm, pairs, method=method, steps=2)
        every = ~r.mean.isnan()
        want = edge_metrics(lm, pairs, [every])[0]  # a bare forward's
        torch.testing.assert_close(r.clean, want, rtol=0, atol=1e-9 * float(want.abs().max()))
    assert r.clean_for(pairs[::-1]) is None and r.clean_for(pairs[:-1]) is None
    with pytest.raises(StorylensError, match="clean metrics"):
        edge_metrics(lm, pairs, [every], clean=r.clean[:-1])
    runs, forward = [], lm.forward
    monkeypatch.setattr(lm, "forward", lambda ids, **k: runs.append(1) or forward(ids, **k))
    got = edge_metrics(lm, pairs, [every, torch.zeros_like(every)], clean=r.clean_for(pairs))
    assert torch.equal(got[0], r.clean) and len(runs) == len(pair_batches(lm, pairs))  # the corrupt runs alone
    runs.clear()
    f = faithfulness(lm, pairs, r, percentages=(0.0, 1.0))  # the empty circuit and the whole model: no patched run
    assert len(runs) == len(pair_batches(lm, pairs)) and f.f == [0.0, 1.0]
    assert f.clean == pytest.approx(float(r.clean.mean()), rel=1e-12)


def test_a_misread_structure_falls_back_to_copies(tiny, task_pairs, monkeypatch):
    """Where the attention norm is not what the block reads through (here: an identity put in its place), the run's
    first head rebuilt from it is not the model's: the pass is made again with copies, the same figure, and the
    model keeps the copies."""
    import weakref

    from storylens.circuits import bases as stream
    from storylens.circuits import edge_patch

    lm, pairs = tiny, task_pairs
    (b,) = pair_batches(lm, pairs)
    monkeypatch.setattr(stream, "COPIES", weakref.WeakSet())
    monkeypatch.setattr(lm, "attention_norm", lambda layer: torch.nn.Identity())
    away, metric = edge_patch_away(lm, b), (lambda x: pair_metric(x, b))
    cut = ~eap_scores(lm, pairs).mean.isnan()
    cut[0] = False  # the input's edges kept: the rest cut
    bases = edge_patch.ablated_bases(lm, b.clean, metric, away)
    got = edge_patch.patch_edges(lm, b.clean, metric, cut, away, bases)
    assert lm.module in stream.COPIES
    assert (got - edge_patch._copied(lm, b.clean, metric, cut, away, bases)).abs().max().item() == 0


def test_the_stream_with_every_edge_ablated_is_the_corrupt_run(tiny, task_pairs, monkeypatch):
    """The bases every circuit of a batch shares (the run's stream less every writer's corrupt-minus-clean output
    before it) are the corrupt run's stream at each block's input, its middle and the end, and the heads' query,
    key and value made from them the corrupt run's; their pass's metric is the clean run's. Float64: sums of some
    tens of terms of order 1 in another order (about 1e-14); bound 1e-9. Runs that reuse the bases' spare buffer
    give what fresh bases give, to the bit, and runs where the projections are not kept (made per run) the same
    within 1e-9; a run that cuts only a few edges (every receiver made from the run) does not need them."""
    from storylens.circuits import bases as stream
    from storylens.circuits import edge_patch

    lm, pairs = tiny, task_pairs
    (b,) = pair_batches(lm, pairs)
    away, metric = edge_patch_away(lm, b), (lambda x: pair_metric(x, b))
    bases = edge_patch.ablated_bases(lm, b.clean, metric, away)
    last = lm.n_layer - 1
    names = [f"blocks.{i}.{n}" for i in range(lm.n_layer) for n in ("hook_resid_pre", "hook_attn_out")]
    names += [f"blocks.{i}.attn.hook_{p}" for i in range(lm.n_layer) for p in "qkv"]
    _, seen = _pass(lm, b.corrupt, {n: (lambda x: x) for n in [*names, f"blocks.{last}.hook_resid_post"]})
    with torch.no_grad():
        assert (bases.metric - pair_metric(lm.forward(b.clean), b)).abs().max() <= 1e-9
    assert len(bases.proj) == lm.n_layer  # the four families' structure is read: the projections are kept
    for i in range(lm.n_layer):
        pre = seen[f"blocks.{i}.hook_resid_pre"]
        assert (bases.pre[i] - pre).abs().max() <= 1e-9, i
        assert (bases.mid[i] - pre - seen[f"blocks.{i}.hook_attn_out"]).abs().max() <= 1e-9, i
        for p in "qkv":
            assert (bases.proj[i][p] - seen[f"blocks.{i}.attn.hook_{p}"]).abs().max() <= 1e-9, (i, p)
    assert (bases.post - seen[f"blocks.{last}.hook_resid_post"]).abs().max() <= 1e-9
    assert (bases.post - bases.pre[0]).abs().max() > 1e-6  # the blocks wrote something: a real comparison

    scores = eap_scores(lm, pairs)
    mask = ~scores.mean.isnan()
    gen = torch.Generator().manual_seed(2)
    cuts = [(torch.rand(mask.shape, generator=gen) > share) & mask for share in (0.05, 0.6)]
    one = torch.zeros_like(mask)
    one[0, -1] = True  # every edge but the input's to the logits (an oracle's run): no receiver reads the bases
    assert not edge_patch.needs_bases(scores.graph, one) and edge_patch.needs_bases(scores.graph, cuts[0])
    shared = [edge_patch.patch_edges(lm, b.clean, metric, c, away, bases) for c in cuts]
    assert bases.spare is not None
    fresh = [edge_patch.patch_edges(lm, b.clean, metric, c, away) for c in cuts]
    assert all(torch.equal(x, y) for x, y in zip(shared, fresh))
    monkeypatch.setattr(stream, "PROJ_BYTES", 0)
    made = [edge_patch.patch_edges(lm, b.clean, metric, c, away) for c in cuts]
    assert all((x - y).abs().max() <= 1e-9 for x, y in zip(shared, made))


def test_an_mlp_cut_from_every_edge_takes_the_corrupt_runs_output(tiny, task_pairs):
    """Under a counterfactual ablation an MLP cut from every edge reads the corrupt run's stream (the test above),
    so its output is the corrupt run's: taken from that run, not run again. Float64, against the same circuits with
    every MLP run: the MLP on a stream equal to the corrupt one within about 1e-14 against its corrupt output, the
    same function of the same values; bound 1e-9 of the metric. Only the MLPs cut from everything are skipped,
    and the model's own forward is back afterwards."""
    from storylens.circuits import edge_patch, faithfulness
    from storylens.circuits.edges import edge_mask, graph_of

    lm, pairs = tiny, task_pairs
    (b,) = pair_batches(lm, pairs)
    metric = lambda x: pair_metric(x, b)  # noqa: E731
    away, corrupt, stream = faithfulness._corrupt_away(lm, b, metric)
    graph = graph_of(lm)
    mask, per = edge_mask(graph), graph.per_block
    keep = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) < 0.1) & mask
    keep[:, per - 1] = False  # block 1's MLP cut from every edge
    keep[0, 2 * per - 1] = True  # block 2's keeps the input's
    keep[:, -1] = mask[:, -1]  # the logits read every writer: the metric sees what the blocks did
    ran: dict[int, bool] = {}
    mlps = [blk.mlp for blk in lm.blocks()]

    def seen(i):
        def hook(module, args, out):
            ran[i] = "forward" not in module.__dict__  # an instance forward: skipped (the last pass: the circuit's)

        return hook

    handles = [m.register_forward_hook(seen(i)) for i, m in enumerate(mlps)]
    try:
        taken = edge_patch.circuit_metrics(lm, b.clean, metric, [keep], away, corrupt, stream)
    finally:
        for h in handles:
            h.remove()
    assert ran == {i: bool(keep[:, (i + 1) * per - 1].any()) for i in range(lm.n_layer)}  # run where it keeps one
    assert not ran[0] and ran[1]
    assert not any("forward" in m.__dict__ for m in mlps)
    run = edge_patch.circuit_metrics(lm, b.clean, metric, [keep], away, corrupt)
    assert (taken - run).abs().max().item() <= 1e-9 * max(1.0, run.abs().max().item())
    assert (run - corrupt.double()).abs().max().item() > 1e-6  # a circuit that keeps something: a real comparison


def edge_patch_away(lm, b):
    """Each writer's clean-minus-corrupt output, from the corrupt run's hook tensors."""
    from storylens.circuits.bases import Away
    from storylens.circuits.edges import run_pass

    _, seen = run_pass(lm, b.corrupt, lambda x: pair_metric(x, b), grad=False)
    return Away(lm.n_head + 1, seen["pre"][0], seen["mlp"].__getitem__, seen["z"].__getitem__)


def test_away_is_each_writers_output_less_its_output_on_the_corrupt_run(tiny, task_pairs):
    """:class:`Away` gives each writer's difference the way the edge-patched runs take it (a head's from its ``z``
    through its slice of W_O, the embedding's and each MLP's from their outputs): equal, in float64, to every
    writer's clean output less its corrupt one as :func:`writer_outputs` builds them (a head's output made from its
    own ``z`` first). Both are ``d`` products of float64 values in another order: within ``2 d u`` of the sum of
    their magnitudes each (``u = 1.1e-16``, ``d_head <= 16`` here); 1e-12 of the largest output is a margin of
    over 1e2."""
    from storylens.circuits.edges import graph_of, run_pass, writer_outputs
    from storylens.circuits.faithfulness import _corrupt_away

    lm, pairs = tiny, task_pairs
    (b,) = pair_batches(lm, pairs)
    metric = lambda x: pair_metric(x, b)  # noqa: E731
    away, _, _ = _corrupt_away(lm, b, metric)
    _, clean = run_pass(lm, b.clean, metric, grad=False)
    _, corrupt = run_pass(lm, b.corrupt, metric, grad=False)
    want = writer_outputs(lm, clean, minus=corrupt, writer_first=True)  # [batch, writer, pos, d_model]
    per, got = lm.n_head + 1, []
    for i in range(len(graph_of(lm).writers)):
        layer, h = divmod(i - 1, per)
        if i == 0 or h == lm.n_head:
            got.append(away(i, clean["pre"][0] if i == 0 else clean["mlp"][layer]))
        else:
            dz = away.heads(layer, clean["z"][layer])[:, :, h]
            got.append(dz @ lm.head_output_weights(layer)[h])
    got = torch.stack(got, 1)
    size = (
        writer_outputs(lm, clean, writer_first=True).abs() + writer_outputs(lm, corrupt, writer_first=True).abs()
    ).max()
    bound = 1e-12 * size.item()
    assert (got - want).abs().max().item() <= bound
    assert want[:, 1 : per - 1].abs().max().item() > 1e3 * bound  # the heads' differences far above the bound


def test_pruning_keeps_edges_on_a_path_from_the_input_to_the_logits():
    g = Graph(2, 2, 2)
    w, rc = g.writers, g.receivers  # input, L1H1, L1H2, M1, L2H1, L2H2, M2
    keep = torch.zeros(len(w), len(rc), dtype=torch.bool)
    keep[w.index("input"), rc.index("L1H1.q")] = True  # input -> L1H1 -> L2H1 (value) -> logits: kept
    keep[w.index("L1H1"), rc.index("L2H1.v")] = True
    keep[w.index("L2H1"), rc.index("logits")] = True
    keep[w.index("L1H2"), rc.index("M1")] = True  # L1H2 has no way in: its edge leaves, then M1's
    keep[w.index("M1"), rc.index("logits")] = True
    keep[w.index("input"), rc.index("L2H2.k")] = True  # L2H2 has no way out: leaves
    got = prune(g, keep)
    kept = {(w[u], rc[v]) for u, v in got.nonzero().tolist()}
    assert kept == {("input", "L1H1.q"), ("L1H1", "L2H1.v"), ("L2H1", "logits")}


@pytest.mark.slow  # twelve patched passes on each of four models
def test_the_faithfulness_curve_ends_at_the_whole_model(tiny, task_pairs):
    """Every edge kept is the model (f = 1); no edge, the empty circuit (f = 0); the areas follow."""
    lm, pairs = tiny, task_pairs
    r = eap_scores(lm, pairs)
    f = faithfulness(lm, pairs, r, percentages=(0.0, 0.5, 1.0))
    assert isinstance(f, Faithfulness) and f.kept[0] == 0 and f.kept[-1] == r.graph.n_edges
    assert f.f[0] == pytest.approx(0.0, abs=1e-9) and f.f[-1] == pytest.approx(1.0, abs=1e-9)
    assert f.cpr == pytest.approx(0.5 * (f.f[0] + f.f[1]) / 2 + 0.5 * (f.f[1] + f.f[2]) / 2, abs=1e-12)
    assert top_circuit(r, 5).sum() <= 5


@pytest.mark.slow  # a whole circuit run with EAP-IG, the oracle and the resamples
def test_the_command_writes_what_its_schema_says_and_reads_back(shipped_model, tmp_path, capsys):
    """storylens circuit on four pairs of the name task, scored by EAP-IG (inputs, 2 steps): circuit.json
    validates against its schema and reads back (load_circuit, to_pandas), circuit.csv has a row per edge,
    circuit.html is one offline page, circuit.eap-ig.json is EAP-IG's graph format; the run says first whether the model
    does the task; a bad --oracle or
    --ig-steps is one line, exit 2."""
    import json

    import jsonschema

    from storylens import load_circuit
    from storylens.cli import main
    from storylens.core.schema import schema

    pairs = tmp_path / "p.jsonl"
    keys = ("clean", "corrupt", "answer", "wrong")
    pairs.write_text("".join(json.dumps({k: r[k] for k in keys}) + "\n" for r in read_pairs(NAME_PAIRS)[:4]))
    out = tmp_path / "c"
    argv = ["circuit", "--pairs", str(pairs), "--out", str(out), "--oracle", "2", "--resamples", "3", "--no-progress",
            "--method", "eap-ig-inputs", "--ig-steps", "2", "--second-pairs", "names-paraphrased"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("The model does this task") and "CPR" in printed and "oracle: 4 edges" in printed
    doc = json.loads((out / "circuit.json").read_text())
    jsonschema.Draft202012Validator(schema("circuit")).validate(doc)
    back = load_circuit(out)
    assert back.n_edges == doc["n_edges"] == 1108 and len(back.edges) == 1108 and back.to_pandas().shape == (1108, 5)
    assert back.faithfulness.f[-1] == pytest.approx(1.0, abs=1e-6) and back.stability is not None
    assert (back.method, back.ig_steps) == ("eap-ig-inputs", 2)
    # EAP-IG's Graph.to_json format (blocks and heads from 0, a key/value input per query head): every edge, named
    graph = json.loads((out / "circuit.eap-ig.json").read_text())
    assert graph["cfg"] == {"n_layers": 6, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 256}
    assert len(graph["edges"]) == 1108 and len(graph["nodes"]) == 1 + 6 * 5 + 1
    first = {(e.writer, e.receiver): e for e in back.edges}
    assert graph["edges"]["input->m0"]["score"] == first[("input", "M1")].score
    assert graph["edges"]["m0->a4.h3<v>"]["score"] == first[("M1", "L5H4.v")].score
    assert sum(e["in_graph"] for e in graph["edges"].values()) == sum(e.in_circuit for e in back.edges)
    assert len((out / "circuit.csv").read_text().splitlines()) == 1 + 1108
    page = (out / "circuit.html").read_text()
    assert "default-src 'none'" in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert main(["circuit", "--out", str(tmp_path / "d"), "--oracle", "-1"]) == 2
    assert main(["circuit", "--out", str(tmp_path / "d"), "--ig-steps", "0"]) == 2
    # the circuit found again on the paraphrased task: the model does it, and the figures are the run's own
    t = back.second
    assert t is not None and (t.source, t.pairs) == ("name_pairs_paraphrased.jsonl", 40) and t.resamples == 3
    assert t.verdict.startswith("The model does this task") and 0 <= t.jaccard <= 1 and t.shared <= t.kept
    assert t.shared_f_se is not None and t.second_f_se is not None and back.stability.core_f_se is not None
    assert f"f {t.shared_f:+.3f} ± {t.shared_f_se:.3f} here" in printed  # each f with its bootstrap error
    assert f"on the second pairs (name_pairs_paraphrased.jsonl, 40 pairs): {t.verdict}" in printed
    stories = ["circuit", "--stories", "x.txt", "--second-pairs", "names", "--out", str(tmp_path / "e")]
    assert main(stories) == 2 and "--second-pairs: only with a task of pairs" in capsys.readouterr().err


def test_the_same_pairs_twice_find_the_same_circuit(shipped_model):
    """A second file that is the first: Jaccard 1 with no spread to speak of aside (its resamples differ), every
    edge shared, and the shared part's faithfulness is the circuit's own."""
    from storylens.circuits.stability import second_pairs
    from storylens.effects.patching import encode_pairs
    from storylens.lm import NativeLM

    lm = NativeLM(shipped_model)
    pairs = encode_pairs(lm, read_pairs(NAME_PAIRS)[:6], NAME_PAIRS.name)
    scores = eap_scores(lm, pairs)
    t = second_pairs(lm, pairs, scores, pairs, scores, 20, source="same", resamples=0)
    assert t.jaccard == 1.0 and t.shared == t.kept > 0 and t.jaccard_sd is None
    assert t.shared_f == t.second_f and t.verdict.startswith("The model does this task")
    assert t.shared_f_se is None  # no resamples, no error claimed


def test_a_faithfulness_error_is_the_spread_of_its_bootstrap():
    """Each pair's circuit metric half way from the empty circuit's to the model's: f is 1/2 on every resample, so
    its error is 0 (to float64 rounding); pairs that disagree give a positive one; one pair gives none."""
    from storylens.circuits.stability import f_with_se

    gen = torch.Generator().manual_seed(0)
    empty, full = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64) + 5
    f, se = f_with_se(torch.stack([(empty + full) / 2, empty, full]), 0, 1, 2, gen)
    assert f == pytest.approx(0.5, abs=1e-12) and se is not None and se <= 1e-12
    f, se = f_with_se(
        torch.stack([empty + torch.rand(8, dtype=torch.float64) * (full - empty), empty, full]), 0, 1, 2, gen
    )
    assert 0 < f < 1 and se is not None and se > 0
    assert f_with_se(torch.stack([empty, empty, full])[:, :1], 0, 1, 2, gen)[1] is None


def test_no_eap_ig_export_for_grouped_key_value_heads():
    """EAP-IG's graph has a key and a value input per query head; a grouped edge's score does not split into them,
    so a grouped model's run writes none, and an ungrouped one's names every edge."""
    from storylens.circuits.faithfulness import Faithfulness
    from storylens.circuits.run import CircuitResult, EdgeRow, eap_ig_graph

    f = Faithfulness([1.0], [1], [1], [1.0], [0.0], 0.0, 0.0, 0.0, 0.0, 1.0, 0.1, -1.0, 0.1)

    def result(n_kv):
        g = Graph(1, 2, n_kv)
        edges = [
            EdgeRow(g.writers[u], r, 0.5, 0.1, True) for v, r in enumerate(g.receivers) for u in range(g.upstream(v))
        ]
        return CircuitResult("m", "pairs", "corrupt", 2, None, None, "x", "eap", None, 1.0, 0.1, -1.0, 0.1, "v", 1, 2, n_kv, g.n_edges, f, 1, 1.0,
                             edges, None, None)  # fmt: skip

    assert eap_ig_graph(result(1), 8) is None
    graph = eap_ig_graph(result(2), 8)
    assert sorted(graph["edges"]) == sorted(
        ["input->a0.h0<q>", "input->a0.h1<q>", "input->a0.h0<k>", "input->a0.h1<k>", "input->a0.h0<v>",
         "input->a0.h1<v>", "input->m0", "a0.h0->m0", "a0.h1->m0", "input->logits", "a0.h0->logits",
         "a0.h1->logits", "m0->logits"]
    )  # fmt: skip


@pytest.mark.slow  # a circuit run and a browser
def test_the_page_opens_offline_and_a_click_on_a_head_shows_its_attention(tmp_path):
    """circuit.html in headless Chromium: the graph, the curve, the table; the slider redraws; a click on a head
    shows its attention on the chosen pair, clean and corrupt; no error and no request."""
    import json

    from offline_page import offline_page

    from storylens.cli import main

    keys = ("clean", "corrupt", "answer", "wrong")
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({k: r[k] for k in keys}) + "\n" for r in read_pairs(NAME_PAIRS)[:4]))
    out = tmp_path / "c"
    argv = ["circuit", "--pairs", str(pairs), "--out", str(out), "--oracle", "0", "--resamples", "0", "--no-progress"]
    assert main(argv) == 0
    with offline_page(out / "circuit.html") as (page, errors, requests):
        assert page.locator("#slc-graph svg").count() == 1 and page.locator("#slc-curve svg").count() == 1
        page.locator("#slc-size").fill("40")
        assert page.locator("#slc-table tr").count() == 1 + 40
        assert "40 of 1108 edges" in page.locator("#slc-size-label").inner_text()
        head = page.locator("#slc-graph g.head").first
        name = head.get_attribute("data-head")
        head.click()
        assert name in page.locator("#slc-head").inner_text()
        assert page.locator('#slc-maps [data-side="clean"] svg').count() == 1
        assert page.locator('#slc-maps [data-side="corrupt"] svg').count() == 1
    assert errors == [] and requests == []


def test_a_forward_continuing_a_start_is_the_whole_forward_after_it(tiny, task_pairs):
    """Inside ``lm.continuing(start)`` a forward of the tokens after it gives the whole forward's logits there (at
    every position, or one a row), its hooks see those tokens alone, and a batch of twice the rows reads the start
    tiled; float64, so the two differ by the rounding of sums made in another order alone."""
    ids = pair_batches(tiny, task_pairs)[0].clean
    p, at = 5, torch.tensor([ids.shape[1] - 1, 7, 9])[: len(ids)]
    seen = []
    with torch.no_grad():
        whole, whole_at = tiny.forward(ids), tiny.forward(ids, logits=at)
        with (
            tiny.continuing(ids[:, :p]) as kept,
            tiny.hooks([("blocks.1.hook_resid_pre", lambda x, h: seen.append(x))]),
        ):
            after, after_at = tiny.forward(ids[:, p:]), tiny.forward(ids[:, p:], logits=at - p)
            tiled = tiny.forward(ids[:, p:].repeat(2, 1))
    assert kept and {x.shape[1] for x in seen} == {ids.shape[1] - p}
    scale = whole.abs().max()
    torch.testing.assert_close(after, whole[:, p:], rtol=0, atol=1e-9 * scale)
    torch.testing.assert_close(after_at, whole_at, rtol=0, atol=1e-9 * scale)
    torch.testing.assert_close(tiled, whole[:, p:].repeat(2, 1, 1), rtol=0, atol=1e-9 * scale)


def test_the_start_pairs_share_is_run_once_and_changes_nothing(tiny, monkeypatch):
    """Pairs batched by where clean and corrupt first differ, each batch's shared start run once and every run after
    it covering only the tokens past it, give the whole runs' edge scores and patched metrics, in the pairs' own
    order; float64, so the two differ by the rounding of sums made in another order alone."""
    from storylens.circuits import edges, prefix
    from storylens.effects.patching import encode_pairs

    pairs = encode_pairs(tiny, [read_pairs(NAME_PAIRS)[i] for i in (0, 8, 4)], NAME_PAIRS.name)
    ordered, _ = prefix.start_ordered(pairs)
    assert [p.line for p in ordered] != [p.line for p in pairs]  # the order moves: results must be put back
    batches = pair_batches(tiny, ordered, 2)
    assert all(prefix.shared_start(b) > 0 for b in batches)
    lengths, forward, scored = [], tiny.forward, edges.batch_scores
    monkeypatch.setattr(edges, "batch_scores", lambda lm, ids, *a: lengths.append(ids.shape[1]) or scored(lm, ids, *a))
    shared = eap_scores(tiny, pairs, batch_size=2)
    circuits = [top_circuit(shared, n) for n in (3, 30, 300)]
    monkeypatch.setattr(tiny, "forward", lambda ids, **kw: lengths.append(ids.shape[1]) or forward(ids, **kw))
    shared_m = edge_metrics(tiny, pairs, circuits, batch_size=2)
    assert set(lengths) == {b.clean.shape[1] - prefix.shared_start(b) for b in batches}
    monkeypatch.setattr(prefix, "SHARE", False)
    whole = eap_scores(tiny, pairs, batch_size=2)
    whole_m = edge_metrics(tiny, pairs, circuits, batch_size=2)
    scale = whole.per_pair.nan_to_num().abs().max()
    torch.testing.assert_close(shared.per_pair, whole.per_pair, rtol=0, atol=1e-9 * scale, equal_nan=True)
    torch.testing.assert_close(shared_m, whole_m, rtol=0, atol=1e-9 * whole_m.abs().max())
    assert not torch.equal(whole_m[:, 0], whole_m[:, 1])  # the pairs' metrics differ: an order mixed up would show
