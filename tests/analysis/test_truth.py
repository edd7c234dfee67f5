"""The truth table's ablation budget: the work it counts is the work the ablations do, and the stories
it picks are the most that fit."""

import pytest

from storylens.analysis.encode import encode_stories
from storylens.analysis.names import name_vocabulary
from storylens.analysis.scores import score_heads
from storylens.analysis.truth import (
    TRUTH_BUDGET,
    TRUTH_FLOOR_FLOPS,
    ablation_flops,
    block_flops,
    scoring_flops,
    truth_budget_stories,
    truth_table,
)
from storylens.lm import NativeLM


@pytest.fixture(scope="module")
def scored(shipped_model, corpus_split):
    lm = NativeLM(shipped_model)
    quiz = corpus_split.quiz[:40]
    encoded = encode_stories(lm, quiz, name_vocabulary(quiz))
    return lm, encoded, score_heads(lm, encoded, progress=False)


def test_the_counted_work_is_the_blocks_the_ablations_run(scored):
    """Every block's attention, counted token by token while the table is made (one story a batch,
    so no padding), equals what ablation_flops charges for those stories."""
    lm, encoded, scores = scored
    tokens = {"n": 0}

    def count(module, inputs, output):
        x = inputs[0]
        tokens["n"] += x.shape[0] * x.shape[1]

    handles = [b.attn.register_forward_hook(count) for b in lm.blocks()]
    try:
        truth_table(lm, scores, encoded, n_stories=3, batch_size=1)
    finally:
        for h in handles:
            h.remove()
    charged = sum(ablation_flops(lm, scores, [len(e.ids) for e in encoded[:3]])) / block_flops(lm)
    assert tokens["n"] == round(charged)
    assert scoring_flops(lm, [10, 20]) == lm.n_layer * 30 * block_flops(lm)


def test_the_budget_picks_the_most_stories_that_fit(scored):
    lm, encoded, scores = scored
    lengths = [len(e.ids) for e in encoded]
    work = ablation_flops(lm, scores, lengths)
    for budget, floor in ((TRUTH_BUDGET, 0.0), (2.0, 0.0), (0.0, TRUTH_FLOOR_FLOPS), (1e-9, 1.0)):
        allowed = max(budget * scoring_flops(lm, lengths), floor)
        n = truth_budget_stories(lm, scores, lengths, budget=budget, floor_flops=floor, max_stories=30)
        assert 1 <= n <= 30
        assert n == 1 or sum(work[:n]) <= allowed  # at least one story, whatever the budget
        assert n == 30 or sum(work[: n + 1]) > allowed
    assert truth_budget_stories(lm, scores, lengths, budget=100.0, max_stories=7) == 7
    assert truth_budget_stories(lm, scores, lengths, max_stories=0) == 0
