"""The truth table's ablation budget: the passes it counts are the passes the ablations and the scoring
run, and the stories it picks are the most that fit."""

import pytest

from storylens.analysis.encode import encode_stories
from storylens.analysis.names import name_vocabulary
from storylens.analysis.scores import score_heads
from storylens.analysis.truth import (
    TRUTH_BUDGET,
    TRUTH_FLOOR_FLOPS,
    ablation_flops,
    ablation_passes,
    block_flops,
    head_flops,
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


def _count_passes(lm, run) -> dict:
    """Tokens through every block's attention and through the output head while ``run()`` runs."""
    seen = {"blocks": 0, "heads": 0}

    def counter(key):
        def count(module, inputs, output):
            x = inputs[0]
            seen[key] += x.shape[0] * x.shape[1]

        return count

    handles = [b.attn.register_forward_hook(counter("blocks")) for b in lm.blocks()]
    handles.append(lm.module.lm_head.register_forward_hook(counter("heads")))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def test_the_counted_work_is_the_passes_the_ablations_and_the_scoring_run(scored):
    """Every block's attention and the output head, counted token by token while the table is made
    and while the stories are scored (one story a batch, so no padding), are what the budget charges."""
    lm, encoded, scores = scored
    lengths = [len(e.ids) for e in encoded]
    seen = _count_passes(lm, lambda: truth_table(lm, scores, encoded, n_stories=3, batch_size=1))
    passes = ablation_passes(lm, scores)
    assert seen == {"blocks": passes.blocks * sum(lengths[:3]), "heads": passes.heads * sum(lengths[:3])}
    assert sum(ablation_flops(lm, scores, lengths[:3])) == pytest.approx(
        seen["blocks"] * block_flops(lm) + seen["heads"] * head_flops(lm), rel=1e-12
    )
    seen = _count_passes(lm, lambda: score_heads(lm, encoded[:5], batch_size=1, progress=False))
    assert seen == {"blocks": lm.n_layer * sum(lengths[:5]), "heads": 0}
    assert scoring_flops(lm, lengths[:5]) == pytest.approx(seen["blocks"] * block_flops(lm), rel=1e-12)


def test_the_budget_picks_the_most_stories_that_fit(scored):
    lm, encoded, scores = scored
    lengths = [len(e.ids) for e in encoded]
    work = ablation_flops(lm, scores, lengths)
    scoring = scoring_flops(lm, lengths)
    for n in (1, 5, 12):  # a budget of exactly n stories' work, and a hair less
        exact = sum(work[:n]) / scoring
        assert truth_budget_stories(lm, scores, lengths, budget=exact * (1 + 1e-12), floor_flops=0.0) == n
        assert truth_budget_stories(lm, scores, lengths, budget=exact * (1 - 1e-9), floor_flops=0.0) == max(1, n - 1)
        assert truth_budget_stories(lm, scores, lengths, budget=0.0, floor_flops=sum(work[:n])) == n
    assert truth_budget_stories(lm, scores, lengths, budget=1e-9, floor_flops=0.0) == 1  # never none
    assert truth_budget_stories(lm, scores, lengths, budget=100.0, max_stories=7) == 7
    assert truth_budget_stories(lm, scores, lengths, max_stories=0) == 0
    n = truth_budget_stories(lm, scores, lengths, max_stories=len(lengths))  # the defaults
    allowed = max(TRUTH_BUDGET * scoring, TRUTH_FLOOR_FLOPS)
    assert sum(work[:n]) <= allowed and (n == len(lengths) or sum(work[: n + 1]) > allowed)
