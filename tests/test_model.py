"""The model on the real shipped weights and real quiz stories."""

import pytest
import torch

from storylens.core.heads import head_label, parse_head_label
from storylens.lesson.checks import LESSON, cached_vs_recomputed, fused_vs_explicit, prefix_keys_values, rounding_bound
from storylens.model.gpt import GPT, GPTConfig, KVCache


def test_architecture_and_parameter_count(shipped_model):
    c = shipped_model.config
    assert (c.n_layer, c.n_head, c.head_size, c.n_embd, c.block_size) == (6, 4, 64, 256, 256)
    n = shipped_model.num_parameters()
    assert 5.8e6 < n < 6.0e6, n
    attn = shipped_model.transformer.h[0].attn
    for proj in (attn.query, attn.key, attn.value):
        assert proj.weight.shape == (256, 256)  # 4 heads x 64 numbers each
    assert shipped_model.lm_head.weight is shipped_model.transformer.wte.weight  # tied


def test_head_labels_count_from_one():
    assert head_label(4, 2) == "L5H3"
    assert parse_head_label("L6H4") == (5, 3)
    assert [head_label(b, h) for b in range(6) for h in range(4)][0] == "L1H1"


# The numerical contracts. Bounds come from storylens.lesson.checks (rounding error analysis, written
# out in its docstring): n_layer * sqrt(longest sum) * unit roundoff * scale, times 4. In float32
# that is about 9e-4 for logits near 20; in float64 about 2e-12, so the float64 tests hold the
# mathematics exact far from any CPU's rounding, and float32 holds on every x86 or ARM CPU.
# Measured maxima (Intel Xeon, AVX-512, 200 quiz stories; `storylens check`): fused vs explicit
# 2.0e-5 (f32) / 3.7e-14 (f64), prefix keys/values 2.4e-6 / 5.3e-15, cache vs recompute
# 1.6e-5 / 2.7e-14; rows 3.6e-7 / 7.8e-16.

F64 = torch.float64
F32 = torch.float32


@pytest.fixture(scope="module")
def model64(shipped_model):
    import copy

    return copy.deepcopy(shipped_model).double()


@pytest.mark.parametrize(
    "dtype",
    # float64: the same 200 stories again in double precision (~30 s): the full suite runs it, the fast tier not
    [F32, pytest.param(F64, marks=pytest.mark.slow)],
    ids=["float32", "float64"],
)
@torch.no_grad()
def test_fused_and_explicit_paths_agree_on_every_quiz_story(shipped_model, model64, quiz_ids, dtype):
    model = model64 if dtype == F64 else shipped_model
    logits, rows, upper = fused_vs_explicit(model, quiz_ids, dtype)
    assert logits.passed, logits
    assert rows.passed, rows
    assert upper.measured == 0.0, upper  # the causal mask: exactly zero, not just small
    if dtype == F64:
        assert logits.bound < 1e-10 and logits.measured <= LESSON["fused_vs_explicit"]


@torch.no_grad()
def test_explicit_path_returns_batch_head_query_key_maps(shipped_model, quiz_ids):
    ids = quiz_ids[0]
    out = shipped_model(torch.tensor([ids]), record_attention=True)
    assert shipped_model(torch.tensor([ids])).patterns is None
    assert [tuple(a.shape) for a in out.patterns] == [(1, 4, len(ids), len(ids))] * 6


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@torch.no_grad()
def test_prefix_keys_and_values_equal_the_full_run(shipped_model, model64, quiz_ids, dtype):
    model = model64 if dtype == F64 else shipped_model
    check = prefix_keys_values(model, max(quiz_ids, key=len), dtype)
    assert check.passed, check
    if dtype == F64:
        assert check.bound < 1e-10


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@torch.no_grad()
def test_kv_cached_generation_matches_full_recomputation(shipped_model, model64, dtype):
    model = model64 if dtype == F64 else shipped_model
    logits, tokens, counter = cached_vs_recomputed(model, dtype, n_tokens=200)
    assert tokens.measured == 0, tokens  # the same 200 tokens either way
    assert logits.passed, logits
    # Ella's shelf: 200 key/value computations instead of 1 + 2 + ... + 200 = 20,100
    assert counter.measured == 0 and "cache 200 vs recompute 20,100" in counter.detail, counter
    if dtype == F64:
        assert logits.bound < 1e-10 and logits.measured <= LESSON["kv_cache_vs_recompute"]


def test_bounds_scale_with_precision_depth_and_magnitude(shipped_model):
    c = shipped_model.config
    assert rounding_bound(c, F64, 20.0) < 1e-10 < 1e-4 < rounding_bound(c, F32, 20.0) < 5e-3
    assert rounding_bound(c, F32, 40.0) == pytest.approx(2 * rounding_bound(c, F32, 20.0))
    deeper = GPTConfig(n_layer=12)
    assert rounding_bound(deeper, F32, 20.0) == pytest.approx(2 * rounding_bound(c, F32, 20.0))


@torch.no_grad()
def test_a_real_error_is_far_outside_the_bound(shipped_model, quiz_ids):
    """A stale cache entry (one key shifted by one position) must fail the check by a wide margin."""
    ids = torch.tensor([quiz_ids[0][:40]])
    cache = KVCache.empty(6)
    shipped_model(ids[:, :-1], kv_cache=cache)
    cache.key[0].copy_(torch.roll(cache.key[0], 1, dims=2))  # the shelf itself, one key shifted
    stale = shipped_model(ids[:, -1:], kv_cache=cache).logits[0, -1]
    full = shipped_model(ids).logits[0, -1]
    scale = full.abs().max().item()
    assert (stale - full).abs().max().item() > 100 * rounding_bound(shipped_model.config, F32, scale)


@torch.no_grad()
def test_recorded_generation_yields_the_new_tokens_attention_row(shipped_model, quiz_ids):
    prompt = torch.tensor([quiz_ids[3][:20]])
    steps = list(shipped_model.generate_stream(prompt, 5, temperature=0, record_attention=True))
    seq = torch.cat([prompt, torch.tensor([[s.token for s in steps[:-1]]])], dim=1)
    ref = shipped_model(seq, record_attention=True).patterns
    last = steps[-1]
    assert len(last.pattern_rows) == 6 and last.pattern_rows[0].shape == (4, seq.shape[1])
    bound = rounding_bound(shipped_model.config, F32, 1.0)  # probabilities: magnitude at most 1
    for b in range(6):
        assert (last.pattern_rows[b] - ref[b][0, :, -1, :]).abs().max().item() <= bound


def test_generation_refuses_to_pass_the_window(shipped_model):
    with pytest.raises(ValueError, match="window"):
        next(shipped_model.generate_stream(torch.zeros(1, 200, dtype=torch.long), 57))


def test_config_round_trip_rejects_bad_fields():
    assert GPTConfig.from_dict(GPTConfig().to_dict()) == GPTConfig()
    with pytest.raises(ValueError):
        GPTConfig.from_dict({"n_embd": 250, "n_head": 4})
    with pytest.raises(ValueError):
        GPTConfig.from_dict({"colour": "blue"})


def test_fresh_model_is_random_not_the_shipped_one(shipped_model):
    fresh = GPT(GPTConfig())
    assert not torch.equal(fresh.lm_head.weight, shipped_model.lm_head.weight)


def test_kv_cache_appends_in_place_and_grows_by_doubling():
    cache = KVCache.empty(2, capacity=3)
    parts = [torch.randn(1, 4, n, 8) for n in (2, 1, 4, 1)]  # 2 + 1 fit; the 4 makes it grow
    for p in parts:
        for layer in range(2):
            k, v = cache.update(layer, p, -p)
            assert k.shape[2] == cache.length(layer)
    whole = torch.cat(parts, dim=2)
    assert len(cache) == 8
    assert torch.equal(cache.key[1], whole) and torch.equal(cache.value[0], -whole)
    assert cache._key[0].shape[2] == 14  # room for 3, then 7 (what was asked), then 14 (doubled)


@torch.no_grad()
def test_cached_decoding_runs_the_blocks_own_code(shipped_model, quiz_ids):
    """Generation steps one token at a time through the same blocks as any forward pass: a hook
    in the model (which sees every step) changes nothing, bit for bit, and each step's recorded
    row is the newest query's row of each block's pattern."""
    prompt = torch.tensor([quiz_ids[2][:30]])
    kw = dict(temperature=1.0, record_attention=True)
    plain = list(shipped_model.generate_stream(prompt, 40, generator=torch.Generator().manual_seed(3), **kw))
    seen = []
    handle = shipped_model.hook_points()["blocks.5.attn.hook_pattern"].add_hook(
        lambda pattern, hook: seen.append((hook.name, hook.layer, pattern.shape[2]))
    )
    try:
        hooked = list(shipped_model.generate_stream(prompt, 40, generator=torch.Generator().manual_seed(3), **kw))
    finally:
        handle.remove()
    assert [s.token for s in hooked] == [s.token for s in plain]
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(hooked, plain))
    for a, b in zip(hooked, plain):
        assert all(torch.equal(ra, rb) for ra, rb in zip(a.pattern_rows, b.pattern_rows))
    assert seen[0] == ("blocks.5.attn.hook_pattern", 5, 30) and [q for *_, q in seen[1:]] == [1] * 39
    assert hooked[-1].kv_computed == plain[-1].kv_computed == 30 + 39


def test_sampling_draws_each_token_at_its_probability():
    """``sample_next`` (one uniform number through the cumulative distribution) against the softmax: 40,000
    draws from five tokens, each count within 5 standard errors of its expectation (a false alarm about once in
    a million runs), a token below ``top_k`` never drawn, and the same generator seed the same tokens."""
    from storylens.model.gpt import sample_next

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    g = torch.Generator().manual_seed(0)
    n = 40_000
    draws = torch.cat([sample_next(logits, generator=g) for _ in range(n)])
    p = torch.softmax(logits[0].double(), -1)
    counts = torch.bincount(draws, minlength=5).double()
    se = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 5 * se + 1).all(), (counts, n * p)
    kept = torch.cat([sample_next(logits, top_k=2, generator=g) for _ in range(2000)])
    assert set(kept.tolist()) == {0, 1}
    again = [torch.Generator().manual_seed(3) for _ in range(2)]
    assert [int(sample_next(logits, generator=again[0])) for _ in range(50)] == [
        int(sample_next(logits, generator=again[1])) for _ in range(50)
    ]


def test_direct_calls_still_run_every_hook(tmp_path):
    """The model's layers skip ``nn.Module``'s dispatch only where nothing would run: a forward hook on a linear
    layer, a pre-hook on a block and a global hook all still fire; a saved folder holds contiguous ``[out, in]``
    weights and loads back to the same logits."""
    from storylens.model.gpt import GPT, GPTConfig
    from storylens.model.hub import load_model, save_model_folder, stored_weights

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
    ids = torch.randint(0, 4096, (1, 8))
    seen = []
    handles = [
        model.transformer.h[1].attn.query.register_forward_hook(lambda m, a, o: seen.append("query")),
        model.transformer.h[0].register_forward_pre_hook(lambda m, a: seen.append("block")),
        torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append("global")),
    ]
    model(ids)
    for h in handles:
        h.remove()
    assert "query" in seen and "block" in seen and seen.count("global") > 20
    seen.clear()
    model(ids)
    assert seen == []
    weights = stored_weights(model)
    assert "transformer.wte.weight" not in weights and all(w.is_contiguous() for w in weights.values())
    assert weights["transformer.h.0.attn.query.weight"].shape == (32, 32)
    back = load_model(save_model_folder(model, load_model().tokenizer, tmp_path / "m"))
    assert back.lm_head.weight is back.transformer.wte.weight
    assert torch.equal(back(ids).logits, model(ids).logits)
