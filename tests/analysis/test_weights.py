"""Issue 59, the head's weights: the query, key and value weights every model gives (GPT-2's fused ``c_attn``,
GPT-Neo's and Llama's own projections with grouped key/value heads, GPT-NeoX's per-head ``query_key_value``, the
native model) are the ones its forward uses; Q/K/V composition scores are their definition, computed here the
long way; a head built to copy scores 1 and one built to suppress -1; and on the shipped model's export the
composition and OV copying scores equal TransformerLens's (``TransformerBridge``, unprocessed) within bounds
derived from float64 rounding."""

import copy

import pytest
import torch

import storylens.effects.weights as weights_module
from storylens.circuits.composition import composition_scores
from storylens.effects.weights import head_weights, ov_copying, qk_previous, qk_same_token
from storylens.engine.readout import norm_kind, readout
from storylens.lm import NativeLM, load_lm
from storylens.model.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

U = 2.0**-53  # float64's unit roundoff
D, H = 32, 4


@pytest.fixture(scope="module", params=["native", "gpt2", "gpt_neo", "gpt_neox", "llama"])
def lm(request, shipped_model, tmp_path_factory):
    if request.param == "native":
        return NativeLM(copy.deepcopy(shipped_model).double())
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    common = {"vocab_size": shipped_model.tokenizer.get_vocab_size(), "bos_token_id": tok.bos_token_id}
    cfg = {
        "gpt2": lambda: transformers.GPT2Config(n_layer=3, n_head=H, n_embd=D, n_positions=64, **common),
        "gpt_neo": lambda: transformers.GPTNeoConfig(
            num_layers=3, num_heads=H, hidden_size=D, max_position_embeddings=64,
            attention_types=[[["global"], 3]], **common,
        ),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(
            num_hidden_layers=3, num_attention_heads=H, hidden_size=D, intermediate_size=64,
            max_position_embeddings=64, **common,
        ),
        "llama": lambda: transformers.LlamaConfig(
            hidden_size=D, intermediate_size=64, num_hidden_layers=3, num_attention_heads=H, num_key_value_heads=2,
            max_position_embeddings=64, **common,
        ),
    }[request.param]()  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with (
        torch.no_grad()
    ):  # biases away from 0 and norms' gains away from 1, so that one read from the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
        for module in model.modules():
            if norm_kind(module) is not None:
                module.weight.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_lm(folder, dtype=torch.float64)


def test_projection_weights_make_the_queries_keys_and_values_the_model_makes(lm):
    """``x @ W[h] + b[h]``, ``x`` what the block's attention norm hands on, equals the model's own ``hook_q``,
    ``hook_k`` and ``hook_v`` in every block. Each entry is a sum of ``d_model`` float64 products: at most
    ``d_model`` roundings of the sum of the products' sizes on either side (``2 d_model u`` with margin 2)."""
    ids = torch.tensor([lm.encode("Once upon a time, Lily and Tom went to the park. Tom gave a ball to Lily.")])
    normed, got = {}, {}
    handles = [
        lm.attention_norm(layer).register_forward_hook(lambda m, a, out, layer=layer: normed.__setitem__(layer, out))
        for layer in range(lm.n_layer)
    ]
    keep = [
        (f"blocks.{layer}.attn.hook_{part}", lambda t, hook, part=part: got.__setitem__((hook.layer, part), t))
        for layer in range(lm.n_layer)
        for part in "qkv"
    ]
    with torch.no_grad(), lm.hooks(keep):
        lm.forward(ids)
    for h in handles:
        h.remove()
    for layer in range(lm.n_layer):
        x = normed[layer][0]  # [T, d]
        for part in "qkv":
            W, b = lm.projection_weights(layer, part)
            mine = torch.einsum("td,hdk->thk", x, W) + (0 if b is None else b[None])
            size = torch.einsum("td,hdk->thk", x.abs(), W.abs()) + (0 if b is None else b.abs()[None])
            assert (mine - got[(layer, part)][0]).abs().le(4 * x.shape[-1] * U * size + 1e-300).all(), (layer, part)


def test_composition_scores_are_their_definition(lm):
    """Every pair's Q, K and V composition equals ``|A B| / (|A| |B|)`` with the ``[d_model, d_model]`` matrices
    formed here (``OV_a = W_V W_O``, ``QK_b = W_Q W_K^T``, the key/value head of each query head's group), and
    0 where the reader is not in a later block. Both sides are a few float64 products of length at most
    ``d_model`` and Frobenius norms: ``64 d_model u`` absolute is a margin of several over their error."""
    w = head_weights(lm)
    scores = composition_scores(w)
    L, Hq = w.shape
    V, K = w.kv(w.W_V), w.kv(w.W_K)
    ov = V @ w.W_O
    qk = w.W_Q @ K.transpose(-1, -2)
    bound = 64 * w.W_O.shape[-1] * U
    for la in range(L):
        for lb in range(L):
            for a in range(Hq):
                for b in range(Hq):
                    for mode, right in (("q", qk[lb, b]), ("k", qk[lb, b].T), ("v", ov[lb, b])):
                        want = 0.0
                        if lb > la:
                            want = float((ov[la, a] @ right).norm() / ov[la, a].norm() / right.norm())
                        assert abs(float(scores[mode][la, a, lb, b]) - want) <= bound, (mode, la, a, lb, b)


def test_same_token_preference_is_its_definition(lm):
    """``qk_same_token`` from its factors equals the ``[vocab, vocab]`` matrix formed here: its diagonal's mean
    less its mean, over its standard deviation (float64; a relative ``vocab u`` per sum, margin 64)."""
    w = head_weights(lm)
    got = qk_same_token(w)
    for layer in range(w.shape[0]):
        for h in range(w.shape[1]):
            M = (w.W_E @ w.W_Q[layer, h]) @ (w.W_E @ w.kv(w.W_K)[layer, h]).T
            want = (M.diagonal().mean() - M.mean()) / M.std(unbiased=False)
            assert abs(float(got[layer, h] - want)) <= 64 * M.shape[0] * U * (1 + abs(float(want))), (layer, h)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_eigenvalues_split_over_threads_are_lapacks_bit_for_bit(threads):
    """``ov_copying``'s eigenvalues, the batch split over torch's threads, are those of one
    ``torch.linalg.eigvals`` call, bit for bit, in the same order (a split of 1, 2 and 3 parts, 7 matrices)."""
    from storylens.effects.weights import eigvals_split

    g = torch.Generator().manual_seed(0)
    matrices = torch.randn(7, 16, 16, dtype=torch.float64, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = eigvals_split(matrices)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, torch.linalg.eigvals(matrices))


def _dense_fold(norm, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``P diag(g) W`` with ``P diag(g)`` formed as a ``[d_model, d_model]`` matrix (the module docstring of
    storylens.effects.weights), and the same product of magnitudes."""
    kind, g, _ = norm_kind(norm)
    d = g.shape[0]
    fold = (torch.eye(d, dtype=torch.float64) - (1.0 / d if kind == "layer" else 0.0)) * g.to(torch.float64)[None, :]
    return fold @ W, fold.abs() @ W.abs()


def test_folded_weights_are_the_norms_matrix_times_the_stored_ones(lm):
    """Every reading weight ``head_weights`` folds (each block's ``W_Q``, ``W_K``, ``W_V`` through its attention
    norm, ``W_U`` through the final one) equals ``P diag(g) W`` with that ``[d_model, d_model]`` matrix formed here
    and multiplied in, the weights as stored taken from ``head_weights(fold=False)``. Either side is a sum of at most
    ``d_model`` float64 terms of those magnitudes, plus a scaling and a subtraction: within ``(d_model + 2) u`` of
    their sum each, ``4 d_model u`` of it leaving a margin of about two; the fold is checked to move the weights
    far more than that."""
    folded, stored = head_weights(lm), head_weights(lm, fold=False)
    d = folded.W_E.shape[1]
    pairs = [(folded.W_U, stored.W_U, readout(lm).norm)]
    for layer in range(lm.n_layer):
        norm = lm.attention_norm(layer)
        pairs += [(getattr(folded, n)[layer], getattr(stored, n)[layer], norm) for n in ("W_Q", "W_K", "W_V")]
    for got, W, norm in pairs:
        want, size = _dense_fold(norm, W)
        assert ((got - want).abs() <= 4 * d * U * size + 1e-300).all()
        assert (want - W).abs().max() > 1e6 * d * U * size.max()


@pytest.mark.parametrize("rows", [5, 128])
def test_previous_position_share_is_its_argmax_definition(lm, monkeypatch, rows):
    """``qk_previous``, taken a band of ``rows`` queries at a time with a maximum in place of an argmax, equals its
    definition computed the long way: the whole ``[window, window]`` positional QK circuit of every head, the keys
    after each query hidden, each query's argmax (the earliest of ties) compared with its previous position. Rows
    whose two highest scores lie within the scores' rounding of each other (``2 (d_model + head_size) u`` of the
    sum of the terms' magnitudes, doubled) may go either way; the shares may differ by those alone."""
    w = head_weights(lm)
    if w.W_pos is None:
        assert qk_previous(w) is None
        return
    monkeypatch.setattr(weights_module, "PREVIOUS_ROWS", rows)
    got = qk_previous(w)
    T, d, dh = w.W_pos.shape[0], w.W_pos.shape[1], w.W_Q.shape[-1]
    ahead = torch.ones(T, T, dtype=torch.bool).triu(1)
    for layer in range(w.shape[0]):
        for h in range(w.shape[1]):
            Q, K = w.W_Q[layer, h], w.kv(w.W_K)[layer, h]
            scores = ((w.W_pos @ Q) @ (w.W_pos @ K).T).masked_fill(ahead, float("-inf"))[1:]
            size = (w.W_pos.abs() @ Q.abs()) @ (w.W_pos.abs() @ K.abs()).T
            top2 = scores.topk(2, dim=-1).values  # query 1 sees two keys: every row has two
            close = (top2[:, 0] - top2[:, 1]) <= 4 * (d + dh) * U * size[1:].max(-1).values
            want = (scores.argmax(-1) == torch.arange(T - 1)).to(torch.float64).mean()
            assert abs(float(got[layer, h] - want)) <= int(close.sum()) / (T - 1) + 1e-15, (layer, h)
            assert int(close.sum()) < T // 8  # the comparison is not left to ties


def _one_head_model(sign: float) -> NativeLM:
    """A one-block native model whose head 0 copies (``sign`` 1: ``W_O = W_V^T``) or suppresses (-1) what it reads."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=1, n_head=2, n_embd=32)).double().eval()
    dh = 16
    with torch.no_grad():
        Wv = torch.randn(32, dh, dtype=torch.float64)
        model.transformer.h[0].attn.value.weight[:dh] = Wv.T  # head 0's value: x @ Wv
        model.transformer.h[0].attn.c_proj.weight[:, :dh] = sign * Wv  # its output: z @ (sign Wv^T)
    from storylens.model.hub import load_model

    return NativeLM(model, load_model().tokenizer)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_head_built_to_copy_scores_one_and_one_built_to_suppress_minus_one(sign):
    """With ``W_O = +-W_V^T`` and the tied unembedding, ``W_O W_U W_E W_V = +-(W_E P W_V)^T (W_E P W_V)``
    (``P`` the norms' centring): every eigenvalue of one sign, so the score is ``+-1``. A symmetric matrix's
    eigenvalues move by at most the size of its rounding (``head_size`` roundings a product of length ``vocab``,
    relative ``vocab u``), and the score by ``2 head_size`` of that over its trace, itself at least its norm."""
    lm = _one_head_model(sign)
    score = float(ov_copying(head_weights(lm))[0, 0])
    assert abs(score - sign) <= 2 * 16 * 4 * 4096 * U, score


def test_score_writes_the_weight_columns_and_composition(shipped_model, corpus_split, tmp_path, capsys, monkeypatch):
    """heads.csv carries every head's weight columns (the same numbers as from the weights directly) and
    composition.csv every pair of heads in rising blocks, the three scores from 0 to 1, strongest first; a model
    past the composition budget gets a note instead, and --composition writes it anyway."""
    import csv
    import json

    import storylens.corpus.score as score_module
    from storylens.circuits.composition import COMPOSITION_CSV
    from storylens.cli import main
    from storylens.data.stories import EOT

    source = tmp_path / "s.txt"
    source.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:8]))

    def score(name, *argv):
        out = tmp_path / name
        assert main(["score", "--stories", str(source), "--out", str(out), "--no-progress", *argv]) == 0
        return out

    out = score("w")
    heads = json.loads((out / "heads.json").read_text())["heads"]
    copying = ov_copying(head_weights(NativeLM(shipped_model)))
    for row in heads:
        assert row["ov_copying"] == pytest.approx(float(copying[row["block"] - 1, row["head"] - 1]), abs=1e-12)
        assert -1 <= row["ov_copying"] <= 1 and row["qk_previous"] is not None
    rows = list(csv.DictReader(open(out / "composition.csv")))
    assert len(rows) == 16 * (6 * 5 // 2) and tuple(rows[0]) == COMPOSITION_CSV
    tops = [max(float(r[m]) for m in "qkv") for r in rows]
    assert tops == sorted(tops, reverse=True) and all(0 <= float(r[m]) <= 1 for r in rows for m in "qkv")
    assert all(int(r["reader"][1]) > int(r["writer"][1]) for r in rows)
    monkeypatch.setattr(score_module, "COMPOSITION_BUDGET", 1)
    capsys.readouterr()
    assert not (score("past", "--limit", "4") / "composition.csv").exists()
    assert "composition.csv left out" in capsys.readouterr().err
    assert (score("asked", "--limit", "4", "--composition") / "composition.csv").exists()
