"""Head scores: hand-worked maps, streaming == stored maps, and the real model."""

import json

import numpy as np
import pytest
import torch

from storylens.core.errors import StorylensError
from storylens.data.names import MainCharacter, find_main_characters, name_vocabulary
from storylens.engine.accumulate import MeanAccumulator
from storylens.engine.encode import length_batches, make_batch
from storylens.engine.masks import Masks
from storylens.looking.detectors import SCORE_COLUMNS
from storylens.model.tokenizer import encode_story, eot_id
from storylens.table.accumulator import HeadScoreAccumulator, name_baseline
from storylens.table.scores import HeadScores, build_table, score_heads

# ---------------------------------------------------------------- hand-worked maps
# Story A: 5 positions, the name at position 2 (first mention 2), so the name queries
# are q = 3 and q = 4. Story B: 3 positions, no main character, padded to 5.

A_HEAD1 = [
    [1.0, 0, 0, 0, 0],
    [0.5, 0.5, 0, 0, 0],
    [0.2, 0.3, 0.5, 0, 0],
    [0.1, 0.2, 0.3, 0.4, 0],
    [0.1, 0.1, 0.4, 0.2, 0.2],
]
B_HEAD1 = [
    [1.0, 0, 0, 0, 0],
    [0.25, 0.75, 0, 0, 0],
    [0.6, 0.1, 0.3, 0, 0],
    [0.2, 0.2, 0.2, 0.2, 0.2],  # padding queries: must be ignored
    [0.2, 0.2, 0.2, 0.2, 0.2],
]
from argmax_ties import argmax_allowance

from storylens.lesson.checks import probability_bound, row_sum_bound
from storylens.model.gpt import GPTConfig as _Cfg

F32_TOL = probability_bound(_Cfg(), torch.float32)  # derived in storylens.lesson.checks


def prev_only(T):
    """Every query q >= 1 puts all its attention on q - 1."""
    m = torch.zeros(T, T)
    m[0, 0] = 1
    m[torch.arange(1, T), torch.arange(0, T - 1)] = 1
    return m


# Worked by hand from the matrices above (head 1), and for head 2 = prev_only:
#   A head 1: name mass (0.3 + 0.4)/2 = 0.35; baseline (1/4 + 1/5)/2 = 0.225;
#             prev (0.5+0.3+0.3+0.2)/4 = 0.325; argmax: only q=1 (tie 0.5/0.5 -> key 0 = q-1)
#             so 1/4; prev4 (0.5 + 0.5 + 0.6 + 0.8)/4 = 0.6; marker (0.5+0.2+0.1+0.1)/4 = 0.225
#   B head 1: prev (0.25+0.1)/2 = 0.175; argmax 0; prev4 (0.25 + 0.7)/2 = 0.475;
#             marker (0.25+0.6)/2 = 0.425
#   A head 2: name mass (1 + 0)/2 = 0.5; prev 1; argmax 1; prev4 1; marker 1/4
#   B head 2: prev 1; argmax 1; prev4 1; marker 1/2
A_MAIN = MainCharacter(name="Ann", mentions=2, spans=((0, 3),), positions=(2,), first_mention=2)


def hand_batch(in_first=(True, True)):
    return make_batch([[0, 5, 6, 7, 8], [0, 9, 10]], [A_MAIN, None], list(in_first), marker_id=0)


def hand_attentions():
    h1 = torch.tensor([A_HEAD1, B_HEAD1])  # [B, q, k]
    h2 = torch.stack([prev_only(5), prev_only(5)])
    layer0 = torch.stack([h1, h2], dim=1)  # [B, H, q, k]
    layer1 = torch.stack([h2, h1], dim=1)  # heads swapped, to check the indexing
    return [layer0, layer1]


def test_batch_masks():
    b = hand_batch()
    assert b.lengths.tolist() == [5, 3]
    assert b.ids[1].tolist() == [0, 9, 10, 0, 0]
    assert b.name_mask.tolist() == [[False, False, True, False, False], [False] * 5]
    assert b.first_mention.tolist() == [2, -1]
    assert b.marker_mask.tolist() == [[True, False, False, False, False], [True, False, False, False, False]]


def story_scores(attentions, batch):
    """Per-story means ``[story, block, head]`` of every detector, and which stories count."""
    from types import SimpleNamespace

    out = HeadScoreAccumulator(len(attentions), attentions[0].shape[1]).update(attentions, batch)
    m = Masks(batch, attentions[0].dtype)
    return SimpleNamespace(
        **out,
        has_name_queries=m.name_queries.any(-1),
        has_queries=m.queries.any(-1),
        name_baseline=name_baseline(batch, m.name_queries),
    )


def test_story_scores_by_hand():
    s = story_scores(hand_attentions(), hand_batch())
    assert s.has_name_queries.tolist() == [True, False]
    assert s.has_queries.tolist() == [True, True]
    assert s.name_baseline[0].item() == pytest.approx(0.225)
    # [story, block, head]; block 1 has the heads swapped
    assert s.name_mass[0, 0, 0].item() == pytest.approx(0.35)
    assert s.name_mass[0, 0, 1].item() == pytest.approx(0.5)
    assert s.name_mass[0, 1, 1].item() == pytest.approx(0.35)
    assert s.prev_token[:, 0, 0].tolist() == pytest.approx([0.325, 0.175])
    assert s.prev_argmax[:, 0, 0].tolist() == pytest.approx([0.25, 0.0])
    assert s.prev4[:, 0, 0].tolist() == pytest.approx([0.6, 0.475])
    assert s.marker[:, 0, 0].tolist() == pytest.approx([0.225, 0.425])
    for name in ("prev_token", "prev_argmax", "prev4"):
        assert getattr(s, name)[:, 0, 1].tolist() == pytest.approx([1.0, 1.0])
    assert s.marker[:, 0, 1].tolist() == pytest.approx([0.25, 0.5])
    assert s.prev_token[:, 1, 1].tolist() == pytest.approx([0.325, 0.175])


def test_accumulated_table_by_hand():
    acc = HeadScoreAccumulator(2, 2)
    acc.update(hand_attentions(), hand_batch(in_first=(False, True)))
    rows = {h.label: h for h in build_table(acc, with_first=True)}
    assert list(rows) == ["L1H1", "L1H2", "L2H1", "L2H2"]
    h = rows["L1H1"]
    assert (h.block, h.head) == (1, 1)
    assert h.name_mass == pytest.approx(0.35)  # story B has no main character: skipped
    assert h.name_baseline == pytest.approx(0.225)
    assert h.name_ratio == pytest.approx(0.35 / 0.225)
    assert h.prev_token == pytest.approx((0.325 + 0.175) / 2)
    assert h.prev_argmax == pytest.approx(0.125)
    assert h.prev4 == pytest.approx((0.6 + 0.475) / 2)
    assert h.marker == pytest.approx((0.225 + 0.425) / 2)
    assert h.prev_token_first == pytest.approx(0.175)  # only story B is "first"
    assert h.prev4_first == pytest.approx(0.475)
    assert rows["L1H2"].marker == pytest.approx((0.25 + 0.5) / 2)
    assert rows["L1H2"].name_ratio == pytest.approx(0.5 / 0.225)
    assert rows["L2H2"].prev_token == pytest.approx(h.prev_token)
    assert acc.means["name_mass"].count == 1 and acc.means["prev_token"].count == 2
    assert acc.first["prev_token"].count == 1


def test_one_padded_batch_equals_two_unpadded_batches():
    one = HeadScoreAccumulator(2, 2)
    one.update(hand_attentions(), hand_batch())
    two = HeadScoreAccumulator(2, 2)
    atts = hand_attentions()
    for b, ids, mc in ((0, [0, 5, 6, 7, 8], A_MAIN), (1, [0, 9, 10], None)):
        T = len(ids)
        two.update([a[b : b + 1, :, :T, :T] for a in atts], make_batch([ids], [mc], [True], 0))
    theirs = two.columns(True)
    for k, v in one.columns(True).items():
        if v is None:  # whole maps with no output vectors: the context columns are not computed, in either
            assert theirs[k] is None, k
            continue
        assert torch.allclose(v, theirs[k], atol=1e-12, equal_nan=True), k  # no repeats here: NaN


def test_mean_accumulator():
    acc = MeanAccumulator((2,))
    assert torch.isnan(acc.mean()).all()
    acc.add(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([True, False]))
    acc.add(torch.tensor([[5.0, 6.0]]))
    assert acc.count == 2 and acc.mean().tolist() == [3.0, 4.0]


def test_length_batches_longest_first():
    assert length_batches([3, 9, 5, 9, 1], 2) == [[1, 3], [2, 0], [4]]


def test_length_batches_by_a_token_budget():
    # at most 20 padded tokens: the two 9s pad to 18; 5 + 3 + 1 pad to 15; a story over the budget goes alone
    assert length_batches([3, 9, 5, 9, 1], 16, 20) == [[1, 3], [2, 0, 4]]
    assert length_batches([30, 2, 2], 16, 20) == [[0], [1, 2]]
    assert length_batches([4] * 7, 3, 100) == [[0, 1, 2], [3, 4, 5], [6]]  # the story count still caps
    with pytest.raises(StorylensError, match="max_tokens: must be at least 1"):
        length_batches([3], 2, 0)


# ---------------------------------------------------------------- the table


def fake_scores(with_first=True):
    acc = HeadScoreAccumulator(2, 2)
    acc.update(hand_attentions(), hand_batch())
    return HeadScores(
        heads=build_table(acc, with_first),
        n_stories=2,
        n_cut=0,
        n_main_character=1,
        n_name_scored=1,
        max_stories_prev=2 if with_first else None,
        n_prev_first=2 if with_first else None,
        window=5,
    )


def test_table_helpers(tmp_path):
    hs = fake_scores()
    assert hs.best("name_mass").label in ("L1H2", "L2H1")  # the prev-only heads: 0.5
    assert [h.label for h in hs.top("name_mass", 2)] == ["L1H2", "L2H1"]  # ties: block-major
    assert hs.best("prev_token", largest=False).label == "L1H1"
    assert hs.count("prev_token", above=0.5) == 2
    assert hs.count("name_ratio", below=1) == 0
    assert hs.head("l2h1").prev_token == pytest.approx(1.0)
    assert hs.grid("prev_token")[0][1] == pytest.approx(1.0)
    assert hs.name_baseline == pytest.approx(0.225)
    rows = hs.to_rows()
    assert [r["label"] for r in rows] == ["L1H1", "L1H2", "L2H1", "L2H2"]
    assert list(rows[0])[:3] == ["label", "block", "head"] and set(SCORE_COLUMNS) <= set(rows[0])
    with pytest.raises(KeyError):
        hs.column("nope")
    with pytest.raises(KeyError):
        hs.head("L9H9")


def test_table_files_round_trip(tmp_path):
    hs = fake_scores(with_first=False)
    assert hs.to_rows()[0]["prev_token_first"] is None
    with pytest.raises(ValueError):
        hs.top("prev4_first")
    back = HeadScores.from_json(hs.to_json(tmp_path / "scores.json"))
    assert back == hs
    doc = json.loads((tmp_path / "scores.json").read_text())
    assert doc["counts"]["n_name_scored"] == 1 and len(doc["heads"]) == 4
    lines = hs.to_csv(tmp_path / "scores.csv").read_text().splitlines()
    assert lines[0].startswith("label,block,head,name_mass") and len(lines) == 5
    with pytest.raises(StorylensError, match="scores.csv: not JSON"):
        HeadScores.from_json(tmp_path / "scores.csv")
    with pytest.raises(StorylensError, match="cannot write"):
        hs.to_csv(tmp_path / "no" / "such" / "dir.csv")


def test_built_in_and_user_detectors_are_one_kind(tmp_path):
    """A user detector's column sits with the built-ins' (its norm-weighted twin with theirs), reads
    like them (``row.opening``, ``row["opening"]``) and is shown where a detector past the lesson's
    is; every column's title, meaning and place come from the detectors, read back from a file too."""
    from types import SimpleNamespace

    from storylens.looking.detectors import BUILTIN_DETECTORS, LESSON, MORE, OVERVIEW, TRUTH, pattern_detector
    from storylens.table.scores import score_table

    def opening(ids):  # every query on the marker at position 0: the first_mass detector's keys
        w = torch.zeros(ids.shape[0], ids.shape[1], ids.shape[1])
        w[:, 1:, 0] = 1
        return w

    acc = HeadScoreAccumulator(2, 2, BUILTIN_DETECTORS + (pattern_detector("opening", opening),))
    acc.update(hand_attentions(), hand_batch())
    hs = score_table(acc, SimpleNamespace(n_stories=2, n_cut=0, n_main_character=1), None, 5)
    names = list(hs.to_rows()[0])
    assert names.index("first_mass") + 1 == names.index("opening") < names.index("norm_name_mass")
    assert names.index("norm_first_mass") + 1 == names.index("norm_opening") < names.index("output_norm")
    assert names[-1] == "dormant"
    for h in hs.heads:
        assert h.opening == h["opening"] == h["first_mass"] == h.first_mass
    assert hs.column("opening") == hs.column("first_mass")
    assert hs.shown(MORE) == ("duplicate_token", "induction", "first_mass", "opening", "induction_random")
    assert hs.shown(LESSON) == ("name_mass", "name_ratio", "prev_token", "prev_argmax", "prev4", "marker")
    assert "opening" in hs.shown(TRUTH) and "first_mass" not in hs.shown(TRUTH)
    assert hs.shown(OVERVIEW)[-15:] == (
        "norm_first_mass", "norm_opening", "induction_random", "ov_copying", "qk_same_token", "qk_previous",
        "output_share", "context_share", "atp_mean", "atp_zero", "dla", "exact_mean", "exact_zero", "exact_resample",
        "backup_gain",
    )  # fmt: skip
    assert hs.title("norm_marker", "the opening token (BOS)") == "Norm-weighted: attention on the opening token (BOS)"
    assert hs.title("opening").startswith("Detector opening")
    back = HeadScores.from_json(hs.to_json(tmp_path / "heads.json"))
    assert back == hs and back.columns == hs.columns
    with pytest.raises(AttributeError, match="no column 'nope'"):
        getattr(hs.heads[0], "nope")  # noqa: B009


# ---------------------------------------------------------------- real model


def reference_scores(model, stories, names):
    """The definitions computed the slow way: one story at a time, its full maps kept."""
    tok = model.tokenizer
    W = model.config.block_size
    mains = find_main_characters(tok, stories, names=names, window=W)
    L, H = model.config.n_layer, model.config.n_head
    per = {k: [] for k in ("name", "base", "prev", "argmax", "prev4", "marker")}
    for story, mc in zip(stories, mains):
        ids = encode_story(tok, story, W).ids
        with torch.no_grad():
            maps = np.stack([a[0].double().numpy() for a in model(torch.tensor([ids]), record_attention=True).patterns])
        T = len(ids)
        s = {k: np.zeros((L, H)) for k in ("prev", "argmax", "prev4", "marker", "name")}
        for q in range(1, T):
            row = maps[:, :, q, :]  # [L, H, key]
            s["prev"] += row[..., q - 1]
            s["argmax"] += row.argmax(-1) == q - 1
            s["prev4"] += row[..., max(0, q - 4) : q].sum(-1)
            s["marker"] += row[..., 0]
        for k in ("prev", "argmax", "prev4", "marker"):
            per[k].append(s[k] / (T - 1))
        if mc is None or mc.first_mention is None:
            continue
        name = set(mc.positions)
        qs = [q for q in range(mc.first_mention + 1, T) if q not in name]
        if not qs:
            continue
        mass = sum(maps[:, :, q, [k for k in name if k <= q]].sum(-1) for q in qs) / len(qs)
        base = sum(len([k for k in name if k <= q]) / (q + 1) for q in qs) / len(qs)
        per["name"].append(mass)
        per["base"].append(base)
    return {k: np.mean(v, axis=0) for k, v in per.items()}, len(per["name"])


@pytest.fixture(scope="module")
def five_stories(shipped_model, corpus_split):
    """Four quiz stories with a main character, and one cut to the window."""
    tok, quiz = shipped_model.tokenizer, corpus_split.quiz
    names = name_vocabulary(quiz)
    mains = find_main_characters(tok, quiz, names=names)
    cut = [s for s in quiz if encode_story(tok, s).cut][:1]
    with_main = [s for s, m in zip(quiz, mains) if m is not None and s not in cut][:4]
    return with_main + cut, names


def test_streaming_equals_stored_maps_reference(shipped_model, five_stories):
    stories, names = five_stories
    ref, n_named = reference_scores(shipped_model, stories, names)
    hs = score_heads(shipped_model, stories, batch_size=2, names=names, progress=False)
    assert hs.n_stories == 5 and hs.n_cut >= 1 and hs.n_name_scored == n_named >= 4

    def grid(c):
        return np.array(hs.grid(c))

    for col, key in (("name_mass", "name"), ("prev_token", "prev"), ("prev4", "prev4"), ("marker", "marker")):
        # float32 rounding of two equal computations (storylens.lesson.checks)
        np.testing.assert_allclose(grid(col), ref[key], atol=F32_TOL, rtol=0, err_msg=col)
    # an argmax may flip only on a near-tie (within the same rounding): at most that share of queries
    ids = [encode_story(shipped_model.tokenizer, s, shipped_model.config.block_size).ids for s in stories]
    allowed = argmax_allowance(shipped_model, ids, F32_TOL)
    assert (np.abs(grid("prev_argmax") - ref["argmax"]) <= allowed).all()
    assert hs.name_baseline == pytest.approx(ref["base"], abs=1e-12)


def test_real_model_sanity(shipped_model, corpus_split):
    stories = corpus_split.quiz[:8]
    tok, W = shipped_model.tokenizer, shipped_model.config.block_size
    idx = [encode_story(tok, s, W).ids for s in stories[:3]]
    T = max(map(len, idx))
    batch = torch.tensor([x + [0] * (T - len(x)) for x in idx])
    with torch.inference_mode():
        maps = shipped_model(batch, record_attention=True).patterns
    assert len(maps) == shipped_model.config.n_layer
    for a in maps:
        assert a.shape == (3, shipped_model.config.n_head, T, T)
        assert (a.sum(-1) - 1).abs().max().item() <= row_sum_bound(torch.float32, T)  # every row sums to 1
        assert (a.triu(1) == 0).all()  # the causal mask

    hs = score_heads(shipped_model, stories, batch_size=3, max_stories_prev=4, progress=False)
    assert len(hs.heads) == 24 and hs.heads[-1].label == "L6H4"
    assert hs.n_stories == 8 and hs.n_prev_first == 4
    assert 0 <= hs.n_name_scored <= hs.n_main_character <= 8
    for h in hs.heads:
        for col in ("prev_token", "prev_argmax", "prev4", "marker", "prev_token_first"):
            assert 0 <= getattr(h, col) <= 1, (h.label, col)
        assert h.prev_token <= h.prev4 + 1e-12
        assert h.name_baseline == hs.name_baseline
        if hs.n_name_scored:
            assert 0 <= h.name_mass <= 1
            assert h.name_ratio == pytest.approx(h.name_mass / h.name_baseline)
    # the first-4 columns are the same scores on the first 4 stories alone
    first = score_heads(shipped_model, stories[:4], batch_size=4, progress=False)
    for col in ("prev_token", "prev4"):
        np.testing.assert_allclose(hs.column(col + "_first"), first.column(col), atol=F32_TOL)
    first_ids = [encode_story(tok, s, W).ids for s in stories[:4]]
    allowed = argmax_allowance(shipped_model, first_ids, F32_TOL).reshape(-1)  # heads in L1H1 .. L6H4 order
    assert (np.abs(np.array(hs.column("prev_argmax_first")) - first.column("prev_argmax")) <= allowed).all()


def test_batch_size_does_not_change_scores(shipped_model, corpus_split):
    stories = corpus_split.quiz[10:16]
    names = name_vocabulary(corpus_split.quiz)
    a = score_heads(shipped_model, stories, batch_size=1, names=names, progress=False)
    b = score_heads(shipped_model, stories, batch_size=6, names=names, progress=False)
    for col in ("name_mass", "prev_token", "prev4", "marker"):
        np.testing.assert_allclose(a.column(col), b.column(col), atol=F32_TOL)


def test_bad_arguments(shipped_model):
    with pytest.raises(StorylensError, match="stories"):
        score_heads(shipped_model, [], progress=False)
    with pytest.raises(StorylensError, match="max_stories_prev"):
        score_heads(shipped_model, ["Tim ran."], max_stories_prev=0, progress=False)
    with pytest.raises(StorylensError, match="batch_size"):
        score_heads(shipped_model, ["Tim ran."], batch_size=0, progress=False)


# ---------------------------------------------------------------- fast paths, checked against the plain ones


def test_prev_is_argmax_equals_argmax_and_leaves_the_map_as_it_was(shipped_model, quiz_ids):
    from storylens.looking.patterns import prev_is_argmax

    ids = torch.tensor([quiz_ids[0]])
    with torch.no_grad():
        maps = shipped_model(ids, record_attention=True).patterns
    T = ids.shape[1]
    prev_key = torch.arange(T) - 1
    for att in maps:
        before = att.clone()
        fast = prev_is_argmax(att)
        assert torch.equal(att, before)  # written back bit for bit
        assert torch.equal(fast, (att.argmax(-1) == prev_key).to(att.dtype))
    # ties: argmax takes the earliest key, so key q-1 loses a tie with an earlier key and wins
    # a tie with the query's own key (q); zeros after q never win
    tie = torch.tensor(
        [
            [
                [
                    [1.0, 0, 0, 0],
                    [0.5, 0.5, 0, 0],
                    [0.4, 0.4, 0.2, 0],  # q=2: keys 0 and 1 tie -> argmax 0
                    [0.1, 0.2, 0.35, 0.35],
                ]
            ]
        ]
    )  # q=3: keys 2 and 3 tie -> argmax 2 = q-1
    expected = (tie.argmax(-1) == torch.arange(4) - 1).to(tie.dtype)
    assert torch.equal(prev_is_argmax(tie), expected)
    assert expected.flatten().tolist() == [0.0, 1.0, 0.0, 1.0]


def test_block_by_block_scoring_equals_scoring_the_stored_maps(shipped_model, corpus_split):
    """score_heads (maps fed by the hooks, stories in chunks) against every map of a batch at
    once through HeadScoreAccumulator.update, and against a different chunking."""
    from storylens.lesson.checks import probability_bound

    stories = corpus_split.quiz[:40]
    tok, W = shipped_model.tokenizer, shipped_model.config.block_size
    names = name_vocabulary(stories)
    hooked = score_heads(shipped_model, stories, names=names, batch_size=8, max_stories_prev=10, progress=False)
    chunked = score_heads(
        shipped_model, stories, names=names, batch_size=8, max_stories_prev=10, progress=False, chunk_stories=7
    )
    mains = find_main_characters(tok, stories, names=names, window=W)
    ids = [encode_story(tok, s, W).ids for s in stories]
    acc = HeadScoreAccumulator(6, 4)
    with torch.no_grad():
        for idx in length_batches([len(x) for x in ids], 8):
            batch = make_batch([ids[i] for i in idx], [mains[i] for i in idx], [i < 10 for i in idx], eot_id(tok))
            acc.update(shipped_model(batch.ids, record_attention=True).patterns, batch)
    stored = build_table(acc, True)
    # the same batches: the same numbers; other batches (other padding): within rounding
    bound = probability_bound(shipped_model.config, torch.float32)
    for a, b, c in zip(hooked.heads, stored, chunked.heads):
        for col in SCORE_COLUMNS:
            assert getattr(a, col) == pytest.approx(getattr(b, col), abs=1e-12), (a.label, col)
            scale = 1 / a.name_baseline if col == "name_ratio" else 1  # a ratio of means: the mass's error / baseline
            assert abs(getattr(a, col) - getattr(c, col)) <= bound * scale, (a.label, col)
    assert hooked.counts() == chunked.counts()
    assert not any(p._forward_hooks for p in shipped_model.hook_points().values())  # hooks removed
