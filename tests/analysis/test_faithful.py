"""Norm-weighted attention on the native model, against the same quantities written out plainly
from its own modules in float64; the pure functions on hand-built cases."""

import sys
from pathlib import Path

import pytest
import torch

from storylens.core.heads import Head
from storylens.data.names import main_character, name_vocabulary
from storylens.engine.images import head_images, head_norms, key_norms, ov_factor
from storylens.engine.ranks import rank_correlation, rank_moves
from storylens.lm import NativeLM
from storylens.looking.faithful import norm_weighted
from storylens.model.tokenizer import text_only
from storylens.table.scores import score_heads


@pytest.fixture(scope="module")
def native64(shipped_model):
    import copy

    return copy.deepcopy(shipped_model).double()


def test_norm_columns_on_the_native_model_equal_the_plain_computation(native64, corpus_split):
    """w_ij = a_ij |f_j| / sum_k a_ik |f_k| with f_j = v_j W_O^h, from the model's own value and
    output projections; every detector on w (the reference of tests/test_lm.py, written plainly),
    the output norm and share, per story, in float64."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_lm import _reference_on

    lm = NativeLM(native64)
    stories = corpus_split.quiz[:6]
    got = score_heads(lm, stories, batch_size=3, progress=False)
    H, d = lm.n_head, native64.config.head_size
    names = name_vocabulary(stories)
    per: dict[str, dict] = {}
    seen: list[tuple[list, list]] = []  # per story, every block's probabilities and value vectors (the sink columns)
    for text in stories:
        ids = lm.encode(text)[: lm.window]
        enc = text_only(lm.tokenizer).encode(text, add_special_tokens=False)
        mc = main_character(text, enc.offsets, names, lm.window)
        pos = list(mc.positions) if mc is not None else []
        first = mc.first_mention if mc is not None and pos else None
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
        weighted, atts, fs = [], [], []
        seen.append((atts, fs))
        for layer, blk in enumerate(native64.transformer.h):
            a = patterns[layer][0]  # [head, q, k]
            with torch.no_grad():
                v = blk.attn.value(inputs[layer]).view(T, H, d)
                w_o = blk.attn.c_proj.weight  # [d_model, head * d]
                f = torch.stack([v[:, h] @ w_o[:, h * d : (h + 1) * d].T for h in range(H)])  # [head, key, d_model]
            w = a * f.norm(dim=-1)[:, None, :]
            weighted.append(w / w.sum(-1, keepdim=True))
            atts.append(a)
            fs.append(f)
            moved = torch.einsum("hqk,hke->hqe", a, f).norm(dim=-1)
            for h in range(H):
                per.setdefault("output_norm", {}).setdefault((layer, h), []).append(float(moved[h, 1:].mean()))
        for k, grid in _reference_on(weighted, ids, lm.marker_id, pos, first).items():
            for layer, row in enumerate(grid):
                for h, val in enumerate(row):
                    if val is not None:
                        per.setdefault(k, {}).setdefault((layer, h), []).append(val)
    assert len(per) == 8  # seven detectors and the output norm
    for col, heads in per.items():
        assert len(heads) == lm.n_layer * H, col
        for (layer, h), vals in heads.items():
            row = got.at(Head(layer, h))
            have = row.output_norm if col == "output_norm" else getattr(row, "norm_" + col)
            assert abs(have - sum(vals) / len(vals)) <= 1e-9 * max(1.0, abs(have)), (col, row.label)
    for layer in range(lm.n_layer):
        norms = [sum(per["output_norm"][(layer, h)]) for h in range(H)]
        for h in range(H):
            assert abs(got.at(Head(layer, h)).output_share - norms[h] / sum(norms)) <= 1e-9
    from sink_reference import assert_sink_columns

    assert assert_sink_columns(got, seen) == 5 * lm.n_layer * H  # sink_rate .. active_rate, every head


def test_a_head_that_writes_nothing_is_dormant(shipped_model, corpus_split):
    """Zero one strong previous-token head's slice of the output projection: it still looks where it
    looked (raw scores unchanged), but every key now carries nothing through it, so its norm-weighted
    scores are 0, its output and context norms 0, and the head table flags it (and only it) dormant."""
    import copy

    model = copy.deepcopy(shipped_model)
    before = score_heads(model, corpus_split.quiz[:12], batch_size=4, progress=False)
    target = before.best("prev_token")
    layer, head = target.block - 1, target.head - 1
    d = model.config.head_size
    with torch.no_grad():
        model.transformer.h[layer].attn.c_proj.weight[:, head * d : (head + 1) * d] = 0.0
    after = score_heads(model, corpus_split.quiz[:12], batch_size=4, progress=False)
    row = after.at(Head(layer, head))
    assert row.prev_token == target.prev_token and row.prev4 == target.prev4  # it looks the same
    assert row.norm_prev_token == 0.0 and row.output_norm == 0.0 and row.output_share == 0.0
    assert row.context_norm == 0.0 and row.context_share == 0.0 and row.active_rate == 0.0
    assert row.dormant and before.at(Head(layer, head)).dormant is False
    assert [h.label for h in after.heads if h.dormant] == [row.label]


def test_raw_columns_are_unchanged_by_the_norm_weighting(shipped_model, corpus_split):
    """The same stories with and without the value hooks: the raw columns bit for bit."""
    from storylens.engine.record import record
    from storylens.table.accumulator import HeadScoreAccumulator
    from storylens.table.scores import score_table

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
    n = key_norms(v, ov_factor(w_o))
    assert torch.equal(n[:, :, 2], torch.zeros(B, H, dtype=torch.float64))
    w = norm_weighted(pattern, n)
    assert torch.equal(w[..., 2], torch.zeros(B, H, T, dtype=torch.float64))
    assert torch.allclose(w[:, :, 3:].sum(-1), torch.ones(B, H, T - 3, dtype=torch.float64), atol=1e-12)
    # query 2 sees keys 0..2; with keys 0 and 1 also zeroed its row has nothing to share out: all zero
    v[:, :2] = 0.0
    w = norm_weighted(pattern, key_norms(v, ov_factor(w_o)))
    assert torch.equal(w[:, :, :3], torch.zeros(B, H, 3, T, dtype=torch.float64))


def test_grouped_values_go_to_the_query_heads_that_read_them():
    torch.manual_seed(1)
    v = torch.randn(1, 5, 2, 3, dtype=torch.float64)  # 2 key/value groups
    w_o = torch.randn(4, 3, 6, dtype=torch.float64)  # 4 query heads: 0, 1 read group 0; 2, 3 group 1
    n = key_norms(v, ov_factor(w_o))
    for h in range(4):
        direct = (v[0, :, h // 2] @ w_o[h]).norm(dim=-1)
        assert torch.allclose(n[0, h], direct, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_norms_are_the_lengths_of_the_head_images_bit_for_bit(dtype):
    """head_norms takes each length before the images are copied into head order: the same numbers,
    to the bit, as the lengths of head_images (grouped and ungrouped heads, a head size not a
    multiple of the vector width)."""
    g = torch.Generator().manual_seed(3)
    for G, H, d, D in ((3, 9, 16, 40), (2, 2, 7, 12), (1, 4, 33, 20)):
        factor = ov_factor(torch.randn(H, d, D, generator=g, dtype=torch.float64)).to(dtype)
        x = torch.randn(2, 37, G, d, generator=g, dtype=dtype)
        assert torch.equal(head_norms(x, factor), torch.linalg.vector_norm(head_images(x, factor), dim=-1))


def test_the_output_factor_gives_every_head_its_norms_even_where_its_weights_are_rank_deficient():
    torch.manual_seed(2)
    for d, D in ((4, 9), (6, 4)):  # head size below and above the model's width
        w_o = torch.randn(3, d, D, dtype=torch.float64)
        w_o[1, 1:] = 0.0  # head 1 writes along one direction only
        w_o[2] = 0.0  # head 2 writes nothing
        x = torch.randn(2, 5, 3, d, dtype=torch.float64)
        n = head_norms(x, ov_factor(w_o))
        for h in range(3):
            direct = (x[:, :, h] @ w_o[h]).norm(dim=-1)  # [batch, tokens]
            assert torch.allclose(n[:, h], direct, rtol=1e-12, atol=1e-12), (d, D, h)
        assert torch.equal(n[:, 2], torch.zeros(2, 5, dtype=torch.float64))


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


def test_dormant_reads_the_context_norm_against_its_block_and_the_estimated_effect():
    from storylens.looking.sinks import DORMANT_NATS, DORMANT_SHARE, dormant

    norm = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.3]], dtype=torch.float64)
    # block 1: head 4 writes nothing that depends on the story; block 2: head 4's energy 0.09 against a
    # block mean of (3 + 0.09) / 4 = 0.77: 0.117 of an even share, above DORMANT_SHARE (0.05)
    assert DORMANT_SHARE < 0.09 / 0.7725
    assert dormant(norm).tolist() == [[False, False, False, True], [False] * 4]
    small = torch.full((2, 4), DORMANT_NATS / 4, dtype=torch.float64)
    se = torch.full((2, 4), DORMANT_NATS / 4, dtype=torch.float64)
    assert dormant(norm, (small, se))[0, 3]  # |atp| + 2 se = 0.75 DORMANT_NATS: still dormant
    assert not dormant(norm, (small, 2 * se))[0, 3]  # 1.25 DORMANT_NATS: its estimated effect may be real
    assert not dormant(norm, (torch.full((2, 4), float("nan"), dtype=torch.float64), se))[0, 3]
