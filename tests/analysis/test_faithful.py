"""Norm-weighted attention on the native model, against the same quantities written out plainly
from its own modules in float64; the pure functions on hand-built cases."""

import math

import pytest
import torch

from storylens.analysis.faithful import (
    key_norms,
    looks_without_moving,
    norm_weighted,
    ov_gram,
    rank_correlation,
    rank_moves,
)
from storylens.analysis.names import main_character, name_vocabulary
from storylens.analysis.scores import score_heads
from storylens.core.heads import Head
from storylens.lm import NativeLM
from storylens.model.tokenizer import text_only


@pytest.fixture(scope="module")
def native64(shipped_model):
    import copy

    return copy.deepcopy(shipped_model).double()


def test_norm_columns_on_the_native_model_equal_the_plain_computation(native64, corpus_split):
    """w_ij = a_ij |f_j| / sum_k a_ik |f_k| with f_j = v_j W_O^h, from the model's own value and
    output projections; the previous-token and marker scores and the output norm, per story, in float64."""
    lm = NativeLM(native64)
    stories = corpus_split.quiz[:6]
    got = score_heads(lm, stories, batch_size=3, progress=False)
    H, d = lm.n_head, native64.config.head_size
    names = name_vocabulary(stories)
    per = {k: {} for k in ("prev_token", "marker", "name_mass", "output_norm")}
    for text in stories:
        ids = lm.encode(text)[: lm.window]
        enc = text_only(lm.tokenizer).encode(text, add_special_tokens=False)
        mc = main_character(text, enc.offsets, names, lm.window)
        inputs = {}
        hooks = [
            blk.attn.register_forward_pre_hook(lambda m, a, i=i, seen=inputs: seen.__setitem__(i, a[0][0]))
            for i, blk in enumerate(native64.transformer.h)
        ]
        try:
            with torch.no_grad():
                patterns = native64(torch.tensor([ids]), record_attention=True).patterns
        finally:
            for h in hooks:
                h.remove()
        T = len(ids)
        for layer, blk in enumerate(native64.transformer.h):
            a = patterns[layer][0]  # [head, q, k]
            with torch.no_grad():
                v = blk.attn.value(inputs[layer]).view(T, H, d)
                w_o = blk.attn.c_proj.weight  # [d_model, head * d]
                f = torch.stack([v[:, h] @ w_o[:, h * d : (h + 1) * d].T for h in range(H)])  # [head, key, d_model]
            n = f.norm(dim=-1)
            w = a * n[:, None, :]
            w = w / w.sum(-1, keepdim=True)
            moved = torch.einsum("hqk,hke->hqe", a, f).norm(dim=-1)
            for h in range(H):
                key = (layer, h)
                per["prev_token"].setdefault(key, []).append(float(sum(w[h, q, q - 1] for q in range(1, T)) / (T - 1)))
                per["marker"].setdefault(key, []).append(float(w[h, 1:, 0].mean()))
                per["output_norm"].setdefault(key, []).append(float(moved[h, 1:].mean()))
                if mc is not None and mc.positions:
                    qs = [q for q in range(T) if q > mc.first_mention and q not in mc.positions]
                    if qs:
                        mass = [sum(float(w[h, q, k]) for k in mc.positions if k <= q) for q in qs]
                        per["name_mass"].setdefault(key, []).append(sum(mass) / len(mass))
    for col, heads in per.items():
        assert len(heads) == lm.n_layer * H, col
        for (layer, h), vals in heads.items():
            row = got.at(Head(layer, h))
            have = row.output_norm if col == "output_norm" else getattr(row, "norm_" + col)
            assert abs(have - sum(vals) / len(vals)) <= 1e-9 * max(1.0, abs(have)), (col, row.label)


def test_raw_columns_are_unchanged_by_the_norm_weighting(shipped_model, corpus_split):
    """The same stories with and without the value hooks: the raw columns bit for bit."""
    from storylens.analysis.record import record
    from storylens.analysis.scores import HeadScoreAccumulator, score_table

    lm = NativeLM(shipped_model)
    stories = corpus_split.quiz[:8]
    with_norms = score_heads(lm, stories, batch_size=4, progress=False)
    acc = HeadScoreAccumulator(lm.n_layer, lm.n_head, faithful=False)
    stats = record(lm, stories, [acc], batch_size=4, progress=False)
    without = score_table(acc, stats, None, lm.window)
    assert without.heads[0].norm_marker is None and without.heads[0].output_norm is None
    for a, b in zip(with_norms.heads, without.heads):
        for col in ("name_mass", "prev_token", "prev_argmax", "prev4", "marker", "duplicate_token", "induction"):
            assert getattr(a, col) == getattr(b, col), (a.label, col)


def test_a_key_with_a_zero_value_vector_gets_no_weight():
    torch.manual_seed(0)
    B, T, H, d, D = 2, 7, 3, 4, 10
    v = torch.randn(B, T, H, d, dtype=torch.float64)
    v[:, 2] = 0.0  # key 2 carries nothing in every head
    w_o = torch.randn(H, d, D, dtype=torch.float64)
    pattern = torch.rand(B, H, T, T, dtype=torch.float64).tril()
    pattern = pattern / pattern.sum(-1, keepdim=True)
    n = key_norms(v, ov_gram(w_o))
    assert torch.equal(n[:, :, 2], torch.zeros(B, H, dtype=torch.float64))
    w = norm_weighted(pattern, n)
    assert torch.equal(w[..., 2], torch.zeros(B, H, T, dtype=torch.float64))
    assert torch.allclose(w[:, :, 3:].sum(-1), torch.ones(B, H, T - 3, dtype=torch.float64), atol=1e-12)
    # query 2 sees keys 0..2; with keys 0 and 1 also zeroed its row has nothing to share out: all zero
    v[:, :2] = 0.0
    w = norm_weighted(pattern, key_norms(v, ov_gram(w_o)))
    assert torch.equal(w[:, :, :3], torch.zeros(B, H, 3, T, dtype=torch.float64))


def test_grouped_values_go_to_the_query_heads_that_read_them():
    torch.manual_seed(1)
    v = torch.randn(1, 5, 2, 3, dtype=torch.float64)  # 2 key/value groups
    w_o = torch.randn(4, 3, 6, dtype=torch.float64)  # 4 query heads: 0, 1 read group 0; 2, 3 group 1
    n = key_norms(v, ov_gram(w_o))
    for h in range(4):
        direct = (v[0, :, h // 2] @ w_o[h]).norm(dim=-1)
        assert torch.allclose(n[0, h], direct, rtol=1e-12)


def test_rank_correlation_and_moves():
    a = [0.9, 0.1, 0.5, 0.3, 0.7]
    b = [0.8, 0.2, 0.1, 0.4, 0.6]
    ra, rb = [5, 1, 3, 2, 4], [5, 2, 1, 3, 4]
    n = len(a)
    spearman = 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))
    assert rank_correlation(a, b) == pytest.approx(spearman, abs=1e-12)
    assert rank_correlation(a, a) == pytest.approx(1.0)
    assert rank_correlation(a, [-x for x in a]) == pytest.approx(-1.0)
    assert rank_correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None and rank_correlation([1.0], [2.0]) is None
    labels = ["A", "B", "C", "D", "E"]
    assert rank_moves(a, b, labels, k=1) == [("C", 3.0, 5.0)]  # 3rd strongest raw, weakest weighted


def test_looks_without_moving_flags_a_strong_head_that_writes_nothing():
    raw = {"marker": torch.tensor([[0.9, 0.1, 0.2, 0.1], [0.2, 0.3, 0.95, 0.1]], dtype=torch.float64)}
    share = torch.tensor([[0.02, 0.4, 0.3, 0.28], [0.3, 0.3, 0.3, 0.1]], dtype=torch.float64)
    flags = looks_without_moving(raw, share)  # top tenth of 8 heads: 1 head; negligible: < 0.25 / 4
    assert flags[1][2] == () and flags[0][0] == ()  # L2H3 is strongest but writes 30%; L1H1 not in the top 1
    flags = looks_without_moving(raw, share, top=0.25)  # the top 2: L2H3 and L1H1
    assert flags[0][0] == ("marker",) and sum(len(f) for row in flags for f in row) == 1
    assert math.isclose(0.25 / 4, 0.0625)
