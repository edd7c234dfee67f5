"""Head detectors as pure functions, by hand; merging accumulators; one recording pass for many measures."""

import pytest
import torch

from storylens.core.errors import StorylensError
from storylens.data.names import MainCharacter
from storylens.engine.encode import make_batch
from storylens.engine.masks import Masks
from storylens.engine.record import record
from storylens.lesson.checks import unit_roundoff
from storylens.lm import NativeLM
from storylens.looking.detectors import BUILTIN_DETECTORS, DUPLICATE_TOKEN, FIRST_MASS, INDUCTION, pattern_detector
from storylens.looking.reads import Reads
from storylens.table.accumulator import HeadScoreAccumulator
from storylens.table.scores import build_table, score_heads

# one story, ids 0 5 6 5 6: the second 5 (q=3) repeats position 1, the second 6 (q=4) position 2
IDS = [0, 5, 6, 5, 6]
HEAD1 = torch.tensor(
    [
        [1.0, 0, 0, 0, 0],
        [0.5, 0.5, 0, 0, 0],
        [0.2, 0.3, 0.5, 0, 0],
        [0.1, 0.2, 0.3, 0.4, 0],
        [0.1, 0.1, 0.4, 0.2, 0.2],
    ]
)
PREV = torch.eye(5).roll(-1, 1).tril()  # q -> q - 1 (and q = 0 -> 0)
PREV[0, 0] = 1


def batch():
    return make_batch([IDS], [None], [True], marker_id=0)


def att():
    return torch.stack([HEAD1, PREV])[None]  # [1, 2 heads, q, k]


def test_duplicate_and_induction_by_hand():
    m = Masks(batch(), torch.float32)
    # duplicate: q=3 -> key 1 (0.2), q=4 -> key 2 (0.4): mean 0.3; the previous-token head: 0
    assert DUPLICATE_TOKEN.story_means(att(), m)[0].tolist() == pytest.approx([0.3, 0.0])
    # induction: the token after the earlier copy: q=3 -> key 2 (0.3), q=4 -> key 3 (0.2): 0.25;
    # here that is exactly the previous token, so the previous-token head scores 1
    assert INDUCTION.story_means(att(), m)[0].tolist() == pytest.approx([0.25, 1.0])
    assert DUPLICATE_TOKEN.queries(m).tolist() == [[False, False, False, True, True]]


def test_first_mass_is_the_attention_on_position_0():
    """first_mass: attention on key 0 (the opening token), over queries q >= 1 inside each story, the
    same on whole maps and on chunks of rows; a column of the head table with its norm-weighted twin."""
    m = Masks(batch(), torch.float32)
    assert FIRST_MASS.story_means(att(), m)[0].tolist() == pytest.approx([(0.5 + 0.2 + 0.1 + 0.1) / 4, 0.25])
    g = torch.Generator().manual_seed(3)
    lengths = [9, 4, 1]
    ids = [torch.randint(1, 20, (n,), generator=g).tolist() for n in lengths]
    b = make_batch(ids, [None] * 3, [True] * 3, marker_id=0)
    T = max(lengths)
    logits = torch.randn(3, 2, T, T, generator=g).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    probs = logits.double().softmax(-1)  # [batch, head, query, key], float64: only a sum's order differs
    masks = Masks(b, torch.float64)
    want = torch.stack(
        [probs[i, :, 1:n, 0].mean(-1) if n > 1 else torch.zeros(2, dtype=torch.float64) for i, n in enumerate(lengths)]
    )
    # a mean of at most 8 numbers in [0, 1], summed in another order: within 8 u = 9e-16 of each other
    assert torch.allclose(FIRST_MASS.story_means(probs, masks), want, rtol=0, atol=1e-13)
    assert FIRST_MASS.queries(masks).sum(-1).tolist() == [n - 1 for n in lengths]
    for start, stop in [(0, 4), (4, 7), (7, 9)]:  # chunks of rows: the same values, row for row
        rows = masks.rows(start, stop, stop)
        got = FIRST_MASS.values(probs[:, :, start:stop, :stop], rows)
        assert torch.equal(got, probs[:, :, start:stop, 0])
    acc = HeadScoreAccumulator(1, 2)
    acc.update([probs], b)
    row = build_table(acc, with_first=False)[0]
    # the third story: no query; two float64 means of means, each within 1e-15 of the exact one
    assert row.first_mass == pytest.approx(want[:2, 0].mean().item(), rel=0, abs=1e-13)
    names = list(row.row())
    assert names.index("first_mass") < names.index("norm_name_mass") < names.index("norm_first_mass")


def test_a_user_pattern():
    def first_key(ids):  # every query looks at the marker
        w = torch.zeros(ids.shape[0], ids.shape[1], ids.shape[1])
        w[:, 1:, 0] = 1
        return w

    d = pattern_detector("opening", first_key)
    m = Masks(batch(), torch.float32)
    assert d.story_means(att(), m)[0].tolist() == pytest.approx([(0.5 + 0.2 + 0.1 + 0.1) / 4, 0.25])
    with pytest.raises(ValueError):
        pattern_detector("not a name", first_key)
    bad = pattern_detector("bad", lambda ids: torch.zeros(3))
    with pytest.raises(
        StorylensError,
        match=r"^detector bad: pattern\(ids\) returned weights of shape \(3,\); "
        r"expected \(1, 5, 5\) \(\[batch, query, key\]\)$",
    ):
        bad.story_means(att(), m)


def test_merged_accumulators_equal_one(shipped_model, corpus_split):
    lm = NativeLM(shipped_model)
    stories = corpus_split.quiz[:24]
    whole = HeadScoreAccumulator(lm.n_layer, lm.n_head)
    record(lm, stories, [whole], batch_size=8, progress=False)
    parts = []
    from storylens.data.names import name_vocabulary

    names = name_vocabulary(stories)  # the vocabulary of the whole run, as one pass would use
    for chunk in (stories[:10], stories[10:17], stories[17:]):
        acc = HeadScoreAccumulator(lm.n_layer, lm.n_head)
        record(lm, chunk, [acc], batch_size=8, names=names, progress=False)
        parts.append(acc)
    merged = parts[2].merge(parts[0]).merge(parts[1])  # any order
    a, b = build_table(whole, False), build_table(merged, False)
    # other batches (other padding): float32 rounding of the maps, nothing more
    from storylens.lesson.checks import probability_bound

    bound = probability_bound(shipped_model.config, torch.float32)
    for x, y in zip(a, b):
        for col in ("name_mass", "prev_token", "prev_argmax", "marker", "duplicate_token", "induction"):
            assert abs(getattr(x, col) - getattr(y, col)) <= bound, (x.label, col)


def test_one_recording_pass_feeds_every_measure(shipped_model, corpus_split):
    from storylens.looking.position import PositionControlAccumulator, position_control_scores
    from storylens.looking.pronouns import PronounAccumulator, pronoun_attention

    stories = corpus_split.quiz[:12]
    calls = []
    handle = shipped_model.register_forward_pre_hook(lambda m, a, kw: calls.append(a[0].shape[0]), with_kwargs=True)
    pos, pron = PositionControlAccumulator(6, 4), PronounAccumulator(6, 4)
    try:
        scores = score_heads(shipped_model, stories, batch_size=4, measures=[pos, pron], progress=False)
    finally:
        handle.remove()
    from storylens.looking.detectors import INDUCTION_SEQUENCES

    # one forward pass per batch, then the induction test's one pass on its random sequences, nothing else
    assert calls == [4, 4, 4, INDUCTION_SEQUENCES]
    alone_pos = position_control_scores(shipped_model, stories, batch_size=4)
    alone_pron = pronoun_attention(shipped_model, stories, batch_size=4)
    assert torch.allclose(pos.result().name_mass, alone_pos.name_mass, atol=1e-12)
    assert torch.allclose(pos.result().control, alone_pos.control, atol=1e-12)
    assert torch.allclose(pron.result().pronoun_mass, alone_pron.pronoun_mass, atol=1e-12)
    # the position control's name mass is the lesson's name mass, from the same maps
    # the scores sum each query's mass over <= 256 keys and average <= 256 queries in float32 (each sum
    # off by at most n * u of a total <= 1), the position control in float64: worst case 2 * 256 * u
    got = torch.tensor(scores.column("name_mass")).view(6, 4)
    tol = 2 * shipped_model.config.block_size * unit_roundoff(torch.float32)
    assert torch.allclose(got.double(), pos.result().name_mass, atol=tol, rtol=0)
    assert [d.name for d in BUILTIN_DETECTORS] == [
        "name_mass",
        "prev_token",
        "prev_argmax",
        "prev4",
        "marker",
        "duplicate_token",
        "induction",
        "first_mass",
    ]


def test_duplicate_index_equals_the_dense_key_sets():
    """The sorted-token construction of each query's earlier duplicates equals the dense definition
    (``ids[k] == ids[q]``, ``k < q``, both inside the story), position for position, latest first."""
    import torch

    from storylens.engine.masks import duplicate_index

    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        B, T = 3, int(torch.randint(1, 60, (1,), generator=g))
        ids = torch.randint(0, 6, (B, T), generator=g)
        inside = torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
        dense = (ids[:, :, None] == ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril(-1)
        dense &= inside[:, :, None] & inside[:, None, :]
        index, real = duplicate_index(ids, inside)
        assert index.shape[-1] == max(int(dense.sum(-1).max()), 1)
        for b in range(B):
            for q in range(T):
                want = sorted(torch.nonzero(dense[b, q]).flatten().tolist(), reverse=True)
                assert index[b, q][real[b, q]].tolist() == want


def test_the_pairs_of_a_key_set_give_its_dense_mass_on_whole_maps_and_chunks():
    """Duplicate and induction masses from the (query, key) pairs equal the dense definition
    (``keys_mass`` over ``duplicate_keys`` / ``induction_keys``) for stories of different lengths
    in one batch, on the whole map and on every chunk of rows a streamed block hands over."""
    from storylens.looking.patterns import keys_mass, pairs_mass

    g = torch.Generator().manual_seed(3)
    lengths = [23, 9, 17, 1]
    ids = [[0] + torch.randint(1, 5, (n - 1,), generator=g).tolist() for n in lengths]
    b = make_batch(ids, [None] * len(ids), [True] * len(ids), marker_id=0)
    T, H = max(lengths), 3
    pattern = torch.rand(len(ids), H, T, T, generator=g, dtype=torch.float64).tril()
    m = Masks(b, torch.float64)
    # each mass sums at most T - 1 weights in [0, 1], in a different order on each side: each sum is
    # within (T - 2) u (T - 1) of the exact one (u = 2^-53), so the two within twice that (1.0e-13);
    # a factor 2 of margin on top
    bound = 2 * (2 * (T - 2) * (T - 1) * 2.0**-53)
    for name in ("duplicate_keys", "induction_keys"):
        dense = keys_mass(pattern, getattr(m, name))
        queries, keys = m.key_pairs(name)
        assert int((queries < T).sum()) == int(getattr(m, name).sum())  # one pair per key in the set
        assert torch.allclose(pairs_mass(pattern, queries, keys), dense, rtol=0, atol=bound)
        for start, stop in ((0, 5), (5, 6), (6, 19), (19, T)):
            rows = m.rows(start, stop, stop)
            got = pairs_mass(pattern[:, :, start:stop, :stop].contiguous(), *rows.key_pairs(name), start)
            assert torch.allclose(got, dense[..., start:stop], rtol=0, atol=bound), (name, start)


def test_one_mask_type_for_batches_and_rows_sharing_what_it_makes():
    """A chunk's masks are the batch's cut to its rows and keys; every view of a batch shares what
    is made once (``cached``), and masses formed elsewhere (``with_mass``) stand for that map only."""
    m = Masks(batch(), torch.float32)
    rows = m.rows(2, 4, 4)
    assert rows.full is m and m.rows(0, 5, 5) is m and (rows.start, rows.stop, rows.keys) == (2, 4, 4)
    assert torch.equal(rows.queries, m.queries[:, 2:4]) and rows.key_columns.shape[-2] == 4
    made: list[int] = []
    first = rows.cached("k", lambda: made.append(1) or torch.ones(1))
    assert m.cached("k", lambda: made.append(2) or torch.zeros(1)) is first and made == [1]
    p = att()[:, :, 2:4, :4]
    formed = torch.rand(1, 2, 2, 2)
    given = rows.with_mass(p, formed)
    assert given.column_mass(p) is formed  # the kernel's masses, not made again
    assert torch.allclose(given.column_mass(p.clone()), rows.column_mass(p))  # another map: made from it
    assert torch.allclose(rows.column_mass(p), m.column_mass(att())[:, :, 2:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_detector_on_the_scaled_map_without_forming_it_gives_its_bits(dtype):
    """``Detector.scaled(p, w, masks)`` equals ``values(p * w[key], masks)`` bit for bit, on the whole
    map and on every chunk of rows: random softmax rows (every previous-token argmax case: rows where
    the bounds decide and rows scaled in full), sharp rows, ties made on purpose, zero and equal key
    norms, stories of different lengths in one batch (padding past each story's end)."""
    from storylens.looking.patterns import scaled

    g = torch.Generator().manual_seed(5)
    lengths = [31, 12, 25]
    ids = [[0] + torch.randint(0, 6, (n - 1,), generator=g).tolist() for n in lengths]  # markers inside too
    mains = [MainCharacter("A", 2, (), (4, 5, 17), 4), None, MainCharacter("B", 1, (), (2,), 2)]
    b = make_batch(ids, mains, [True] * len(ids), marker_id=0)
    T, H = max(lengths), 4
    logits = (
        torch.randn(len(ids), H, T, T, generator=g, dtype=dtype)
        * torch.tensor([0.3, 1.0, 4.0, 12.0], dtype=dtype)[:, None, None]
    )
    p = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    p[:, 0, 9, :9] = p[:, 0, 9, 8:9]  # a tie of key q - 1 with every earlier key
    w = torch.rand(len(ids), H, T, generator=g, dtype=dtype) * 3
    w[:, 1] = 1.5  # one norm for every key: the scaled rows are the raw rows times a constant
    w[:, 2, ::4] = 0  # keys that move nothing
    m = Masks(b, dtype)
    for d in BUILTIN_DETECTORS:
        assert d.scaled is not None, d.name
        for start, stop in ((0, T), (0, 1), (1, 7), (7, 20), (20, T)):
            rows = m.rows(start, stop, stop)
            pc, wc = p[:, :, start:stop, :stop].contiguous(), w[..., :stop]
            want = d.values(scaled(pc, wc), rows)
            got = d.scaled(pc.clone(), wc, rows)
            assert torch.equal(got, want), (d.name, start)
            assert d.read is not None, d.name  # and from the reads every built-in detector shares
            reads = Reads(pc, rows)
            assert torch.equal(d.read(reads), d.values(pc, rows)), (d.name, start)
            assert torch.equal(d.read(reads.scaled(wc)), want), (d.name, start)
        if d.name == "prev_argmax":  # decided as the reads are held (the map then gone), with the read
            for start, stop in ((0, T), (0, 1), (1, 7), (7, 20), (20, T)):  # weights as bounds too
                rows = m.rows(start, stop, stop)
                pc, wc = p[:, :, start:stop, :stop].contiguous(), w[..., :stop]
                assert torch.equal(Reads(pc, rows).held(wc).wins, d.values(scaled(pc, wc), rows)), start
