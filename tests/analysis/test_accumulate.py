"""The pooled per-token ratio and its standard error, streamed and merged (storylens.engine.accumulate)."""

import math

import pytest
import torch

from storylens.engine.accumulate import RatioAccumulator, pooled_ratio


def _direct(c: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ratio estimator written out story by story (float64)."""
    ratio = c.sum(0) / n.sum()
    resid = c - ratio * n[:, None]
    S = len(n)
    return ratio, (S / (S - 1) * (resid**2).sum(0)).sqrt() / n.sum()


def test_streamed_merged_ratio_equals_the_direct_formula():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(37, 5, generator=g, dtype=torch.float64) * 3 + 1
    n = torch.randint(5, 300, (37,), generator=g).to(torch.float64)
    a, b = RatioAccumulator((5,)), RatioAccumulator((5,))
    a.add(c[:20], n[:20])
    b.add(c[20:], n[20:])
    back = RatioAccumulator.from_state(a.merge(b).state(), (5,))
    ratio, se = back.result()
    want_r, want_se = _direct(c, n)
    # float64 sums of 37 terms: relative rounding well under 1e-12 (37 * 2^-53 per sum, a few sums)
    torch.testing.assert_close(ratio, want_r, rtol=1e-12, atol=0)
    torch.testing.assert_close(se, want_se, rtol=1e-9, atol=0)


def test_equal_lengths_give_the_standard_error_of_a_mean():
    c = torch.tensor([[1.0], [2.0], [4.0], [7.0]], dtype=torch.float64)
    n = torch.full((4,), 10.0, dtype=torch.float64)
    ratio, se = pooled_ratio(c.sum(0), n.sum(), (c * c).sum(0), (c * 10).sum(0), (n * n).sum(), 4)
    per_token = c[:, 0] / 10
    assert math.isclose(ratio.item(), per_token.mean().item(), rel_tol=1e-15)
    assert math.isclose(se.item(), (per_token.std() / 2).item(), rel_tol=1e-12)


def test_one_story_has_no_error_and_bad_states_are_refused():
    acc = RatioAccumulator((2,))
    acc.add(torch.ones(1, 2, dtype=torch.float64), torch.tensor([3.0]))
    ratio, se = acc.result()
    assert ratio.tolist() == [1 / 3, 1 / 3] and torch.isnan(se).all()
    state = acc.state()
    state["count"] = -1
    with pytest.raises(ValueError, match="count"):
        RatioAccumulator.from_state(state, (2,))
