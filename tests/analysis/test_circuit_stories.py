"""``storylens circuit --stories``: edges against the corpus loss under mean or zero ablation, in float64 on tiny
seeded GPT-2, GPT-Neo, Llama with grouped key/value heads and the native model, on real quiz stories.

An edge's score is each story's summed loss's derivative along that edge alone (the writer's ablated-minus-clean
output after the opening token, reaching only that receiver), taken with autograd through hooks the test drives
(test_edges's ``_along``); edge patching with nothing ablated is the clean run, and with everything ablated it is
the run with every writer (the input, each head's ``hook_z``, each MLP) replaced by its ablated value after the
opening token, made here with hooks of the test's own. The same float64 chain rule in another order: rounding of
sums of a few thousand products, about 1e-14 of the figure; the bound is 1e-9 of it. Llama's RMSNorm runs in float64
for the derivative (test_edges's docstring)."""

import pytest
import torch

pytest.importorskip("transformers")

from test_edges import _along

from storylens.circuits.edges import edge_mask, graph_of
from storylens.circuits.stories import (
    MeanSums,
    clean_losses,
    edge_batch,
    loss_batch,
    story_batches,
    story_metric,
    zero_values,
)
from storylens.engine.encode import encode_stories


@pytest.fixture(scope="module")
def batch(tiny, corpus_split):
    """Three real quiz stories, cut to 40 tokens, in one batch; the writers' means over them."""
    ids = [e.ids[:40] for e in encode_stories(tiny, corpus_split.quiz[:3], frozenset())]
    ((rows, x, valid),) = list(story_batches(tiny, ids, 8))
    sums = MeanSums()
    sums.add(tiny, x, valid)
    return x, valid, sums.values(tiny)


def _values(lm, batch, ablation):
    return batch[2] if ablation == "mean" else zero_values(lm)


def _seen(lm, ids, names):
    seen = {}

    def keep(name):
        def fn(x, hook):
            seen[name] = x.detach().clone()

        return fn

    with torch.no_grad(), lm.hooks([(n, keep(n)) for n in names]):
        lm.forward(ids)
    return seen


def _ablated_minus_clean(lm, ids, values, writer):
    """The writer's ablated-minus-clean output into the residual stream, 0 at the opening token."""
    kind, layer, h = writer
    name = f"blocks.{layer}.attn.hook_z" if kind == "head" else f"blocks.{layer}.hook_mlp_out"
    x = _seen(lm, ids, [name])[name]
    if kind == "head":
        d = (values["z"][layer, h] - x[:, :, h]) @ lm.head_output_weights(layer)[h]
    else:
        d = values["mlp"][layer] - x
    d[:, 0] = 0
    return d


@pytest.mark.parametrize("ablation", ["mean", "zero"])
@pytest.mark.usefixtures("float64_rms")
def test_a_story_edge_score_is_the_loss_derivative_along_that_edge_alone(tiny, batch, ablation):
    lm, (ids, valid, _) = tiny, batch
    values = _values(lm, batch, ablation)
    c, n = edge_batch(lm, ids, valid, values, "eap", 1)
    assert torch.equal(n, valid[:, 1:].sum(1).double())
    g = graph_of(lm)
    w, rc, last = g.writers, g.receivers, lm.n_layer - 1
    cases = [
        (("head", 0, 1), (last, "q", lm.n_head - 1), f"L{last + 1}H{lm.n_head}.q"),
        (("mlp", 0, None), (last, "k", 0), g._kv_label(last, 0, "k")),
        (("head", 0, 2), (last, "v", lm.n_kv_head - 1), g._kv_label(last, lm.n_kv_head - 1, "v")),
        (("head", last, 0), (last, "mlp", None), f"M{last + 1}"),
    ]
    metric = story_metric(ids, valid)
    for writer, receiver, label in cases:
        kind, layer, h = writer
        u = w.index(f"L{layer + 1}H{h + 1}" if kind == "head" else f"M{layer + 1}")
        want = _along(lm, ids, metric, receiver, _ablated_minus_clean(lm, ids, values, writer))
        got = c[:, u, rc.index(label)]
        scale = want.abs().max().item()
        assert scale > 1e-9, label
        assert (got - want).abs().max().item() <= 1e-9 * scale, label
    assert torch.isfinite(c[:, edge_mask(g)]).all()


def _node_ablated_losses(lm, ids, valid, values):
    """Each story's summed loss with the input, every head's ``hook_z`` and every MLP's output replaced by their
    ablated values after the opening token: hooks of this test's own."""

    def put(v):
        def fn(x, hook):
            x = x.clone()
            x[:, 1:] = v(hook.layer).to(x.dtype)
            return x

        return fn

    hooks = [("blocks.0.hook_resid_pre", put(lambda layer: values["pre"]))]
    hooks += [(f"blocks.{i}.attn.hook_z", put(lambda layer: values["z"][layer])) for i in range(lm.n_layer)]
    hooks += [(f"blocks.{i}.hook_mlp_out", put(lambda layer: values["mlp"][layer])) for i in range(lm.n_layer)]
    with torch.no_grad(), lm.hooks(hooks):
        return story_metric(ids, valid)(lm.forward(ids)).double()


@pytest.mark.parametrize("ablation", ["mean", "zero"])
def test_edge_patching_none_is_the_clean_run_and_every_edge_the_ablated_one(tiny, batch, ablation):
    lm, (ids, valid, _) = tiny, batch
    values = _values(lm, batch, ablation)
    every = edge_mask(graph_of(lm))
    got = loss_batch(lm, ids, valid, values, torch.stack([every, torch.zeros_like(every)]))
    clean = clean_losses(lm, ids, valid)
    ablated = _node_ablated_losses(lm, ids, valid, values)
    assert (got[0] - clean).abs().max() <= 1e-9 * clean.abs().max()
    assert (got[1] - ablated).abs().max() <= 1e-9 * ablated.abs().max()
    assert (ablated - clean).abs().min() > 1e-3  # ablating every edge moves every story's loss


def test_the_means_are_over_every_real_position_after_the_opening_token(tiny, batch):
    lm, (ids, valid, values) = tiny, batch
    name = "blocks.0.hook_mlp_out"
    x = _seen(lm, ids, [name])[name]
    keep = valid.clone()
    keep[:, 0] = False
    want = x[keep].mean(0)
    assert (values["mlp"][0] - want).abs().max() <= 1e-12 * want.abs().max()
    assert int(values["count"]) == int(keep.sum())


def test_the_corpus_options_are_refused_in_one_line_before_anything_loads(tmp_path, capsys):
    from storylens.cli import main

    out = str(tmp_path / "c")
    cases = [
        (["--stories", "x.txt", "--method", "eap-ig-inputs"], "eap-ig-inputs"),
        (["--ablation", "zero"], "--ablation: only with --stories"),
        (["--resume", "--limit", "3"], "--limit and --resume: only with --stories"),
        (["--stories", "x.txt", "--pairs", "indirect-object"], "one task or the other"),
        (["--stories", "x.txt", "--workers", "3"], "only with --engine ray"),
        (["--stories", "x.txt", "--limit", "0"], "--limit"),
    ]
    for extra, said in cases:
        assert main(["circuit", "--out", out, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (extra, err)


@pytest.mark.slow  # three runs over six quiz stories on the shipped model
def test_an_interrupted_run_resumes_to_the_same_figures(shipped_model, corpus_split, tmp_path, monkeypatch):
    """Killed in the edge scores' pass after a checkpoint, the run refuses to start again over its checkpoint
    without --resume, and with it ends with the figures an uninterrupted run gives (the same chunks, summed in
    the same order: equal, not merely close)."""
    import storylens.corpus.circuit as cc
    from storylens.core.errors import StorylensError
    from storylens.lm import NativeLM

    lm = NativeLM(shipped_model)
    stories = list(corpus_split.quiz[:6])
    kw = dict(chunk_stories=2, oracle=2, resamples=3, progress=False)
    whole = cc.circuit_over_stories(lm, stories, tmp_path / "whole", **kw)
    monkeypatch.setattr(cc, "CHECKPOINT_S", 0.0)
    calls, job = {"n": 0}, cc.chunk_job

    class Killed(Exception):
        pass

    def dies(lm, j, start, texts):
        calls["n"] += 1
        if j["phase"] == "scores" and start == 4:
            raise Killed
        return job(lm, j, start, texts)

    monkeypatch.setattr(cc, "chunk_job", dies)
    with pytest.raises(Killed):
        cc.circuit_over_stories(lm, stories, tmp_path / "cut", **kw)
    assert cc.checkpoint_path(tmp_path / "cut").exists()
    monkeypatch.setattr(cc, "chunk_job", job)
    with pytest.raises(StorylensError, match="--resume"):
        cc.circuit_over_stories(lm, stories, tmp_path / "cut", **kw)
    redone = {"n": 0}

    def counted(lm, j, start, texts):
        redone["n"] += j["phase"] == "means"
        return job(lm, j, start, texts)

    monkeypatch.setattr(cc, "chunk_job", counted)
    resumed = cc.circuit_over_stories(lm, stories, tmp_path / "cut", resume=True, **kw)
    assert redone["n"] == 0  # the means' pass was done: not run again
    assert resumed.to_dict() == whole.to_dict()
