"""Attribution patching and direct logit attribution (storylens.effects.attribution) against a plain
computation the test writes itself on transformers' own modules (GPT-2, GPT-Neo, Llama with grouped
key/value heads) and on the native model, in float64: a forward pre-hook on each block's output
projection adds a per-story zero tensor (the head outputs' only route to the loss), torch.autograd
gives dL/dz story by story (one story at a time: no padding), and the first-order term
(z' - z) . dL/dz is summed over positions after the opening token and pooled over predicted tokens."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from storylens.effects.attribution import CausalAccumulator
from storylens.effects.audit import attribution
from storylens.engine.encode import batch_of, encode_stories
from storylens.engine.gradients import LOSS_ROWS, loss_gradient
from storylens.engine.record import Needs, plan, record
from storylens.lm import NativeLM, load_lm
from storylens.model.hub import load_model

STORIES = 6
TOL = 1e-9  # float64: the same sums in another order (bounds: terms of size ~1, a few thousand of them)


def _config(kind: str, vocab: int, bos: int):
    from transformers import GPT2Config, GPTNeoConfig, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=96, vocab_size=vocab, bos_token_id=bos)
    if kind == "gpt_neo":
        return GPTNeoConfig(
            num_layers=2,
            num_heads=4,
            hidden_size=32,
            max_position_embeddings=96,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            vocab_size=vocab,
            bos_token_id=bos,
        )
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        vocab_size=vocab,
        bos_token_id=bos,
        eos_token_id=bos,
    )


@pytest.fixture(scope="module")
def native():
    return load_model()


@pytest.fixture(scope="module")
def stories(corpus_split):
    return [" ".join(s.split()[:25]) for s in corpus_split.quiz[:STORIES]]


@pytest.fixture(scope="module", params=["gpt2", "gpt_neo", "llama", "native"])
def lm(request, native, tmp_path_factory):
    """A float64 model: a seeded tiny transformers model saved and loaded through storylens, or the native one."""
    if request.param == "native":
        return NativeLM(copy.deepcopy(native).double())
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=native.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        _config(request.param, native.tokenizer.get_vocab_size(), tok.bos_token_id)
    )
    with torch.no_grad():  # larger attention weights: heads that differ
        for name, p in model.named_parameters():
            if "attn" in name or "attention" in name:
                p.mul_(4.0)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_lm(folder, dtype=torch.float64)


def _projections(lm) -> list[torch.nn.Module]:
    """Each block's output projection, found by the test on the model's own modules."""
    out = []
    for name, m in lm.module.named_modules():
        if name.endswith(("attn.c_proj", "attention.out_proj", "self_attn.o_proj")):
            out.append(m)
    assert len(out) == lm.n_layer
    return out


def _final_norm(lm) -> torch.nn.Module:
    m = lm.module
    return m.transformer.ln_f if hasattr(m, "transformer") else m.model.norm


def _reference(lm, text: str, mu: torch.Tensor | None):
    """Per story: AtP zero and mean (at ``mu``) contributions [layer, head], DLA [layer, head], n."""
    ids = torch.tensor([lm.encode(text)])
    T, H = ids.shape[1], lm.n_head
    deltas, zs, held = [], [], {}

    def pre(module, args):
        x = args[0]
        delta = torch.zeros_like(x, requires_grad=True)
        deltas.append(delta)
        zs.append(x.detach().view(1, T, H, -1))
        return (x + delta,) + tuple(args[1:])

    handles = [p.register_forward_pre_hook(pre) for p in _projections(lm)]
    norm = _final_norm(lm)
    handles.append(norm.register_forward_pre_hook(lambda m, a: held.update(x=a[0].detach())))
    try:
        logits = lm.module(ids).logits if not isinstance(lm, NativeLM) else lm.module(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        grads = torch.autograd.grad(loss, deltas)
    finally:
        for h in handles:
            h.remove()
    zero, mean, dla = [], [], []
    x = held["x"][0]  # [T, D]
    centred = not type(norm).__name__.endswith("RMSNorm")
    eps = getattr(norm, "eps", None) or norm.variance_epsilon
    scale = ((x.var(-1, unbiased=False) if centred else x.pow(2).mean(-1)) + eps).sqrt()  # [T]
    W_U = lm.module.get_output_embeddings().weight if hasattr(lm.module, "get_output_embeddings") else None
    W_U = W_U if W_U is not None else lm.module.lm_head.weight
    for layer, (z, g) in enumerate(zip(zs, grads)):
        z, g = z[0, 1:], g.view(1, T, H, -1)[0, 1:]  # positions after the opening token
        zero.append(((0 - z) * g).sum((0, 2)))
        if mu is not None:
            mean.append(((mu[layer] - z) * g).sum((0, 2)))
        W_O = lm.head_output_weights(layer)  # [H, d, D]
        out = torch.einsum("thd,hdD->thD", zs[layer][0], W_O)  # [T, H, D]: each head's share
        if centred:
            out = out - out.mean(-1, keepdim=True)
        out = out / scale[:, None, None] * norm.weight
        logit = out @ W_U.T  # [T, H, V]
        nxt = ids[0, 1:]
        dla.append((logit[:-1].gather(-1, nxt[:, None, None].expand(-1, H, 1))[..., 0] - logit[:-1].mean(-1)).sum(0))
    stack = lambda xs: torch.stack(xs) if xs else None  # noqa: E731
    return stack(zero), stack(mean), torch.stack(dla), T - 1


def _rtol(lm) -> float:
    """Float32 inside float64 models: GPT-Neo's own attention casts queries and keys to float32, Llama's
    RMSNorm (and softmax) computes in float32; batched and single-story runs round there differently (2^-24
    relative), as do a recording riding on the gradient pass (the fused kernel's hidden states) and one of its
    own (the explicit attention's), a few times over two blocks. Elsewhere the same float64 sums in another order."""
    return 1e-6 if getattr(lm.module.config, "model_type", "") in ("gpt_neo", "llama") else 1e-9


def _pooled(cs: list[torch.Tensor], ns: list[int]):
    c, n = torch.stack(cs), torch.tensor(ns, dtype=torch.float64)
    R = c.sum(0) / n.sum()
    S = len(ns)
    se = (S / (S - 1) * ((c - R * n[:, None, None]) ** 2).sum(0)).sqrt() / n.sum()
    return R, se


@pytest.fixture(scope="module")
def measured(lm, stories):
    columns, acc = attribution(lm, stories, batch_size=4)
    return {**columns, "z_means": acc.z_means()}


def test_atp_and_dla_equal_the_first_order_terms_from_autograd(lm, stories, measured):
    mu = measured["z_means"]
    rtol = _rtol(lm)
    refs = [_reference(lm, s, mu) for s in stories]
    ns = [r[3] for r in refs]
    for i, key in ((0, "atp_zero"), (1, "atp_mean"), (2, "dla")):
        R, se = _pooled([r[i] for r in refs], ns)
        assert torch.allclose(measured[key], R, rtol=rtol, atol=rtol / 10), (key, (measured[key] - R).abs().max())
        assert torch.allclose(measured[f"{key}_se"], se, rtol=rtol * 100, atol=rtol / 10), key
    assert measured["atp_zero"].abs().max() > 1e-4  # the heads matter: not a test of zeros


def test_mu_is_the_mean_head_output_after_the_opening_token(lm, stories, measured):
    zs = []

    def keep(module, args):
        zs.append(args[0].detach()[0, 1:])

    handles = [p.register_forward_pre_hook(keep) for p in _projections(lm)]
    try:
        with torch.no_grad():
            for s in stories:
                lm.module(torch.tensor([lm.encode(s)]))
    finally:
        for h in handles:
            h.remove()
    L = lm.n_layer
    for layer in range(L):
        rows = torch.cat(zs[layer::L])  # [positions, H * d]
        assert torch.allclose(measured["z_means"][layer].flatten(), rows.mean(0), rtol=_rtol(lm), atol=_rtol(lm) / 10)


def test_plan_says_gradients_and_skips_the_recording_forward(lm):
    p = plan(lm, [CausalAccumulator(lm.n_layer, lm.n_head)])
    assert p.gradients and not p.attention


def test_merged_and_resumed_equal_one_process(lm, stories):
    def run(part):
        acc = CausalAccumulator(lm.n_layer, lm.n_head)
        record(lm, part, [acc], batch_size=1, progress=False)  # the same batches whole or split
        return acc

    whole = run(stories).columns()
    first = run(stories[:3])
    resumed = CausalAccumulator(lm.n_layer, lm.n_head).load_state(json.loads(json.dumps(first.state())))
    merged = resumed.merge(run(stories[3:])).columns()
    for k, v in whole.items():
        assert torch.allclose(merged[k], v, rtol=TOL, atol=TOL), k


class _Rows:
    """A streaming measure that counts the query rows it is fed per block, and sums per head what it reads of
    them: the probabilities weighed by key position, the head output sizes and the key norms."""

    needs = Needs(key_norms=True, outputs=True)

    def __init__(self):
        self.rows: dict[int, int] = {}
        self.sums: dict[int, torch.Tensor] = {}
        self.batches = 0

    def begin(self, batch):
        self.batches += 1

    def feed(self, chunk):
        self.rows[chunk.layer] = self.rows.get(chunk.layer, 0) + chunk.probs.shape[0] * chunk.probs.shape[-2]
        place = torch.arange(chunk.probs.shape[-1], dtype=torch.float64)
        read = [(chunk.probs.double() * place).sum((0, 2, 3))]
        read += [t.double().sum((0, 2)) for t in (chunk.outputs, chunk.key_norms) if t is not None]
        self.sums[chunk.layer] = self.sums.get(chunk.layer, 0) + torch.stack(read)

    def end(self):
        pass


def test_with_an_attention_measure_each_row_is_fed_once_and_atp_is_unchanged(lm, stories, measured):
    """Beside the causal columns, an attention measure is fed every row once, what it reads as a recording alone
    reads it (within :func:`_rtol`), and the causal columns are those computed alone."""
    alone, beside = _Rows(), _Rows()
    record(lm, stories, [alone], batch_size=4, progress=False)
    acc = CausalAccumulator(lm.n_layer, lm.n_head)
    record(lm, stories, [beside, acc], batch_size=4, progress=False)
    assert beside.rows == alone.rows  # the gradient pass hands no rows to the attention measures
    for layer, got in beside.sums.items():
        assert torch.allclose(got, alone.sums[layer], rtol=_rtol(lm), atol=0), layer
    for k, v in acc.columns().items():
        assert v is not None and torch.allclose(v, measured[k], rtol=1e-12, atol=1e-15), k


def test_the_recording_rides_on_the_gradient_passs_forward(lm, stories, monkeypatch):
    """Where the maps stream, the recording rides on the gradient pass's first forward: with every block's graph
    kept, each block runs once a batch (twice with a forward of the recording's own, as on the native model, whose
    maps come whole, and on GPT-Neo, whose attention is its own), and both the causal columns and what the
    attention measure reads are those of the two passes run apart, the causal columns bit for bit (the forward
    hands on the fused kernel's output either way)."""
    from storylens.engine import record as record_module

    def run(rides: bool):
        if not rides:
            monkeypatch.setattr(record_module._Pass, "rides", lambda self: False)
        rows, acc = _Rows(), CausalAccumulator(lm.n_layer, lm.n_head, graph_bytes=1 << 40)
        record(lm, stories, [rows, acc], batch_size=4, progress=False)  # the pass's checks on this model, once
        calls = [0] * lm.n_layer
        handles = [
            b.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
            for i, b in enumerate(lm.blocks())
        ]
        rows, acc = _Rows(), CausalAccumulator(lm.n_layer, lm.n_head, graph_bytes=1 << 40)
        try:
            record(lm, stories, [rows, acc], batch_size=4, progress=False)
        finally:
            for h in handles:
                h.remove()
            monkeypatch.undo()
        return rows, acc.columns(), calls

    rows, columns, calls = run(True)
    apart, apart_columns, apart_calls = run(False)
    streamed = plan(lm, [rows]).streamed
    assert streamed or isinstance(lm, NativeLM) or lm.module.config.model_type == "gpt_neo"  # (its own attention)
    assert calls == [rows.batches * (1 if streamed else 2)] * lm.n_layer
    assert apart_calls == [rows.batches * 2] * lm.n_layer
    assert rows.rows == apart.rows
    for layer, got in rows.sums.items():
        assert torch.allclose(got, apart.sums[layer], rtol=_rtol(lm), atol=0), layer
    for k, v in columns.items():
        assert v is not None and torch.equal(v, apart_columns[k]), k


def _loss_with(lm, ids: torch.Tensor, layer: int, head: int, replace) -> torch.Tensor:
    """The story's summed next-token loss with head ``head``'s output at positions >= 1 set to
    ``replace(z)``, by a pre-hook on the block's output projection (acting per head, before it)."""
    H = lm.n_head

    def pre(module, args):
        x = args[0]
        z = x.view(*x.shape[:-1], H, -1).clone()
        z[0, 1:, head] = replace(z[0, 1:, head])
        return (z.flatten(-2),) + tuple(args[1:])

    handle = _projections(lm)[layer].register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            logits = lm.module(ids).logits
    finally:
        handle.remove()
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")


def test_atp_is_the_limit_of_exact_ablation_scaled_down(lm, stories, measured):
    """Exact patching of z -> z + e (z' - z), z' = mu or 0: (L(e) - L(0)) / e -> the story's AtP as
    e -> 0 with an error linear in e (the second-order term): from e = 0.1 to 0.01 the gap shrinks
    about tenfold (at least fivefold: a third-order term may remain). Steps this large keep clear of
    rounding: Llama's RMSNorm computes in float32 even in a float64 model."""
    if getattr(lm.module.config, "model_type", "") == "gpt_neo":
        pytest.skip("GPT-Neo's own attention forms its scores in float32: finite differences hit that floor")
    one = stories[0]
    mu = measured["z_means"]
    ids = torch.tensor([lm.encode(one)])
    base = _loss_with(lm, ids, 0, 0, lambda z: z)
    zero_ref, mean_ref, _, _ = _reference(lm, one, mu)
    for layer, head in ((0, 1), (lm.n_layer - 1, 2)):
        m = mu[layer, head]
        for atp, target in (
            (mean_ref[layer, head], lambda z, m=m: m.expand_as(z)),
            (zero_ref[layer, head], torch.zeros_like),
        ):
            gaps = []
            for e in (1e-1, 1e-2):
                patched = _loss_with(lm, ids, layer, head, lambda z, e=e, t=target: z + e * (t(z) - z))
                gaps.append(abs(float((patched - base) / e - atp)))
            assert gaps[1] < gaps[0] / 5, (layer, head, gaps)


def test_the_heads_outputs_sum_to_the_attention_output(lm, stories):
    """sum_h z_h W_O^h plus the projection's bias is the block's attention output: what DLA reads per head."""
    kept = {}

    def keep(module, args, out):
        kept[module] = (args[0], out)

    handles = [p.register_forward_hook(keep) for p in _projections(lm)]
    try:
        with torch.no_grad():
            lm.module(torch.tensor([lm.encode(stories[0])]))
    finally:
        for h in handles:
            h.remove()
    for layer, proj in enumerate(_projections(lm)):
        x, out = kept[proj]
        z = x.view(*x.shape[:-1], lm.n_head, -1)  # [1, T, H, d]
        per_head = torch.einsum("bthd,hdD->bthD", z, lm.head_output_weights(layer))
        bias = proj.bias if getattr(proj, "bias", None) is not None else 0
        assert torch.allclose(per_head.sum(2) + bias, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_loss_gradient_is_autograds_through_cross_entropy(dtype):
    """loss_gradient (the gradient pass's seed, formed a few rows at a time) equals autograd through
    the summed cross entropy of the predicted positions; a batch longer than LOSS_ROWS, rows not
    predicted left at 0. Bounds: both sides run the same row-wise log_softmax kernel on the same rows,
    then exp (autograd's inside the log-softmax backward, ours torch.exp), each within 1 ulp, and
    subtract the one-hot 1 (exact for p >= 1/2 by Sterbenz, one rounding below): at most about 3 ulps
    of a number in [0, 1]. float64: 3 * 2^-53 < 4e-16, bound 1e-15; float32: 3 * 2^-24, bound
    4 * 2^-24; bfloat16: ours rounded to bfloat16 at the end (2^-9 for |g| <= 1) against autograd's
    float32, bound 2^-8."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, LOSS_ROWS // 2 + 7, 50  # B * T crosses LOSS_ROWS
    logits = (4 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).to(dtype)
    nexts = torch.randint(0, V, (B, T), generator=g)
    predicted = torch.rand(B, T, generator=g) < 0.8
    x = logits.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    nll = torch.nn.functional.cross_entropy(x.flatten(0, 1), nexts.flatten(), reduction="none")
    (want,) = torch.autograd.grad((nll.view(B, T) * predicted).sum(), x)
    got = loss_gradient(logits, nexts, predicted)
    assert got.dtype == dtype and got.shape == (B, T, V)
    assert bool((got[~predicted] == 0).all())
    tol = {torch.float64: 1e-15, torch.float32: 4 * 2.0**-24, torch.bfloat16: 2.0**-8}[dtype]
    assert (got.to(torch.float64) - want.to(torch.float64)).abs().max().item() <= tol


def _columns_by(lm, stories, way: str) -> dict:
    """AtP/DLA columns with the pass run ``way``: ``"checked"`` as the model's probe chooses,
    ``"blockwise"`` block by block with whole logits, ``"whole"`` one graph through the whole model."""
    from storylens.engine import gradients

    gradients._WAYS.pop(lm.module, None)
    if way != "checked":
        gradients._WAYS[lm.module] = gradients._Way(way == "blockwise", False)
    try:
        acc = CausalAccumulator(lm.n_layer, lm.n_head)
        record(lm, stories, [acc], progress=False, names=frozenset(), batch_size=3)
        return acc.columns()
    finally:
        gradients._WAYS.pop(lm.module, None)


def test_the_block_by_block_pass_equals_one_graph_through_the_model(lm, stories, capsys):
    """Rerunning each block from its kept input and backpropagating it alone (bounded memory), with
    the logits whole or a few rows at a time, gives the columns one graph through the whole model
    gives: the same operations on the same numbers, float64 (a rerun may round differently where a
    kernel differs: far below TOL)."""
    from storylens.engine import gradients

    checked = _columns_by(lm, stories, "checked")
    assert "cannot be rerun" not in capsys.readouterr().err
    blockwise, whole = _columns_by(lm, stories, "blockwise"), _columns_by(lm, stories, "whole")
    for name, value in checked.items():
        assert value is not None and torch.isfinite(value).all(), name
        for other in (blockwise, whole):
            assert (value - other[name]).abs().max() <= TOL * max(1.0, float(whole[name].abs().max())), name
    # transformers models form the logits a few rows at a time (the native model has no base model)
    batch = batch_of(encode_stories(lm, stories[:1], frozenset()), lm.marker_id, lm.device)
    way = gradients._way(lm, lm.blocks(), batch)
    assert (
        (way.blockwise, way.split_head) == (True, not isinstance(lm, NativeLM))
        and way.cost is not None
        and way.cost.per_token > 0
    )


def _handed(lm, batch, kept: int) -> list:
    """(layer, z, dL/dz) as the block-by-block pass hands them over, the first ``kept`` blocks' graphs
    kept from the first forward."""
    from storylens.engine import gradients

    got: list = []
    with torch.inference_mode(False), gradients._frozen(lm.module):
        assert gradients._blockwise(lm, lm.blocks(), batch, gradients.readout(lm), got.append, False, kept)
    return [(g.layer, g.z, g.grad) for g in got]


def test_blocks_whose_graphs_are_kept_hand_over_what_their_reruns_would(lm, stories):
    """Keeping the first blocks' graphs from the first forward (no rerun for them), any number of them
    up to one graph through the whole model, hands over every block once, the last first, with the
    ``z`` and ``dL/dz`` of the pass that reruns every block: the same operations, float64."""
    batch = batch_of(encode_stories(lm, stories[:3], frozenset()), lm.marker_id, lm.device)
    last = lm.n_layer - 1
    lean = _handed(lm, batch, 0)
    assert [layer for layer, _, _ in lean] == list(reversed(range(lm.n_layer)))
    assert all(float(g.abs().max()) > 0 for _, _, g in lean)
    for kept in sorted({1, last // 2, last, last + 5}):
        got = _handed(lm, batch, kept)
        assert [layer for layer, _, _ in got] == [layer for layer, _, _ in lean], kept
        for (_, z, g), (_, z0, g0) in zip(got, lean):
            assert (z - z0).abs().max() <= TOL * max(1.0, float(z0.abs().max())), kept
            assert (g - g0).abs().max() <= TOL * max(1.0, float(g0.abs().max())), kept


def test_kept_blocks_fill_the_budget_and_never_the_last():
    from storylens.engine.gradients import BlockCost, _kept

    ids, cost = torch.zeros(4, 250, dtype=torch.long), BlockCost(30_000.0, 0.0)  # 1,000 tokens: 30 MB a block
    assert _kept(0, cost, ids, 29) == 0  # no budget: every block reruns
    assert _kept(1 << 30, None, ids, 29) == 0  # a block's bytes unknown: none kept
    assert _kept(3 * 30_000_000 + 1, cost, ids, 29) == 3
    assert _kept(3 * 30_000_000 - 1, cost, ids, 29) == 2
    assert _kept(1 << 40, cost, ids, 29) == 29  # all but the last: one graph through the model
    assert _kept(3 * 30_000_000 + 1, BlockCost(30_000.0, 40.0), ids, 29) == 2  # + 4 x 250^2 x 40 = 10 MB a block


class _Shuffled(NativeLM):
    """A model whose ``blocks()`` misstates the order: rerunning them cannot give what the model ran."""

    def blocks(self):
        return list(reversed(super().blocks()))


def test_a_model_whose_blocks_do_not_rerun_takes_one_graph_and_says_so(native, stories, capsys):
    lm = _Shuffled(copy.deepcopy(native).double())
    straight = NativeLM(lm.module)
    got = _columns_by(lm, stories, "checked")
    assert "cannot be rerun one at a time" in capsys.readouterr().err
    want = _columns_by(straight, stories, "whole")
    for name in got:
        assert (got[name] - want[name]).abs().max() <= TOL * max(1.0, float(want[name].abs().max())), name


class _Live:
    """Bytes of the tensors autograd holds for a backward (parameters aside), now and at most."""

    def __init__(self, module: torch.nn.Module):
        self.now = self.peak = 0
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(self, t: torch.Tensor):
        return t if t.untyped_storage().data_ptr() in self.params else _Held(self, t)

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Held) else x


class _Held:
    def __init__(self, live: _Live, t: torch.Tensor):
        self.live, self.t, self.n = live, t, t.numel() * t.element_size()
        live.now += self.n
        live.peak = max(live.peak, live.now)

    def __del__(self):
        self.live.now -= self.n


def _held_peak(native_tok, layers: int, whole: bool, tmp_path, graph: float = 0.0) -> int:
    """The most bytes held for the backward at once while the gradient pass runs on 4 quiz-length
    stories, on a seeded Llama of ``layers`` blocks; ``graph``: the kept graphs' budget, in blocks'
    worth on this batch (from what a block holds per token, :func:`gradients.block_bytes`)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from storylens.engine import gradients

    tok = PreTrainedTokenizerFast(tokenizer_object=native_tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    cfg = _config("llama", native_tok.get_vocab_size(), tok.bos_token_id)
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    folder = tmp_path / f"llama-{layers}"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    lm = load_lm(folder)
    texts = ["Tom and Sam went to the park. Tom saw a big red ball and gave it to Sam. " * 3] * 4
    batch = batch_of(encode_stories(lm, texts, frozenset()), lm.marker_id, lm.device)
    cost = gradients.BlockCost.measure(lm, lm.blocks(), batch.ids[:1, :16].clone()) if graph else None
    gradients._WAYS[lm.module] = gradients._Way(not whole, not whole, cost)
    budget = int(graph * cost.batch(batch.ids)) if cost is not None else 0
    assert gradients._kept(budget, cost, batch.ids, layers - 1) == min(int(graph), layers - 1)
    live = _Live(lm.module)
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        gradients.gradient_pass(lm, batch, lambda g: None, graph_bytes=budget)
    return live.peak


def test_the_gradient_pass_holds_one_block_at_a_time_whatever_the_depth(native, tmp_path):
    """Memory bounded as the recording pass's is: what the block-by-block pass holds for its backward
    does not grow with the model's depth (the same shapes: the same bytes, exactly), while one graph
    through the whole model holds every block's."""
    two, eight = (_held_peak(native.tokenizer, n, False, tmp_path) for n in (2, 8))
    whole_two, whole_eight = (_held_peak(native.tokenizer, n, True, tmp_path) for n in (2, 8))
    assert two == eight > 0
    # one graph: 8 blocks' activations (7 whole, the first from its hook_z on) against 2, and several
    # times what one block and the tail hold
    assert whole_eight > 3 * whole_two and whole_eight > 4 * eight
    # a budget of 3.5 blocks' graphs keeps 3 blocks' whatever the depth: more than one block at a
    # time, the same at 6 blocks as at 8, far below one graph through 8
    six, kept_eight = (_held_peak(native.tokenizer, n, False, tmp_path, graph=3.5) for n in (6, 8))
    assert six == kept_eight > eight and kept_eight < whole_eight / 2


def test_what_a_block_holds_is_foreseen_from_two_short_probes(lm, stories):
    """A block's graph on a story six times the longer probe (96 tokens against 16 and 32) holds
    what the probes' fit says: linear in the tokens for a fused attention, with a square term where
    the attention keeps its map (GPT-Neo's local attention); a budget set from it holds on long
    stories. The fit is exact where the bytes are a quadratic in the tokens; 5% covers a few vectors
    every run keeps whatever its length."""
    from storylens.engine import gradients

    ids = torch.tensor([lm.encode(" ".join(stories))[:96]])  # the test models' window
    with torch.inference_mode(False), gradients._frozen(lm.module):
        cost = gradients.BlockCost.measure(lm, lm.blocks(), ids[:, :16].clone())
        held = gradients.block_bytes(lm, lm.blocks(), ids)
    assert cost.per_token > 0 and abs(cost.batch(ids) - held) <= 0.05 * held


def test_logits_are_formed_whole_where_the_model_changes_them_after_its_unembedding(lm, stories):
    """A soft cap or scale after the unembedding (named in the config, or only seen in the logits)
    keeps the logits whole: the few-rows-at-a-time gradient would miss it."""
    from storylens.engine import gradients

    if isinstance(lm, NativeLM):
        pytest.skip("the native model has no base model: its logits are always formed whole")
    ids = torch.tensor([lm.encode(stories[0])[:16]])
    assert gradients._splits(lm, ids)
    handle = lm.module.register_forward_hook(lambda m, args, out: out.__setitem__("logits", out.logits * 0.5))
    try:
        assert not gradients._splits(lm, ids)
    finally:
        handle.remove()
    lm.module.config.final_logit_softcapping = 30.0
    try:
        assert gradients._split_head(lm) is None and not gradients._splits(lm, ids)
    finally:
        del lm.module.config.final_logit_softcapping
