"""TopExamples: the k strongest queries per head and detector, against a brute force over the real
model's maps; merged, resumed and split runs identical; ties; malformed states."""

import copy
import json
from dataclasses import replace

import pytest
import torch

from storylens.core.errors import StorylensError
from storylens.data.names import name_vocabulary
from storylens.engine.encode import EncodedStory, batch_of, encode_stories, length_batches
from storylens.engine.masks import Masks
from storylens.engine.record import Needs, record
from storylens.lm import wrap
from storylens.looking.detectors import BUILTIN_DETECTORS
from storylens.looking.example_select import rounded
from storylens.looking.example_store import WEIGHT_DECIMALS
from storylens.looking.examples import TopExamples

NAMES = [d.name for d in BUILTIN_DETECTORS]
K = 8


# ---------------------------------------------------------------- the real model's maps, recorded once


@pytest.fixture(scope="module")
def recorded(shipped_model, corpus_split):
    """24 quiz stories in batches of 4, longest first (so story indices come out of order), every
    block's map and every built-in detector's per-query values and counted queries."""
    lm = wrap(shipped_model)
    stories = corpus_split.quiz[:24]
    encoded = encode_stories(lm, stories, name_vocabulary(stories))
    batches = []
    with torch.inference_mode():
        for idx in length_batches([len(s.ids) for s in encoded], 4):
            batch = batch_of([encoded[i] for i in idx], lm.marker_id, lm.device)
            patterns = lm.patterns(batch.ids)
            masks = Masks(batch, patterns[0].dtype)
            blocks = []
            for layer, pattern in enumerate(patterns):
                per = {d.name: (d.values(pattern, masks), d.queries(masks)) for d in BUILTIN_DETECTORS}
                masks.__dict__.pop("_column_mass", None)
                blocks.append((layer, pattern, per))
            batches.append((batch, blocks))
    return lm, encoded, batches


def fill(lm, batches, top=None):
    top = top if top is not None else TopExamples(lm.n_layer, lm.n_head, NAMES, k=K)
    for batch, blocks in batches:
        for layer, pattern, per in blocks:
            for name, (values, counted) in per.items():
                top.add(layer, name, values, counted, pattern, batch)
    return top


def test_one_call_per_block_equals_one_call_per_detector(recorded):
    """add_block (every detector of a block in one selection, as the head scores feed it) keeps exactly
    what one add per detector keeps."""
    lm, _, batches = recorded
    per_detector = fill(lm, batches)
    per_block = TopExamples(lm.n_layer, lm.n_head, NAMES, k=K)
    for batch, blocks in batches:
        for layer, pattern, per in blocks:
            per_block.add_block(layer, [(name, v, c) for name, (v, c) in per.items()], pattern, batch)
    assert per_block.state() == per_detector.state()


@pytest.mark.parametrize(("per_story", "k"), [(None, K), (2, K), (1, 3), (2, 5)])
def test_selecting_only_in_rows_a_query_can_enter_keeps_what_every_row_keeps(recorded, monkeypatch, per_story, k):
    """On a CPU each block first finds the queries that can enter (counted, beating their row's worst
    example kept), and either keeps them with their rows of the map, selected among at the flush for
    every block at once (where those rows are few), or selects at once in the rows they are in: the
    same examples, ties and per-story caps included (0/1 detectors tie by the thousand), as selecting
    in every row (what other devices do); with the per-story cap bounding the top k (2 x 4 stories
    <= 8) and not (1 x 4 > 3, 2 x 4 > 5), fed whole and in chunks of rows; a padding query said to
    be counted never enters."""
    import storylens.looking.examples as examples

    lm, _, batches = recorded
    held = []
    take = examples.TopExamples._take_offered
    monkeypatch.setattr(
        examples.TopExamples, "_take_offered", lambda self, group: held.append(len(group)) or take(self, group)
    )
    states = []
    for first, offered in ((False, 0), (True, 0), (True, 2**40), (True, 2**40)):
        monkeypatch.setattr(examples, "ROWS_FIRST", first)
        monkeypatch.setattr(examples, "OFFERED_BYTES", offered)
        held.clear()
        top = TopExamples(lm.n_layer, lm.n_head, NAMES, k=k, per_story=per_story)
        for batch, blocks in batches:
            for layer, pattern, per in blocks:
                padding = torch.arange(pattern.shape[-2]) >= batch.lengths[:, None]  # never offered, though counted
                offers = [(name, v, c.to(torch.bool) | padding) for name, (v, c) in per.items()]
                if len(states) < 3:
                    top.add_block(layer, offers, pattern, batch)
                    continue
                T = pattern.shape[-2]
                for start in (0, T // 3, 2 * T // 3):  # a third of the rows at a time
                    rows = slice(start, T if start == 2 * T // 3 else start + T // 3)
                    part = [(name, v[..., rows], c[:, rows]) for name, v, c in offers]
                    top.add_block(layer, part, pattern[:, :, rows], batch, start=start)
        assert (sum(held) > 0) == (offered > 0)  # the held path ran where it may
        if offered and len(states) == 2:  # blocks held until the flush are selected together
            assert max(held) == lm.n_layer
        states.append(top.state())
    assert states[0] == states[1] == states[2] == states[3]


@pytest.mark.parametrize(("per_story", "k"), [(2, K), (1, 3)])
def test_a_storys_kept_examples_bar_its_later_queries(recorded, monkeypatch, per_story, k):
    """Fed a third of the rows at a time (a long story's chunks), a row that keeps ``per_story`` queries of
    a story takes no later query of that story that does not beat them (``story_worst_kept``): fewer
    queries reach the selection, and the same examples are kept as with that bar lifted and as selecting
    in every row, whether the queries are held for the flush or selected among at once."""
    import storylens.looking.examples as examples

    lm, _, batches = recorded
    offered: list[int] = []
    offer = examples.TopExamples._offer
    monkeypatch.setattr(
        examples.TopExamples, "_offer", lambda self, *a: offered.append(int(a[3].sum())) or offer(self, *a)
    )
    import storylens.looking.example_select as select

    barred = select.story_worst_kept

    def lifted(floats, ints, rows, stories, per, dtype):  # no story bars a query
        low, later = barred(floats, ints, rows, stories, per, dtype)
        return torch.full_like(low, -torch.inf), torch.full_like(later, -1)

    states, counts = [], []
    for first, held, bar in ((False, 0, True), (True, 0, True), (True, 2**40, True), (True, 2**40, False)):
        monkeypatch.setattr(examples, "ROWS_FIRST", first)
        monkeypatch.setattr(examples, "OFFERED_BYTES", held)
        monkeypatch.setattr(select, "story_worst_kept", barred if bar else lifted)
        offered.clear()
        top = TopExamples(lm.n_layer, lm.n_head, NAMES, k=k, per_story=per_story)
        for batch, blocks in batches:
            for layer, pattern, per in blocks:
                T = pattern.shape[-2]
                for start in (0, T // 3, 2 * T // 3):
                    rows = slice(start, T if start == 2 * T // 3 else start + T // 3)
                    part = [(name, v[..., rows], c[:, rows]) for name, (v, c) in per.items()]
                    top.add_block(layer, part, pattern[:, :, rows], batch, start=start)
        states.append(top.state())
        counts.append(sum(offered))
    assert states[0] == states[1] == states[2] == states[3]
    assert 0 < counts[2] < counts[3]  # the bar kept queries out of the selection


def brute_force(batches, layer, head, name, k=K, per_story=None):
    """Every counted query of every story, sorted by (-value, story, query), the first k (at most
    per_story of one story): (story, query, value, most-attended key, its weight, the weights on
    keys max(0, q - 8) .. q and on keys max(0, key - 3) .. min(key + 3, q), rounded)."""
    rows = []
    for batch, blocks in batches:
        _, pattern, per = blocks[layer]
        values, counted = per[name]
        for b, story in enumerate(batch.stories):
            for q in range(len(story.ids)):
                if counted[b, q]:
                    rows.append((float(values[b, head, q]), story.index, q, b, pattern))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    taken = {}
    out = []
    for value, story, q, b, pattern in rows:
        if len(out) == k:
            break
        if per_story is not None and taken.get(story, 0) == per_story:
            continue
        taken[story] = taken.get(story, 0) + 1
        weights = pattern[b, head, q].tolist()
        key = weights.index(max(weights))  # the first (earliest) maximum
        seen = [round(float(w), 4) for w in weights[max(0, q - 8) : q + 1]]
        near_key = [round(float(w), 4) for w in weights[max(0, key - 3) : min(key + 4, q + 1)]]
        out.append((story, q, value, key, weights[key], seen, near_key))
    return out, rows


def test_top_examples_equal_a_brute_force_over_every_query(recorded):
    lm, encoded, batches = recorded
    assert [s.index for s in batches[0][0].stories] != sorted(s.index for s in batches[0][0].stories)
    top = fill(lm, batches)
    for name in ("prev_token", "prev_argmax", "induction", "name_mass"):
        for layer, head in ((0, 0), (1, 2), (5, 3)):
            want, rows = brute_force(batches, layer, head, name)
            got = top.entries(layer, head, name)
            assert [
                (e.story, e.query, e.value, e.key, e.key_weight, list(e.weights), list(e.key_weights)) for e in got
            ] == want, (
                name,
                layer,
                head,
            )
            for e in got:
                ids = list(encoded[e.story].ids)
                assert list(e.tokens) == ids[max(0, e.query - 8) : e.query + 3]
                assert e.tokens[e.query_at] == ids[e.query]
                assert list(e.key_tokens) == ids[max(0, e.key - 3) : e.key + 4]
                assert e.key_tokens[e.key_at] == ids[e.key] and e.key <= e.query
                assert len(e.weights) == e.query_at + 1 == len(e.tokens[: e.query_at + 1])
            if name == "prev_argmax":  # a 0/1 value: far more than k queries tie at the top
                assert sum(r[0] == want[0][2] for r in rows) > 5 * K
    # every head and detector keeps exactly k counted queries, best first
    for name in NAMES:
        for layer in range(lm.n_layer):
            for head in range(lm.n_head):
                got = top.entries(layer, head, name)
                assert len(got) == K
                keys = [(-e.value, e.story, e.query) for e in got]
                assert keys == sorted(keys) and len(set(keys)) == K


def test_examples_spread_across_stories(recorded):
    """per_story: the top k of what is left after each story's best per_story queries, equal to the
    brute force, merged and split alike; and the key window's weights hold the most-attended key."""
    lm, encoded, batches = recorded
    for per_story in (1, 2):
        top = fill(lm, batches, TopExamples(lm.n_layer, lm.n_head, NAMES, k=K, per_story=per_story))
        for name in ("prev_token", "prev_argmax", "name_mass"):
            for layer, head in ((0, 0), (3, 1), (5, 3)):
                want, _ = brute_force(batches, layer, head, name, per_story=per_story)
                got = top.entries(layer, head, name)
                assert [
                    (e.story, e.query, e.value, e.key, e.key_weight, list(e.weights), list(e.key_weights)) for e in got
                ] == want
                assert len(got) == K and len({e.story for e in got}) >= K // per_story
        halves = [
            fill(lm, part, TopExamples(lm.n_layer, lm.n_head, NAMES, k=K, per_story=per_story))
            for part in (batches[3:], batches[:3])
        ]
        assert halves[0].merge(halves[1]).state() == top.state()
    # uncapped, a 0/1 detector's top k all come from the earliest stories: what the cap spreads
    uncapped = fill(lm, batches).entries(2, 1, "prev_argmax")
    assert len({e.story for e in uncapped}) < K // 2
    # wherever the key lies before the query's window, its weight is in the key window's weights
    outside = 0
    for e in fill(lm, batches).entries(0, 0, "name_mass") + uncapped:
        assert e.key_weights[e.key_at] == round(e.key_weight, 4) > 0
        outside += e.key < e.query - e.query_at
    assert outside > 0  # the case the key window is for happens on the real model


def test_split_merged_and_resumed_runs_are_identical(recorded, tmp_path):
    lm, _, batches = recorded
    one = fill(lm, batches)
    halves = fill(lm, batches[:3]), fill(lm, batches[3:])
    assert copy.deepcopy(halves[0]).merge(halves[1]).state() == one.state()
    assert copy.deepcopy(halves[1]).merge(halves[0]).state() == one.state()
    thirds = [fill(lm, batches[4:]), fill(lm, batches[:2]), fill(lm, batches[2:4])]
    assert thirds[2].merge(thirds[0]).merge(thirds[1]).state() == one.state()
    # a worker's state through JSON, merged; a run resumed from a checkpoint of its first half
    sent = json.loads(json.dumps(halves[1].state()))
    assert TopExamples(lm.n_layer, lm.n_head, NAMES, k=K).load_state(sent).merge(halves[0]).state() == one.state()
    resumed = TopExamples.from_state(json.loads(json.dumps(halves[0].state())))
    assert fill(lm, batches[3:], resumed).state() == one.state()
    assert copy.deepcopy(one).merge(one).state() == one.state()  # a (story, query) is kept once

    # examples.json: the layout, values exactly as kept, ids decoded one by one
    path = one.to_json(tmp_path, lambda i: lm.decode([i]))
    assert path == tmp_path / "examples.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["k"] == K and data["detectors"] == NAMES and len(data["heads"]) == lm.n_layer * lm.n_head
    h = data["heads"][lm.n_head + 2]
    assert (h["label"], h["layer"], h["head"]) == ("L2H3", 2, 3)
    for name in NAMES:
        for x, e in zip(h["examples"][name], one.entries(1, 2, name), strict=True):
            assert (x["story"], x["query"], x["value"], x["key"], x["key_weight"]) == (
                e.story,
                e.query,
                e.value,
                e.key,
                e.key_weight,
            )
            assert x["tokens"] == [lm.decode([t]) for t in e.tokens] and x["query_at"] == e.query_at
            assert x["key_tokens"] == [lm.decode([t]) for t in e.key_tokens] and x["key_at"] == e.key_at
            assert x["weights"] == list(e.weights) and len(x["weights"]) == x["query_at"] + 1


def test_read_between_batches_and_fed_in_chunks_keep_the_same(recorded):
    """While fed, the kept examples are tensors and the Example objects are made when read: reading
    them between batches (state, entries, a copy) and feeding on, or feeding each block as chunks of
    query rows in any order (a view of the map, not contiguous), keeps what one plain run keeps."""
    lm, _, batches = recorded
    one = fill(lm, batches)
    read = TopExamples(lm.n_layer, lm.n_head, NAMES, k=K)
    chunked = TopExamples(lm.n_layer, lm.n_head, NAMES, k=K)
    for i, (batch, blocks) in enumerate(batches):
        for layer, pattern, per in blocks:
            read.add_block(layer, [(name, v, c) for name, (v, c) in per.items()], pattern, batch)
            T = pattern.shape[-2]
            for start in reversed(range(0, T, 7)):  # [B, H, 7, T] chunks, the last first
                offers = [(name, v[..., start : start + 7], c[:, start : start + 7]) for name, (v, c) in per.items()]
                chunked.add_block(layer, offers, pattern[:, :, start : start + 7], batch, start=start)
        if i % 2 == 0:
            assert read.entries(1, 2, NAMES[0]) == copy.deepcopy(read).entries(1, 2, NAMES[0])
            read.state()
    assert read.state() == one.state()
    assert chunked.state() == one.state()


def test_fed_by_the_recording_hooks(shipped_model, recorded):
    """Called from inside a measure's block() as the model makes each map (freed with its block):
    the same lists as from the kept maps of the same batches."""
    lm, _, batches = recorded

    class Feed:
        needs = Needs(streams=False)

        def __init__(self):
            self.top = TopExamples(lm.n_layer, lm.n_head, NAMES, k=K)

        def begin(self, batch):
            self.batch = batch

        def feed(self, chunk):
            m, p = chunk.masks, chunk.probs
            for d in BUILTIN_DETECTORS:
                self.top.add(chunk.layer, d.name, d.values(p, m), d.queries(m), p, self.batch)

        def end(self):
            pass

    first = batches[:2]  # their stories, longest first: record() makes the same two batches of them
    feed = Feed()
    record(lm, [s for batch, _ in first for s in batch.stories], [feed], batch_size=4, progress=False)
    assert feed.top.state() == fill(lm, first).state()


# ---------------------------------------------------------------- ties and dtypes, by hand


def hand_batch(indices, length=6, ids=None):
    stories = [EncodedStory(i, tuple(ids or range(10 * i, 10 * i + length)), False, None, (), ()) for i in indices]
    return batch_of(stories, marker_id=0, device="cpu")


def uniform(B, H, T):
    """Every query spreads its attention evenly over keys 0 .. q: the earliest key is the argmax."""
    rows = torch.ones(T, T).tril()
    return (rows / rows.sum(-1, keepdim=True)).expand(B, H, T, T).contiguous()


def test_massive_ties_keep_the_earliest_stories_and_positions():
    T = 6
    first, second = hand_batch([5, 2]), hand_batch([0, 7])
    counted = torch.ones(2, T, dtype=torch.bool)
    counted[:, 0] = False  # query 0 never counts
    values = torch.ones(2, 2, T)  # head 0: every query ties at 1.0
    values[:, 1] = torch.tensor([0.5, 0.25, 0.5, 0.5, 0.25, 0.5])  # head 1: ties at 0.5
    values[1, 1, 4] = 0.75  # ... but story 2 (row 1 of the first batch) has one 0.75 at query 4
    pattern = uniform(2, 2, T)
    pattern[0, 0, 3] = torch.tensor([0.1, 0.2, 0.35, 0.35, 0, 0])  # row 0, query 3: keys 2 and 3 tie

    def run(order):
        top = TopExamples(1, 2, ["d"], k=3, context=2)
        for batch in order:
            top.add(0, "d", values, counted, pattern, batch)
        return top

    a, b = run([first, second]), run([second, first])
    assert a.state() == b.state()
    assert [(e.story, e.query, e.value) for e in a.entries(0, 0, "d")] == [(0, 1, 1.0), (0, 2, 1.0), (0, 3, 1.0)]
    assert [(e.story, e.query, e.value) for e in a.entries(0, 1, "d")] == [(2, 4, 0.75), (7, 4, 0.75), (0, 2, 0.5)]
    # story 0 is row 0 of `second`: query 1 spreads evenly over keys 0 and 1 (key 0), query 3 is the
    # map's own tie between keys 2 and 3 (the earliest, 2)
    e1, _, e3 = a.entries(0, 0, "d")
    assert (e1.key, e1.key_weight) == (0, 0.5)
    assert (e3.key, e3.key_weight) == (2, float(torch.tensor(0.35)))
    assert (e3.tokens, e3.query_at, e3.key_tokens, e3.key_at) == ((1, 2, 3, 4, 5), 2, (0, 1, 2, 3, 4, 5), 2)
    # the weights on its window's keys up to itself (keys 1 .. 3 of the hand-set row), 4 decimals
    assert e3.weights == (0.2, 0.35, 0.35) and e1.weights == (0.5, 0.5)
    # without story 0: story 2 (row 1 of `first`) before story 5, its uniform map's key 0
    alone = run([first]).entries(0, 0, "d")
    assert [(e.story, e.query, e.key, e.key_weight) for e in alone] == [
        (2, 1, 0, 0.5),
        (2, 2, 0, float(torch.tensor(1 / 3))),
        (2, 3, 0, 0.25),
    ]

    # thousands of equal values across batches and merges: the earliest always win
    T = 300
    big = [hand_batch([9, 3, 6], T), hand_batch([4, 1, 8], T)]
    ones = torch.ones(3, 2, T)
    cnt = torch.ones(3, T, dtype=torch.bool)
    cnt[:, :7] = False
    pat = uniform(3, 2, T)
    whole = TopExamples(1, 2, ["d"], k=5)
    parts = [TopExamples(1, 2, ["d"], k=5) for _ in big]
    for batch, part in zip(big, parts):
        whole.add(0, "d", ones, cnt, pat, batch)
        part.add(0, "d", ones, cnt, pat, batch)
    assert [(e.story, e.query) for e in whole.entries(0, 1, "d")] == [(1, q) for q in range(7, 12)]
    assert parts[1].merge(parts[0]).state() == whole.state()


def test_values_of_other_dtypes_keep_the_exact_order():
    b = hand_batch([5], 3)
    counted = torch.tensor([[False, True, True]])
    pattern = uniform(1, 1, 3)
    top = TopExamples(1, 1, ["d"], k=1)
    top.add(0, "d", torch.tensor([[[0.0, 0.1, 0.0]]], dtype=torch.float64), counted, pattern, b)
    assert top.entries(0, 0, "d")[0].value == 0.1
    # float32(0.1) is 0.10000000149..., above the float64 0.1 kept: it must win although the
    # float64 value rounds to it in float32, and story 9 comes after story 5
    top.add(0, "d", torch.tensor([[[0.0, 0.1, 0.0]]]), counted, pattern, hand_batch([9], 3))
    assert (top.entries(0, 0, "d")[0].story, top.entries(0, 0, "d")[0].value) == (9, float(torch.tensor(0.1)))
    # half precision is kept exactly, a NaN never qualifies
    half = TopExamples(1, 1, ["d"], k=2)
    half.add(0, "d", torch.tensor([[[0.0, float("nan"), 0.3]]], dtype=torch.float16), counted, pattern, b)
    assert [(e.query, e.value) for e in half.entries(0, 0, "d")] == [(2, float(torch.tensor(0.3, dtype=torch.float16)))]


# ---------------------------------------------------------------- errors


def test_bad_k_and_bad_states_are_refused_with_one_clear_line():
    for k in (0, -1, True, 1.5):
        with pytest.raises(StorylensError, match=r"^examples: k must be a whole number of at least 1, got "):
            TopExamples(2, 2, ["a"], k=k)
    with pytest.raises(StorylensError, match="detector names must differ"):
        TopExamples(2, 2, ["a", "a"])

    b = hand_batch([3, 1], 5)
    top = TopExamples(1, 2, ["a", "b"], k=2)
    vals = torch.arange(20.0).reshape(2, 2, 5) / 20
    for name in ("a", "b"):
        top.add(0, name, vals, torch.ones(2, 5, dtype=torch.bool), uniform(2, 2, 5), b)
    good = top.state()
    assert json.loads(json.dumps(good)) == good

    def broken(change):
        s = copy.deepcopy(good)
        change(s)
        return s

    def ex(s):
        return s["examples"]["a"][0][1][0]

    cases = [
        ([1, 2], r"not a TopExamples state \(got list"),
        (broken(lambda s: s.pop("context")), r"not a TopExamples state"),
        (
            broken(lambda s: s.update(k=3)),
            r"k 3, context 8, per_story None; expected \[1, 2\], \['a', 'b'\], 2, 8, None",
        ),
        (broken(lambda s: s.update(per_story=1)), r"per_story 1; expected .*, 2, 8, None"),
        (broken(lambda s: s.pop("per_story")), r"not a TopExamples state"),
        (broken(lambda s: s.update(shape=[1, 3])), r"shape \[1, 3\]"),
        (broken(lambda s: s["examples"].pop("b")), r"examples are for a; expected a, b"),
        (broken(lambda s: s["examples"]["a"].append([])), r"examples\.a: expected a list of 1 layers"),
        (broken(lambda s: s["examples"]["a"][0].pop()), r"examples\.a\[0\]: expected a list of 2 heads"),
        (broken(lambda s: ex(s).update(value="high")), r"examples\.a\[0\]\[1\]\[0\]\.value: expected a finite number"),
        (broken(lambda s: ex(s).update(value=float("nan"))), r"\.value: expected a finite number, got nan"),
        (broken(lambda s: ex(s).update(story=True)), r"\[0\]\.story: expected a whole number >= 0, got True"),
        (broken(lambda s: ex(s).update(query=-1)), r"\.query: expected a whole number >= 0, got -1"),
        (broken(lambda s: ex(s).pop("key_at")), r"\[0\]: expected an example with fields story, query"),
        (broken(lambda s: ex(s).update(tokens=[1, "x"])), r"\.tokens: expected a list of token ids"),
        (broken(lambda s: ex(s).update(query_at=0)), r"\.query_at: 0 does not place query 4 in its tokens"),
        (broken(lambda s: ex(s).update(key_at=2)), r"\.key_at: 2 does not place key 0 in its key_tokens"),
        (broken(lambda s: ex(s)["weights"].pop()), r"\.weights: expected 5 weights between 0 and 1, one per key seen"),
        (broken(lambda s: ex(s)["weights"].__setitem__(0, 1.5)), r"\.weights: expected 5 weights between 0 and 1"),
        (broken(lambda s: ex(s).pop("weights")), r"\[0\]: expected an example with fields story, query"),
        (
            broken(lambda s: ex(s)["key_weights"].pop()),
            r"\.key_weights: expected 4 weights between 0 and 1, one per key",
        ),
        (broken(lambda s: ex(s).update(key=5)), r"\.key_at: 0 does not place key 5 in its key_tokens"),
        (broken(lambda s: s["examples"]["a"][0][1].reverse()), r"\[0\]\[1\]: the examples are not best first"),
        (broken(lambda s: s["examples"]["a"][0][1].append(ex(s))), r"expected a list of at most k=2 examples"),
    ]
    for state, message in cases:
        fresh = TopExamples(1, 2, ["a", "b"], k=2)
        with pytest.raises(ValueError, match=message):
            fresh.load_state(state)
        assert fresh.state() == TopExamples(1, 2, ["a", "b"], k=2).state()  # nothing taken
        if isinstance(state, dict) and "context" in state and state.get("shape") == [1, 2] and state["k"] == 2:
            with pytest.raises(ValueError, match="examples state"):
                TopExamples.from_state(state)
    assert TopExamples.from_state(good).state() == good
    with pytest.raises(ValueError, match="merge: other heads, detectors, k, context or per_story"):
        top.merge(TopExamples(1, 2, ["a", "b"], k=3))
    with pytest.raises(ValueError, match=r"per_story=1\) than this one's"):
        top.merge(TopExamples(1, 2, ["a", "b"], k=2, per_story=1))
    for n in (0, -1, True, 1.5):
        with pytest.raises(StorylensError, match=r"^examples: per_story must be a whole number of at least 1 or None"):
            TopExamples(2, 2, ["a"], per_story=n)
    capped = TopExamples(1, 2, ["a", "b"], k=2, per_story=1)
    with pytest.raises(ValueError, match=r"examples\.a\[0\]\[0\]: .* or a story passes per_story"):
        capped.load_state({**good, "per_story": 1})  # each head keeps two queries of story 1
    with pytest.raises(ValueError, match="the batch names 0 stories for 2 rows"):
        top.add(0, "a", vals, torch.ones(2, 5, dtype=torch.bool), uniform(2, 2, 5), replace(b, stories=()))
    with pytest.raises(ValueError, match="no detector 'c'"):
        top.add(0, "c", vals, torch.ones(2, 5, dtype=torch.bool), uniform(2, 2, 5), b)


def test_rounded_weights_are_pythons_round_bit_for_bit():
    """The tensor rounding of kept weights equals Python's round(w, 4) on every float32 tried: 300,000
    random ones, odd multiples of 1/32 (exact ties at the fifth decimal: 0.03125 -> 0.0312, half to even)
    and of finer powers of two down to 1/2^14, and the edges 0, 1 and the smallest normal."""
    g = torch.Generator().manual_seed(0)
    ties = [k / 2**e for e in range(5, 15) for k in range(1, 2**e, 2)][:200_000]
    w = torch.cat(
        [
            torch.rand(300_000, generator=g),
            torch.tensor(ties),
            torch.tensor([0.0, 1.0, torch.finfo(torch.float32).tiny]),
        ]
    ).to(torch.float32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = w.to(dtype).reshape(-1, 1)
        assert rounded(x) == [[round(float(v), WEIGHT_DECIMALS)] for v in x[:, 0].tolist()], dtype
    x64 = w[:4000].to(torch.float64).reshape(4, -1)
    assert rounded(x64) == [[round(v, WEIGHT_DECIMALS) for v in row] for row in x64.tolist()]


@pytest.mark.parametrize("per_story", [None, 1, 3])
def test_select_top_by_groups_equals_the_pairwise_definition(per_story):
    """select_top finds the repeated (story, query) slots and each story's count by sorting; the definition is
    pairwise (a slot is dropped when an earlier kept one has its query, or its story's quota is full): on random
    rows with many repeats, ties and empty slots, the same slots in the same order."""
    from storylens.looking.example_select import SPLIT, select_top

    gen = torch.Generator().manual_seed(7)
    R, M, k = 6, 40, 12
    value = torch.randint(0, 5, (R, M), generator=gen).double()  # ties everywhere
    value[torch.rand(R, M, generator=gen) < 0.2] = -float("inf")  # empty slots
    ints = torch.randint(0, 4, (R, M, 3), generator=gen)  # stories 0-3, queries 0-3: repeats everywhere
    floats = torch.cat([value[..., None], torch.rand(R, M, 2, generator=gen).double()], -1)

    def pairwise(sq: torch.Tensor, real: torch.Tensor, story: torch.Tensor) -> torch.Tensor:
        before = torch.ones(M, M, dtype=torch.bool).tril(-1)  # [i, j]: j sorts before i
        keep = real & ~((sq[:, :, None] == sq[:, None, :]) & real[:, None, :] & before).any(-1)
        if per_story is not None:
            keep &= ((story[:, :, None] == story[:, None, :]) & keep[:, None, :] & before).sum(-1) < per_story
        return keep

    got = select_top(floats, ints, k, per_story)
    real = value.isfinite()
    sq = ints[..., 0] * SPLIT + ints[..., 1]
    by = sq.argsort(dim=-1, stable=True)
    order = by.gather(-1, torch.where(real, -value, torch.inf).gather(-1, by).argsort(dim=-1, stable=True))
    o_sq, o_real, o_story = sq.gather(-1, order), real.gather(-1, order), ints[..., 0].gather(-1, order)
    keep = pairwise(o_sq, o_real, o_story)
    keep &= keep.cumsum(-1) <= k
    for r in range(R):
        slots = order[r][keep[r]]
        n = len(slots)
        assert 0 < n <= k
        assert torch.equal(got[1][r, :n], ints[r, slots]) and torch.equal(got[0][r, :n], floats[r, slots])
        assert (got[0][r, n:, 0] == -float("inf")).all()
