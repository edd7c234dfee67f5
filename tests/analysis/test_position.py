"""Matched-distance control for name mass, on hand-built attention maps."""

import math

import pytest
import torch

from storylens.looking.position import PositionControlAccumulator, distance_profile, distance_sums, position_control


def causal(rows):
    """A [1, T, T] map from its lower-triangle rows (row q has q + 1 entries, summing to 1)."""
    T = len(rows)
    a = torch.zeros(1, T, T, dtype=torch.float64)
    for q, r in enumerate(rows):
        assert len(r) == q + 1 and math.isclose(sum(r), 1.0)
        a[0, q, : q + 1] = torch.tensor(r, dtype=torch.float64)
    return a


# Story A: T = 5, name token at 2 (first mention 2); queries 3 and 4, weight 1/2 each.
STORY_A = causal(
    [
        [1.0],
        [0.5, 0.5],
        [0.2, 0.3, 0.5],
        [0.1, 0.2, 0.5, 0.2],  # q=3: name (k=2) at d=1 gets 0.5; k=1 (d=2) 0.2
        [0.1, 0.1, 0.3, 0.2, 0.3],  # q=4: name at d=2 gets 0.3; k=3 (d=1) 0.2, k=1 (d=3) 0.1
    ]
)


def test_story_a_by_hand():
    r = position_control(STORY_A, [2])
    # name mass: mean(0.5, 0.3)
    assert r.name_mass.item() == pytest.approx(0.4)
    # profile (marker skipped): P(1) = 0.2 (q4,k3), P(2) = 0.2 (q3,k1), P(3) = 0.1 (q4,k1)
    # control: q3 has its name at d=1 -> P(1) = 0.2; q4 at d=2 -> P(2) = 0.2; mean 0.2
    assert r.control.item() == pytest.approx(0.2)
    assert r.excess.item() == pytest.approx(0.2)
    assert r.ratio.item() == pytest.approx(2.0)
    # even spread: q3 -> 1/4, q4 -> 1/5
    assert r.even_spread == pytest.approx((0.25 + 0.2) / 2)
    assert r.unmatched_share == 0.0
    assert (r.n_stories, r.n_queries) == (1, 2)


def test_per_distance_sums_story_a():
    s = distance_sums(STORY_A, [2])
    assert s.name_weight.tolist() == pytest.approx([0, 0.5, 0.5, 0, 0])
    assert s.name_sum[0, 0].tolist() == pytest.approx([0, 0.25, 0.15, 0, 0])
    # control pairs: (4,3) d1, (3,1) d2, (4,1) d3, each weight 1/2
    assert s.control_weight.tolist() == pytest.approx([0, 0.5, 0.5, 0.5, 0])
    assert s.control_sum[0, 0].tolist() == pytest.approx([0, 0.1, 0.1, 0.05, 0])


# Story B: T = 4, name at 1: query 2 has no non-name key before it but the marker.
STORY_B = causal(
    [
        [1.0],
        [0.4, 0.6],
        [0.3, 0.5, 0.2],  # q=2: name at d=1 gets 0.5; only the marker (d=2) otherwise
        [0.2, 0.4, 0.1, 0.3],  # q=3: name at d=2 gets 0.4; k=2 (d=1) 0.1; marker (d=3) 0.2
    ]
)


def test_missing_distance_takes_nearest():
    r = position_control(STORY_B, [1])
    assert r.name_mass.item() == pytest.approx((0.5 + 0.4) / 2)
    # marker skipped: the only control pair is (3,2) at d=1, P(1) = 0.1; d=2 has none and
    # takes d=1's 0.1. Control = mean(P(1), P(2)) = 0.1; half the name weight unmatched.
    assert r.control.item() == pytest.approx(0.1)
    assert r.unmatched_share == pytest.approx(0.5)


def test_marker_can_be_a_control():
    r = position_control(STORY_B, [1], skip_marker=False)
    # now (2,0) d=2 a=0.3 and (3,0) d=3 a=0.2 count: P(1) = 0.1, P(2) = 0.3
    assert r.control.item() == pytest.approx((0.1 + 0.3) / 2)
    assert r.unmatched_share == 0.0


def test_profile_gap_between_two_neighbours_is_their_mean():
    s = torch.tensor([[[0.0, 0.2, 0.0, 0.6, 0.0]]], dtype=torch.float64)
    w = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    prof, gaps = distance_profile(s, w)
    # P(1) = 0.2, P(3) = 0.3; d=2 equidistant -> 0.25; d=4 -> 0.3; d=0 -> P(1)
    assert prof[0, 0].tolist() == pytest.approx([0.2, 0.2, 0.25, 0.3, 0.3])
    assert gaps.tolist() == [True, False, True, False, True]


def test_first_mention_and_multi_token_names():
    # T = 6, the name is two tokens (2, 3); first mention 2 -> queries 4, 5
    a = causal(
        [
            [1.0],
            [0.5, 0.5],
            [0.4, 0.3, 0.3],
            [0.1, 0.1, 0.4, 0.4],
            [0.1, 0.1, 0.2, 0.4, 0.2],  # q4: name keys 2 (d2) 0.2, 3 (d1) 0.4; k1 (d3) 0.1
            [0.1, 0.1, 0.1, 0.3, 0.2, 0.2],  # q5: name 2 (d3) 0.1, 3 (d2) 0.3; k4 (d1) .2, k1 (d4) .1
        ]
    )
    r = position_control(a, [2, 3])
    assert r.name_mass.item() == pytest.approx(((0.2 + 0.4) + (0.1 + 0.3)) / 2)
    # P(1) = 0.2 (q5,k4), P(3) = 0.1 (q4,k1), P(4) = 0.1 (q5,k1); P(2): none -> mean(P1, P3) = 0.15
    # q4: P(2) + P(1) = 0.35; q5: P(3) + P(2) = 0.25; control = 0.3
    assert r.control.item() == pytest.approx(0.3)
    # name weight: d1 .5, d2 1.0, d3 .5 -> d2 unmatched: 1.0 / 2.0
    assert r.unmatched_share == pytest.approx(0.5)
    # a later first mention leaves fewer queries: only q5
    r5 = position_control(a, [2, 3], first_mention=4)
    assert r5.name_mass.item() == pytest.approx(0.4)


def test_no_query_gives_none():
    assert position_control(STORY_A, []) is None
    assert position_control(STORY_A, [4]) is None  # nothing after the name


def test_accumulator_pools_profiles_and_averages_stories():
    acc = PositionControlAccumulator(1, 1, window=8)
    assert acc.add(STORY_A, [2])
    assert acc.add(STORY_B, [1])
    assert not acc.add(STORY_A, [])
    r = acc.result()
    assert r.n_stories == 2
    assert r.name_mass.item() == pytest.approx((0.4 + 0.45) / 2)
    # pooled profile (each story's weights sum to 1):
    #   d1: A (4,3) .5 x .2, B (3,2) .5 x .1 -> P(1) = (.1 + .05) / 1 = .15
    #   d2: A (3,1) .5 x .2                  -> P(2) = .2
    # name weight: A d1 .5, d2 .5; B d1 .5, d2 .5 -> control = (P1 + P2) / 2 = .175
    assert r.control.item() == pytest.approx(0.175)
    assert r.unmatched_share == 0.0


def test_blocks_and_batches():
    two = torch.stack([STORY_A, STORY_A.flip(0)])  # [block 2, head 1, 5, 5]
    acc = PositionControlAccumulator(2, 1, window=5)
    # a batch of one padded story: [batch 1, head 1, 7, 7] per block
    padded = [torch.nn.functional.pad(STORY_A, (0, 2, 0, 2))[None] for _ in range(2)]
    assert acc.add_batch(padded, [5], [[2]]) == 1
    r = acc.result()
    assert r.name_mass.shape == (2, 1)
    assert r.name_mass.flatten().tolist() == pytest.approx([0.4, 0.4])
    single = position_control(two, [2])
    assert torch.allclose(single.control, r.control)


def test_rows_and_format():
    r = position_control(STORY_A, [2])
    rows = r.to_rows()
    assert rows[0]["label"] == "L1H1" and rows[0]["excess"] == pytest.approx(0.2)
    assert "L1H1" in r.format()


def test_name_mass_and_even_spread_agree_with_the_head_scores(shipped_model, corpus_split):
    """On real stories the uncontrolled side is exactly the lesson's name mass (scores.py)."""
    from storylens.looking.position import position_control_scores
    from storylens.table.scores import score_heads

    stories = corpus_split.quiz[:12]
    pc = position_control_scores(shipped_model, stories, batch_size=4)
    hs = score_heads(shipped_model, stories, batch_size=4, progress=False)
    mass = torch.tensor(hs.column("name_mass"), dtype=torch.float64).view_as(pc.name_mass)
    assert pc.n_stories == hs.n_name_scored
    from storylens.lesson.checks import probability_bound

    tol = probability_bound(shipped_model.config, torch.float32)  # two equal computations, float32 rounding
    assert (pc.name_mass - mass).abs().max().item() <= tol
    assert pc.even_spread == pytest.approx(hs.name_baseline, abs=tol)
    assert torch.isfinite(pc.control).all() and (pc.control > 0).all()
    assert 0.0 <= pc.unmatched_share < 1.0
