"""storylens's grouped attention (storylens.lm.attention) against each model's own eager attention,
in float64 where the two are the same sums in another order.

Bound: a score is a d-term dot product (d = 16 here) times the scaling; summed in another order it
moves by at most d * u * sum|q_i k_i| (u = 2**-53); with |q_i k_i| of order 10 after the test's x8
weights, that is under 1e-12, and a softmax moves by at most twice its inputs' largest change. The
value product adds the same again. 1e-10 leaves a hundredfold margin.
"""

from __future__ import annotations

import pytest
import torch

from storylens.lm import wrap
from storylens.lm.attention import HIDE_ROWS, NAME, _hide_ahead, attach, grouped_attention, streaming

BOUND = 1e-10
transformers = pytest.importorskip("transformers")


class _Rows:
    """A row consumer for the tests: ``sink(layer, rows, start[, masses])``, ``columns(layer)`` carried."""

    def __init__(self, sink, columns=None):
        self.sink, self.columns = sink, columns

    def key_weights(self, layer):
        return None if self.columns is None else self.columns(layer)

    def rows(self, layer, probs, start, masses, heads):
        self.sink(layer, probs, start, *(() if masses is None else (masses,)))


def _streaming(modules, sink, chunk_bytes, columns=None):
    """Stream plain attention modules (each given its tap, as a model wrapper does)."""
    return streaming(attach(modules), _Rows(sink, columns), chunk_bytes)


def _model(kind: str):
    cfgs = {
        "llama": lambda: transformers.LlamaConfig(
            hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=128, vocab_size=4096,
        ),
        "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=4096),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=128, vocab_size=4096,
        ),
    }  # fmt: skip
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfgs[kind]()).double().eval()
    with torch.no_grad():  # sharper attention than the default init
        for name, p in m.named_parameters():
            if "proj" in name or "attn" in name or "attention" in name:
                p.mul_(8.0)
    return m


@pytest.fixture(scope="module")
def tokenizer():
    from storylens.model.hub import load_model

    tok = load_model().tokenizer
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt_neox"])
def test_grouped_attention_equals_the_models_own_eager_attention(kind, tokenizer):
    m = _model(kind)
    ids = torch.randint(0, 4096, (3, 40), generator=torch.Generator().manual_seed(1))
    m.set_attn_implementation("eager")
    with torch.no_grad():
        ref = m(ids, output_attentions=True)
    lm = wrap(m, tokenizer)
    assert lm.attention == NAME and m.config._attn_implementation == NAME
    got: list[torch.Tensor] = []
    hooks = [(f"blocks.{i}.attn.hook_pattern", lambda p, h: got.append(p.clone())) for i in range(2)]
    with torch.no_grad(), lm.hooks(hooks):
        out = m(ids)
    assert len(got) == 2
    assert max((a - b).abs().max().item() for a, b in zip(ref.attentions, got)) <= BOUND
    assert (ref.logits - out.logits).abs().max().item() <= BOUND


@pytest.mark.parametrize("n, past", [(1, 0), (HIDE_ROWS, 0), (2 * HIDE_ROWS + 5, 0), (HIDE_ROWS + 3, 7), (70, 40)])
def test_hiding_the_keys_ahead_band_by_band_sets_exactly_the_causal_corner(n, past):
    """The banded corner (plain fills past each band, a masked fill on its own triangle) sets to -inf
    exactly the entries a whole ``[n, keys]`` causal mask does, and leaves every other entry as it was
    (a NaN or +inf ahead included, as ``masked_fill`` does)."""
    keys = n + past + 3  # the rows are queries past .. past + n - 1 of a full-row chunk: 3 keys beyond the last
    scores = torch.randn(2, 3, n, keys, generator=torch.Generator().manual_seed(n))
    scores[..., -1] = float("inf")  # always ahead: hidden all the same
    visible = torch.ones(n, keys, dtype=torch.bool).tril(past)
    expected = scores.masked_fill(~visible, float("-inf"))
    _hide_ahead(scores, keys - past)
    assert torch.equal(scores, expected)


def test_grouped_heads_read_their_own_group_and_the_cache():
    """Without transformers: query head h reads key/value group h // r (repeat_kv's rule), a cached
    step (S > T) sees every earlier key, and no mask means causal."""
    torch.manual_seed(0)
    B, H, G, T, d = 2, 6, 2, 5, 8
    q, k = torch.randn(B, H, T, d, dtype=torch.float64), torch.randn(B, G, T, d, dtype=torch.float64)
    v = torch.randn(B, G, T, d, dtype=torch.float64)
    out, probs = grouped_attention(torch.nn.Module(), q, k, v, None, scaling=0.5)
    kk, vv = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    s = (q @ kk.transpose(-1, -2)) * 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    p = s.softmax(-1)
    assert (probs - p).abs().max() <= BOUND and (out - (p @ vv).transpose(1, 2)).abs().max() <= BOUND
    # one new query over T cached keys: no mask needed, every key visible
    out1, probs1 = grouped_attention(torch.nn.Module(), q[:, :, -1:], k, v, None, scaling=0.5)
    assert (probs1 - p[:, :, -1:]).abs().max() <= BOUND
    with pytest.raises(ValueError, match="cannot share"):
        grouped_attention(torch.nn.Module(), q[:, :5], k, v, None)


# ---------------------------------------------------------------- streamed: chunks of query rows


def _columns(scores) -> dict[str, list]:
    return {k: [r[k] for r in scores.to_rows()] for k in scores.to_rows()[0] if k != "label"}


def _same(a, b) -> float:
    """The largest difference between two head tables, column by column (None only where the other is None)."""
    worst = 0.0
    for name, xs in _columns(a).items():
        for x, y in zip(xs, _columns(b)[name], strict=True):
            if isinstance(x, float) or isinstance(y, float):
                assert (x is None) == (y is None), name
                if x is not None and not (x != x and y != y):  # NaN on both sides is the same
                    worst = max(worst, abs(x - y))
            else:
                assert x == y, name
    return worst


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt_neox"])
def test_streamed_scores_equal_whole_maps(kind, tokenizer, monkeypatch):
    """Every column (raw, norm-weighted, output norms, a user pattern) and every top example from
    maps handed over a few query rows at a time equal those from whole eager maps. float64 (Llama's
    and NeoX's softmax in float32, as their own): the same sums in another order, BOUND as above."""
    import storylens.lm.attention as attention
    import storylens.lm.transformers_lm as interface
    from storylens.analysis import pattern_detector, score_heads
    from storylens.data.stories import load_split
    from storylens.engine.record import record
    from storylens.looking.detectors import BUILTIN_DETECTORS
    from storylens.table.accumulator import HeadScoreAccumulator

    stories = load_split().quiz[:6]
    same_token = pattern_detector("same_token", lambda ids: (ids[:, :, None] == ids[:, None, :]).float())
    detectors = BUILTIN_DETECTORS + (same_token,)
    lm = wrap(_model(kind), tokenizer)
    lm.chunk_bytes = 3000  # a few rows a chunk, not dividing the stories' lengths
    monkeypatch.setattr(attention, "SUB_ROWS", 5)  # a chunk of more rows taken in bands (_Rows.banded)
    chunks: list[tuple[int, int, int]] = []

    class Seen:  # the recording's consumer, watched
        def __init__(self, consumer, chunk_bytes):
            self.consumer, self.chunk_bytes = consumer, chunk_bytes

        def key_weights(self, layer):
            return self.consumer.key_weights(layer)

        def rows(self, layer, rows, start, masses, heads):
            chunks.append((layer, start, rows.shape[-2]))
            assert rows.shape[-1] >= start + rows.shape[-2]  # every key its rows can see
            assert rows.shape[-2] == 1 or rows.numel() * rows.element_size() <= self.chunk_bytes
            self.consumer.rows(layer, rows, start, masses, heads)

    def spy(taps, consumer, chunk_bytes, riding=False):
        return streaming(taps, Seen(consumer, chunk_bytes), chunk_bytes, riding)

    monkeypatch.setattr(interface, "stream_attention", spy)
    got = score_heads(lm, stories, detectors=detectors, examples=3, progress=False)
    assert chunks and max(n for _, _, n in chunks) < 40  # chunks of rows, not whole maps
    mlp: list[int] = []  # the blocks whose MLP ran: streamed, the recording stops at the last block's attention
    with lm.hooks([(f"blocks.{i}.hook_mlp_out", lambda x, hook: mlp.append(hook.layer)) for i in range(2)]):
        record(lm, stories, [HeadScoreAccumulator(lm.n_layer, lm.n_head)], batch_size=2, progress=False)
    assert mlp == [0, 0, 0]  # three batches, block 0's MLP in each, the last block's in none
    firsts = [s for layer, s, _ in chunks if layer == 0]
    assert firsts.count(0) >= 1 and all(b > a or b == 0 for a, b in zip(firsts, firsts[1:]))  # in order
    lm.module.set_attn_implementation("eager")  # whole maps through hook_pattern
    ref = score_heads(lm, stories, detectors=detectors, examples=3, progress=False)
    assert _same(ref, got) <= BOUND
    assert got.n_stories == ref.n_stories == 6
    assert got.examples is not None and ref.examples is not None
    for name in ("prev_token", "induction", "same_token"):
        for layer in range(2):
            for head in range(lm.n_head):
                a, b = ref.examples.entries(layer, head, name), got.examples.entries(layer, head, name)
                assert [(e.story, e.query, e.key) for e in a] == [(e.story, e.query, e.key) for e in b]
                assert all(abs(x.value - y.value) <= BOUND for x, y in zip(a, b))


def test_norm_weighted_sums_held_to_the_batch_end_equal_those_summed_chunk_by_chunk(tokenizer, monkeypatch):
    """The norm-weighted columns from reads held back and summed once per batch for every block at
    once (HeadScoreAccumulator._sum_held, chunks of several rows per block) are, bit for bit, those
    summed as each chunk comes (a budget of 0 bytes) and those of detectors that read the scaled map
    chunk by chunk themselves (no shared reads): the same products, the same sums in the same order."""
    import dataclasses

    import storylens.table.accumulator as accumulator
    import storylens.table.scores as scores
    from storylens.data.stories import load_split
    from storylens.looking.detectors import BUILTIN_DETECTORS, NORM_PREFIX
    from storylens.looking.reads import HeldReads

    stories = load_split().quiz[:6]
    lm = wrap(_model("llama"), tokenizer)
    lm.chunk_bytes = 3000  # a few rows a chunk: several chunks per block
    names = [NORM_PREFIX + d.name for d in BUILTIN_DETECTORS]

    def norm_columns(detectors=BUILTIN_DETECTORS):
        hs = scores.score_heads(lm, stories, detectors=detectors, progress=False)
        return {c: hs.grid(c) for c in names}

    joined: list[int] = []
    join = HeldReads.join
    monkeypatch.setattr(HeldReads, "join", staticmethod(lambda parts: joined.append(len(parts)) or join(parts)))
    held = norm_columns()
    assert joined and max(joined) == lm.n_layer  # every block's chunk of the same rows, joined
    joined.clear()
    monkeypatch.setattr(accumulator, "HELD_BYTES", 0)
    each = norm_columns()
    assert joined and max(joined) == 1  # summed chunk by chunk
    unshared = norm_columns(tuple(dataclasses.replace(d, read=None) for d in BUILTIN_DETECTORS))
    assert all(v is not None for row in held["norm_prev_token"] for v in row)
    assert held == each == unshared


def test_a_hand_made_detector_gets_whole_maps(tokenizer):
    """A detector made by hand (no ``rows``) may not read a chunk: the recording gives it whole maps."""
    from storylens.analysis import score_heads
    from storylens.data.stories import load_split
    from storylens.looking.detectors import Detector

    shapes: list[tuple[int, ...]] = []

    def last_key(p, m):
        shapes.append(tuple(p.shape))
        return p[..., -1]

    whole = Detector("last_key", last_key, lambda m: m.queries)
    lm = wrap(_model("llama"), tokenizer)
    lm.chunk_bytes = 3000
    score_heads(lm, load_split().quiz[:2], detectors=(whole,), progress=False, faithful=False)
    assert shapes and all(s[-2] == s[-1] for s in shapes)  # [B, H, T, T]: whole maps


def test_streamed_attention_on_another_device():
    """Every tensor the streamed path makes is made on the inputs' device (checked on ``meta``)."""
    B, H, G, T, d = 2, 6, 2, 50, 8
    q = torch.empty(B, H, T, d, device="meta")
    k, v = torch.empty(B, G, T, d, device="meta"), torch.empty(B, G, T, d, device="meta")
    module, seen = torch.nn.Module(), []
    with _streaming([module], lambda layer, rows, start: seen.append((rows.device.type, start)), 2000):
        out, probs = grouped_attention(module, q, k, v, None, scaling=0.5)
    assert probs is None and out.shape == (B, T, H, d) and out.device.type == "meta"
    assert len(seen) > 1 and {dev for dev, _ in seen} == {"meta"}
    mask = torch.ones(B, 1, T, T, dtype=torch.bool, device="meta")
    with _streaming([module], lambda *a: None, 2000):
        out, _ = grouped_attention(module, q, k, v, mask, scaling=0.5)
    assert out.device.type == "meta"


def test_streamed_chunks_reuse_two_buffers_and_change_nothing():
    """In inference mode every chunk's probabilities are written into one buffer taken once (its
    memory reused chunk after chunk and layer after layer, though a chunk of rows sees more keys
    than the last), and the layer's output and every chunk's
    rows are bit for bit those of a run that allocates afresh (outside inference mode)."""
    torch.manual_seed(0)
    B, H, G, T, d = 2, 6, 2, 40, 8
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, G, T, d), torch.randn(B, G, T, d)
    modules = [torch.nn.Module(), torch.nn.Module()]

    def run(inference: bool):
        rows, places = [], set()

        def sink(layer, chunk, start):
            rows.append((layer, start, chunk.clone()))
            places.add(chunk.data_ptr())

        with torch.inference_mode(inference), _streaming(modules, sink, 2000):
            outs = [grouped_attention(m, q, k, v, None, scaling=0.3)[0].clone() for m in modules]
        return outs, rows, places

    outs, rows, places = run(True)
    fresh_outs, fresh_rows, _ = run(False)
    assert len(rows) > 4 and len(places) == 1  # many chunks, one buffer
    assert all(torch.equal(a, b) for a, b in zip(outs, fresh_outs))
    assert [(la, s) for la, s, _ in rows] == [(la, s) for la, s, _ in fresh_rows]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(rows, fresh_rows))


def test_workspace_grows_and_reuses():
    from storylens.core.buffers import Workspace

    ws = Workspace()
    a = ws.take("x", (2, 3), torch.float32, torch.device("cpu"))
    b = ws.take("x", (1, 4), torch.float32, torch.device("cpu"))
    assert a.data_ptr() == b.data_ptr() and b.shape == (1, 4) and b.is_contiguous()
    c = ws.take("x", (5, 5), torch.float32, torch.device("cpu"))  # larger: a new buffer
    assert c.shape == (5, 5) and c.numel() == 25
    d = ws.take("y", (2, 2), torch.float32, torch.device("cpu"), room=30)  # made with room: grows once
    assert ws.take("y", (5, 6), torch.float32, torch.device("cpu")).data_ptr() == d.data_ptr()
    assert ws.take("x", (2, 2), torch.float64, torch.device("cpu")).dtype == torch.float64  # one per dtype


def test_key_columns_come_back_as_each_heads_rows_times_its_own_columns():
    """Columns carried through the probabilities-times-values product come back, chunk by chunk, as
    ``rows @ columns`` for each query head (grouped heads reading their own columns, not the group's
    others'), with and without a mask, and leave the layer's output as it was (float64)."""
    torch.manual_seed(4)
    B, H, G, T, d, c = 2, 6, 2, 30, 8, 3
    q, k, v = (torch.randn(B, n, T, d, dtype=torch.float64) for n in (H, G, G))
    columns = torch.rand(B, H, T, c, dtype=torch.float64)
    module = torch.nn.Module()
    pad = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    pad[1, :, :, 20:] = False  # the second story ends at 20
    for mask in (None, pad):
        seen: list = []

        def sink(layer, rows, start, masses, seen=seen):
            seen.append((start, rows.clone(), masses.clone()))

        with torch.inference_mode(), _streaming([module], sink, 3000, columns=lambda layer: columns):
            out, _ = grouped_attention(module, q, k, v, mask, scaling=0.4)
        with torch.inference_mode(), _streaming([module], lambda *a: None, 3000):
            plain, _ = grouped_attention(module, q, k, v, mask, scaling=0.4)
        assert len(seen) > 1 and torch.allclose(out, plain, rtol=0, atol=1e-13)
        for start, rows, masses in seen:
            keys = rows.shape[-1]
            assert torch.allclose(masses, rows @ columns[:, :, :keys], rtol=0, atol=1e-13), start
    with (
        pytest.raises(ValueError, match="key weights"),
        _streaming([module], sink, 3000, columns=lambda layer: columns[:, :2]),
    ):
        grouped_attention(module, q, k, v, None, scaling=0.4)


@pytest.mark.parametrize("past", [0, 9])
@pytest.mark.parametrize("chunk_rows", [12, 1000])
def test_a_chunk_taken_in_bands_of_rows_hands_over_what_whole_rows_do(monkeypatch, past, chunk_rows):
    """In inference mode a chunk's rows are taken SUB_ROWS at a time, each band over the keys its own
    rows see: the map handed over (0 past each band's keys, as the softmax leaves them), the key columns
    and the layer's output equal those of the chunk taken whole, with and without a padding mask, with
    keys cached before the queries (``past``), one hand-over per chunk, not per band. float64: the same
    sums over fewer terms, BOUND as above."""
    import storylens.lm.attention as attention

    torch.manual_seed(5)
    B, H, G, T, d, c = 2, 6, 2, 30, 8, 3
    S = T + past
    q = 2 * torch.randn(B, H, T, d, dtype=torch.float64)
    k, v = (torch.randn(B, G, S, d, dtype=torch.float64) for _ in range(2))
    columns = torch.rand(B, H, S, c, dtype=torch.float64)
    module = torch.nn.Module()
    pad = torch.ones(B, 1, T, S, dtype=torch.bool).tril(past)
    pad[1, :, :, past + 20 :] = False  # the second story ends at 20
    chunk_bytes = B * H * S * 8 * chunk_rows
    for mask in (None, pad):

        def run(sub: int, mask=mask):
            monkeypatch.setattr(attention, "SUB_ROWS", sub)
            seen: list = []

            def sink(layer, rows, start, masses):
                seen.append((start, rows.clone(), masses.clone()))

            with torch.inference_mode(), _streaming([module], sink, chunk_bytes, columns=lambda layer: columns):
                out, _ = grouped_attention(module, q, k, v, mask, scaling=0.4)
            return out, seen

        out, banded = run(4)
        ref, whole = run(10**6)
        assert (out - ref).abs().max() <= BOUND
        assert [s for s, _, _ in banded] == [s for s, _, _ in whole] == list(range(0, T, min(chunk_rows, T)))
        for (_, got, got_masses), (_, ref_rows, ref_masses) in zip(banded, whole):
            assert got.shape == ref_rows.shape
            assert (got - ref_rows).abs().max() <= BOUND and (got_masses - ref_masses).abs().max() <= BOUND
            assert torch.equal(got == 0, ref_rows == 0)  # every key ahead of a query (or masked) exactly 0


def test_the_plan_says_how_a_pass_feeds_and_one_whole_map_measure_switches_it(tokenizer):
    """Every measure streams: chunks of rows, with the key norms and head output sizes asked for; one
    measure that does not (``Needs(streams=False)``) makes the whole pass hand whole maps, and the
    plan says so and why. Both ways the chunks carry the same norms and output sizes."""
    from storylens.data.stories import load_split
    from storylens.engine.record import Needs, plan, record

    class Kept:
        def __init__(self, streams):
            self.needs, self.seen = Needs(key_norms=True, outputs=True, streams=streams), []

        def begin(self, batch):
            pass

        def feed(self, chunk):
            n, keys = chunk.probs.shape[-2:]
            assert chunk.key_norms is not None and chunk.key_norms.shape[-1] == keys
            assert chunk.outputs is not None and chunk.outputs.shape[-1] == n
            assert chunk.masks.start == chunk.start and chunk.masks.stop == chunk.stop
            self.seen.append((chunk.layer, chunk.start, n, keys, chunk.outputs.clone()))

        def end(self):
            pass

    lm = wrap(_model("llama").double(), tokenizer)  # float64: the two paths differ only in a sum's order
    lm.chunk_bytes = 3000
    stories = load_split().quiz[:2]
    rows, whole = Kept(True), Kept(False)
    streamed = plan(lm, [rows])
    assert streamed.streamed and streamed.key_norms and streamed.outputs and "every measure streams" in streamed.why
    switched = plan(lm, [rows, whole])
    assert not switched.streamed and "Kept cannot take chunks of rows" in switched.why
    record(lm, stories, [rows], batch_size=2, progress=False)
    assert any(n < keys for _, _, n, keys, _ in rows.seen)  # chunks of rows
    by_rows, rows.seen = rows.seen, []
    record(lm, stories, [rows, whole], batch_size=2, progress=False)
    assert all(start == 0 and n == keys for _, start, n, keys, _ in rows.seen + whole.seen)  # whole maps
    for layer in range(lm.n_layer):
        chunked = torch.cat([o for la, _, _, _, o in by_rows if la == layer], -1)
        (full,) = [o for la, _, _, _, o in whole.seen if la == layer]
        # |sum_j a_j f_j| summed in another order: at most 2 K u sum_j a_j |f_j| apart (K <= 128 keys,
        # u = 2^-53, |f_j| well under 100 here): below 3e-12; 1e-10 leaves a margin for any CPU
        assert torch.allclose(chunked, full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("sub_rows", [4, 10**6])
def test_inputs_strided_as_transformers_hands_them_give_the_same_rows_and_a_contiguous_output(monkeypatch, sub_rows):
    """transformers hands queries, keys and values as ``[B, T, heads, d]`` memory seen as ``[B, heads,
    T, d]``: the kernel hands over the same maps and head outputs as from contiguous copies of them (the
    same products on the same numbers: bit for bit), in bands or whole, each chunk's head outputs are
    the output's rows, and the output comes back as contiguous ``[B, T, H, d]`` (what the output
    projection reads, with no copy)."""
    import storylens.lm.attention as attention

    monkeypatch.setattr(attention, "SUB_ROWS", sub_rows)
    torch.manual_seed(6)
    B, H, G, T, d = 2, 6, 2, 30, 8
    strided = [torch.randn(B, T, n, d, dtype=torch.float64).transpose(1, 2) for n in (H, G, G)]
    assert not any(x.is_contiguous() for x in strided)
    module = torch.nn.Module()

    def run(q, k, v):
        seen: list = []

        class Kept(_Rows):
            def rows(self, layer, probs, start, masses, heads):
                seen.append((start, probs.clone(), heads.clone()))

        with torch.inference_mode(), streaming(attach([module]), Kept(None), B * H * T * 8 * 12):
            out, _ = grouped_attention(module, q, k, v, None, scaling=0.4)
        return out, seen

    out, seen = run(*strided)
    ref, ref_seen = run(*(x.contiguous() for x in strided))
    assert out.shape == (B, T, H, d) and out.is_contiguous()
    assert torch.equal(out, ref) and len(seen) == len(ref_seen) == 3  # chunks of 12 rows
    for (start, probs, heads), (ref_start, ref_probs, ref_heads) in zip(seen, ref_seen):
        assert start == ref_start and torch.equal(probs, ref_probs) and torch.equal(heads, ref_heads)
        assert torch.equal(heads.transpose(1, 2), out[:, start : start + heads.shape[2]])


def test_a_streamed_recording_runs_nothing_past_the_last_blocks_head_outputs(tokenizer):
    """Streamed, the recording stops at the last block's head outputs (``hook_z``): every block's map is
    handed over, and that block's output projection and MLP never run (no measure reads them); a pass
    of whole maps runs the forward to its end."""
    from storylens.data.stories import load_split
    from storylens.engine.record import Needs, record

    class Kept:
        def __init__(self, streams):
            self.needs, self.layers = Needs(streams=streams), set()

        def begin(self, batch):
            pass

        def feed(self, chunk):
            self.layers.add(chunk.layer)

        def end(self):
            pass

    lm = wrap(_model("llama"), tokenizer)
    last = lm.module.model.layers[-1]
    calls = {"o_proj": 0, "mlp": 0}
    handles = [
        module.register_forward_hook(lambda m, a, o, name=name: calls.__setitem__(name, calls[name] + 1))
        for name, module in (("o_proj", last.self_attn.o_proj), ("mlp", last.mlp))
    ]
    stories = load_split().quiz[:2]
    try:
        for streams, ran in ((True, 0), (False, 1)):
            calls.update(o_proj=0, mlp=0)
            kept = Kept(streams)
            record(lm, stories, [kept], batch_size=2, progress=False)
            assert kept.layers == set(range(lm.n_layer))
            assert calls == {"o_proj": ran, "mlp": ran}, streams
    finally:
        for h in handles:
            h.remove()


def test_head_outputs_handed_over_under_autograd_take_a_backward():
    """Streamed outside inference mode (autograd), a consumer may build on each chunk's head outputs
    and take a backward through them and the layer's output: the gradients are those of the whole-map
    path (float64, BOUND as above), and writing a later chunk's rows marks nothing it read as modified."""
    torch.manual_seed(7)
    B, H, G, T, d = 2, 6, 2, 30, 8
    leaves = [torch.randn(B, T, n, d, dtype=torch.float64, requires_grad=True) for n in (H, G, G)]
    module = torch.nn.Module()
    kept: list = []

    class Kept(_Rows):
        def rows(self, layer, probs, start, masses, heads):
            kept.append(heads.square().sum())

    with streaming(attach([module]), Kept(None), B * H * T * 8 * 12):
        out, _ = grouped_attention(module, *(x.transpose(1, 2) for x in leaves), None, scaling=0.4)
    assert len(kept) == 3  # chunks of 12 rows
    (sum(kept) + out.sum()).backward()
    grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    ref, _ = grouped_attention(torch.nn.Module(), *(x.transpose(1, 2) for x in leaves), None, scaling=0.4)
    (ref.square().sum() + ref.sum()).backward()
    for got, x in zip(grads, leaves):
        assert (got - x.grad).abs().max() <= BOUND
