"""The model on the real shipped weights and real quiz stories."""

import torch

from storylens.model import GPT, GPTConfig, KVCache, head_label, parse_head_label


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


@torch.no_grad()
def test_fused_and_explicit_paths_agree_on_every_quiz_story(shipped_model, quiz_ids):
    worst_logit, worst_row = 0.0, 0.0
    for ids in quiz_ids:
        idx = torch.tensor([ids])
        fused = shipped_model(idx)
        explicit = shipped_model(idx, record_attention=True)
        assert fused.attentions is None
        worst_logit = max(worst_logit, (fused.logits - explicit.logits).abs().max().item())
        T = len(ids)
        above = torch.ones(T, T, dtype=torch.bool).triu(1)
        for att in explicit.attentions:
            assert att.shape == (1, 4, T, T)  # [batch, head, query, key]
            worst_row = max(worst_row, (att.sum(-1) - 1).abs().max().item())
            assert (att[..., above] == 0).all()  # the causal mask: exactly zero, not just small
    assert worst_logit <= 2e-5, worst_logit
    assert worst_row <= 1e-6, worst_row


@torch.no_grad()
def test_prefix_keys_and_values_equal_the_full_run(shipped_model, quiz_ids):
    ids = torch.tensor([quiz_ids[0]])
    full, prefix = KVCache.empty(6), KVCache.empty(6)
    shipped_model(ids, kv_cache=full)
    n = ids.shape[1] // 2
    shipped_model(ids[:, :n], kv_cache=prefix)
    worst = 0.0
    for b in range(6):
        for a, f in ((prefix.key[b], full.key[b]), (prefix.value[b], full.value[b])):
            worst = max(worst, (a - f[:, :, :n]).abs().max().item())
    # Matrix-multiply blocking may round differently for another number of rows; the
    # spec saw exact equality. Bound it tightly instead of demanding the last bit.
    assert worst <= 1e-6, worst


def _generate_both_ways(model, n=200, seed=7):
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    prompt = torch.tensor([[0]])  # the end-of-story marker opens every story
    cached = list(model.generate_stream(prompt, n, temperature=1.0, generator=g1))
    full = list(model.generate_stream(prompt, n, temperature=1.0, generator=g2, use_kv_cache=False))
    worst = max((a.logits - b.logits).abs().max().item() for a, b in zip(cached, full))
    return cached, full, worst


@torch.no_grad()
def test_kv_cached_generation_matches_full_recomputation(shipped_model):
    cached, full, worst = _generate_both_ways(shipped_model)
    assert [s.token for s in cached] == [s.token for s in full]
    # In float32 a one-row matrix multiply (the cache) and a many-row one (recomputing)
    # sum in different orders: the logits (magnitude ~10) differ in the last bits.
    # Measured on the shipped model: 1.1e-5, above the lesson's 3e-7; see the float64 test below.
    assert worst <= 5e-5, worst
    # Ella's shelf: 200 key/value computations instead of 1 + 2 + ... + 200 = 20,100
    assert cached[-1].kv_computed == 200
    assert full[-1].kv_computed == 20100


@torch.no_grad()
def test_kv_cache_is_exact_up_to_rounding_in_float64(shipped_model):
    import copy

    model64 = copy.deepcopy(shipped_model).double()
    cached, full, worst = _generate_both_ways(model64)
    assert [s.token for s in cached] == [s.token for s in full]
    assert worst <= 3e-7, worst  # the lesson's bound, met with room to spare once rounding is out of the way


@torch.no_grad()
def test_recorded_generation_yields_the_new_tokens_attention_row(shipped_model, quiz_ids):
    prompt = torch.tensor([quiz_ids[3][:20]])
    steps = list(shipped_model.generate_stream(prompt, 5, temperature=0, record_attention=True))
    seq = torch.cat([prompt, torch.tensor([[s.token for s in steps[:-1]]])], dim=1)
    ref = shipped_model(seq, record_attention=True).attentions
    last = steps[-1]
    assert len(last.attention) == 6 and last.attention[0].shape == (4, seq.shape[1])
    for b in range(6):
        assert torch.allclose(last.attention[b], ref[b][0, :, -1, :], atol=1e-6)


def test_generation_refuses_to_pass_the_window(shipped_model):
    import pytest

    with pytest.raises(ValueError, match="window"):
        next(shipped_model.generate_stream(torch.zeros(1, 200, dtype=torch.long), 57))


def test_config_round_trip_rejects_bad_fields():
    import pytest

    assert GPTConfig.from_dict(GPTConfig().to_dict()) == GPTConfig()
    with pytest.raises(ValueError):
        GPTConfig.from_dict({"n_embd": 250, "n_head": 4})
    with pytest.raises(ValueError):
        GPTConfig.from_dict({"colour": "blue"})


def test_fresh_model_is_random_not_the_shipped_one(shipped_model):
    fresh = GPT(GPTConfig())
    assert not torch.equal(fresh.lm_head.weight, shipped_model.lm_head.weight)
