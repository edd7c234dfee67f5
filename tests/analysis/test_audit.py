"""Exact ablation with its error (storylens.effects.audit), against an edit written here: a forward
pre-hook on the output projection's input that replaces one head's slice after the opening token, on
transformers' own modules (GPT-2, Llama with grouped key/value heads) and the native model, float64."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_lms import loss_change, tiny_lm

from storylens.core.errors import StorylensError
from storylens.core.heads import Head
from storylens.effects.ablation import head_output_means
from storylens.effects.audit import MODES, Effect, _sign_disagrees, audit, choose_heads, exact_effects, sign_words
from storylens.effects.exact import ExactAccumulator, copies_at_once, exact_head_effects

STORIES = 6


@pytest.fixture(scope="module", params=["gpt2", "gpt_neo", "llama", "native"])
def lm(request, shipped_model, tmp_path_factory):
    return tiny_lm(request.param, shipped_model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ids(lm, corpus_split):
    return [lm.encode(" ".join(s.split()[:30])) for s in corpus_split.quiz[:STORIES]]


def _by_hand(lm, ids, head: Head, value):
    """Per story: (the change in its summed loss, its predicted tokens), one story at a time, the head's
    slice of the output projection's input replaced after position 0 by a pre-hook written here."""
    return [loss_change(lm, story, head.layer, head.head, value) for story in ids]


def test_exact_effects_equal_the_edit_before_the_output_projection(lm, ids):
    heads = [Head(0, 1), Head(lm.n_layer - 1, lm.n_head - 1)]
    means = torch.randn(lm.n_layer, lm.n_head, lm.head_output_weights(0).shape[1], dtype=torch.float64)
    got = exact_effects(lm, ids, heads, means=means, batch_size=4)  # padded batches of unequal stories
    for h in heads:
        for mode, value in (("mean", means[h.layer, h.head]), ("zero", None)):
            per = _by_hand(lm, ids, h, value)
            n = sum(t for _, t in per)
            want = sum(c for c, _ in per) / n
            resid = [c - want * t for c, t in per]
            se = (len(per) / (len(per) - 1) * sum(r * r for r in resid)) ** 0.5 / n
            e = got[h, mode]
            # float64 sums of a few hundred token losses of order 10: rounding far under 1e-9
            assert abs(e.nats - want) <= 1e-9 and abs(e.se - se) <= 1e-9, (h.label, mode)
            assert e.nats != 0.0


def test_the_default_mean_is_over_positions_after_the_opening_token(lm, ids):
    from storylens.effects.ablation import head_output_means

    h = Head(0, 0)
    means = head_output_means(lm, ids, include_marker=False)
    assert (
        exact_effects(lm, ids, [h], ("mean",))[h, "mean"]
        == exact_effects(lm, ids, [h], ("mean",), means=means)[h, "mean"]
    )


def test_heads_are_chosen_by_their_largest_estimates_and_drawn_apart():
    heads = [Head(layer, h) for layer in range(3) for h in range(4)]
    mean = {h: float(i) * (-1) ** i for i, h in enumerate(heads)}  # |value| grows with the index
    zero = {h: -float(i) for i, h in enumerate(reversed(heads))}
    top, drawn = choose_heads({"mean": mean, "zero": zero}, 2, seed=3)
    assert top == [heads[11], heads[10], heads[0], heads[1]]
    assert not set(top) & set(drawn) and len(drawn) == 2
    assert choose_heads({"mean": mean, "zero": zero}, 2, seed=3) == (top, drawn)  # seeded
    with pytest.raises(StorylensError, match="k must be 0 or more"):
        choose_heads({"mean": mean}, -1, 0)


def test_a_sign_is_said_only_beyond_two_standard_errors():
    assert _sign_disagrees(Effect(0.3, 0.1), Effect(-0.5, 0.2))
    assert not _sign_disagrees(Effect(0.3, 0.1), Effect(-0.3, 0.2))  # exact within 2 se of zero
    assert not _sign_disagrees(Effect(0.3, 0.1), Effect(0.5, 0.2))
    assert not _sign_disagrees(None, Effect(0.5, 0.2))
    assert "no sign" in sign_words(Effect(-0.01, 0.02)) and "no sign" not in sign_words(Effect(-0.05, 0.02))


def test_an_audit_of_estimates_equal_to_the_exact_effects_agrees(lm, ids):
    heads = [Head(layer, h) for layer in range(lm.n_layer) for h in range(lm.n_head)][:6]  # k = 2: 6 to pick from
    exact = exact_effects(lm, ids[:3], heads)
    estimates = {m: {h: exact[h, m] for h in heads} for m in ("mean", "zero")}
    a = audit(lm, ids[:3], estimates, k=2, seed=0)
    assert a.rho_mean == pytest.approx(1.0) and a.rho_zero == pytest.approx(1.0) and a.disagree == ()
    assert a.n_stories == 3 and a.n_tokens == sum(len(s) - 1 for s in ids[:3])
    assert [r.why for r in a.rows].count("random") == 2
    for r in a.rows:
        assert r.exact_mean == estimates["mean"][Head.parse(r.head)]
    flipped = {m: {h: Effect(-e.nats, e.se) for h, e in v.items()} for m, v in estimates.items()}
    b = audit(lm, ids[:3], flipped, k=2, seed=0)
    assert b.rho_mean == pytest.approx(-1.0)
    assert {h for h, _ in b.disagree} == {r.head for r in b.rows if abs(r.exact_mean.nats) > 2 * r.exact_mean.se} | {
        r.head for r in b.rows if abs(r.exact_zero.nats) > 2 * r.exact_zero.se
    }


# ---------------------------------------------------------------- every head at once (storylens.effects.exact)


def test_every_head_at_once_equals_one_head_at_a_time(lm, ids):
    """exact_head_effects (blocks before the head's not rerun, a block's heads as copies of the batch)
    gives each head's effect and error as exact_effects does, head by head on whole forward passes, and
    as the edit before the output projection written here does: the same float64 operations, batched
    otherwise; sums of a few hundred token losses of order 10 round far under 1e-9."""
    heads = [Head(layer, h) for layer in range(lm.n_layer) for h in range(lm.n_head)]
    means = torch.randn(lm.n_layer, lm.n_head, lm.head_output_weights(0).shape[1], dtype=torch.float64)
    one = exact_effects(lm, ids, heads, means=means, batch_size=4)
    per_token = 8 * lm.head_output_weights(0).shape[-1] * 8 + 3 * lm.vocab_size * 4  # copies_at_once's, float64
    three = 3 * 4 * max(map(len, ids)) * per_token  # the first batch (4 longest): 3 heads, then 1
    for budget in (0, three, 1 << 40):  # one copy at a time; groups of 3 and 1; a block's heads together
        cols = exact_head_effects(lm, ids, means=means, batch_size=4, budget=budget).columns()
        for h in heads:
            for mode in MODES:
                e = one[h, mode]
                assert abs(cols[f"exact_{mode}"][h.layer, h.head] - e.nats) <= 1e-9, (h.label, mode, budget)
                assert abs(cols[f"exact_{mode}_se"][h.layer, h.head] - e.se) <= 1e-9, (h.label, mode, budget)
    per = _by_hand(lm, ids, heads[-1], None)
    assert abs(cols["exact_zero"][-1, -1] - sum(c for c, _ in per) / sum(t for _, t in per)) <= 1e-9


def test_copies_at_once_fit_the_budget(lm):
    """A copy's bytes per token: 8 hidden states in the model's dtype and 3 float32 vocabulary rows."""
    width = lm.head_output_weights(0).shape[-1]
    per_token = 8 * width * 8 + 3 * lm.vocab_size * 4  # float64 model
    assert copies_at_once(lm, 100, width, lm.n_head, budget=2 * 100 * per_token) == 2
    assert copies_at_once(lm, 100, width, lm.n_head, budget=2 * 100 * per_token - 1) == 1
    assert copies_at_once(lm, 100, width, lm.n_head, budget=0) == 1
    assert copies_at_once(lm, 100, width, lm.n_head, budget=1 << 40) == lm.n_head


def test_every_head_at_once_ablates_to_the_stories_own_mean_by_default(lm, ids):
    heads = [Head(0, 0), Head(lm.n_layer - 1, 1)]
    one = exact_effects(lm, ids, heads, ("mean",), batch_size=4)
    acc = exact_head_effects(lm, ids, ("mean",), batch_size=4)
    for h in heads:
        assert abs(acc.columns()["exact_mean"][h.layer, h.head] - one[h, "mean"].nats) <= 1e-9
    with pytest.raises(ValueError, match="other means"):
        acc.merge(exact_head_effects(lm, ids[:2], ("mean",), batch_size=4))  # another mean


def test_every_head_at_once_reruns_only_the_blocks_from_the_heads_own(lm, ids):
    """Block j runs once unablated and, per mode, once per group of heads of every block up to j: the
    blocks before a head's are never rerun."""
    blocks = lm.blocks()
    calls = [0] * len(blocks)

    def counted(j, forward):
        def run(*args, **kwargs):
            calls[j] += 1
            return forward(*args, **kwargs)

        return run

    for j, b in enumerate(blocks):  # an instance attribute, as skip_blocks sets and restores its own
        b.forward = counted(j, b.forward)
    try:
        exact_head_effects(lm, ids[:2], ("zero",), batch_size=2, budget=0)  # one head a pass, one batch
    finally:
        for b in blocks:
            del b.forward
    assert calls == [1 + lm.n_head * (j + 1) for j in range(lm.n_layer)]


def test_every_head_at_once_merges_and_restores(lm, ids):
    """Two halves merged equal the whole; a state through JSON restores the same columns."""
    means = head_output_means(lm, ids, include_marker=False)
    whole = exact_head_effects(lm, ids, means=means, batch_size=4)
    half = exact_head_effects(lm, ids[:3], means=means, batch_size=4)
    half.merge(exact_head_effects(lm, ids[3:], means=means, batch_size=4))
    restored = ExactAccumulator.from_state(json.loads(json.dumps(whole.state())))
    assert restored.stories == whole.stories == len(ids)
    for name, col in whole.columns().items():
        assert torch.allclose(half.columns()[name], col, rtol=0, atol=1e-12), name  # sums in another order
        assert torch.equal(restored.columns()[name], col), name
    with pytest.raises(ValueError, match="exact state"):
        ExactAccumulator.from_state({"shape": [1, 1]})
    with pytest.raises(StorylensError, match="modes shuffle"):
        ExactAccumulator(2, 2, ("shuffle",))
    with pytest.raises(StorylensError, match="each one of"):
        ExactAccumulator(2, 2, ("mean", "mean"))
