"""The truth table's ablation budget: the passes it counts are the passes the ablations and the scoring
run, and the stories it picks are the most that fit."""

import pytest

from storylens.data.names import name_vocabulary
from storylens.effects.cost import TRUTH_BUDGET, TRUTH_FLOOR_FLOPS, block_flops, head_flops, scoring_flops
from storylens.engine.encode import encode_stories
from storylens.lm import NativeLM
from storylens.looking.induction import lm_sequences
from storylens.table.scores import score_heads
from storylens.table.truth import ablation_flops, ablation_passes, truth_budget_stories, truth_table


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
    probe = lm_sequences(lm).numel()  # the induction test's one forward (the column induction_random)
    assert seen == {"blocks": lm.n_layer * (sum(lengths[:5]) + probe), "heads": 0}
    assert scoring_flops(lm, lengths[:5]) == pytest.approx(
        (seen["blocks"] - lm.n_layer * probe) * block_flops(lm), rel=1e-12
    )


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


# ---------------------------------------------------------------- with --causal: AtP for every head, exact where audited


@pytest.fixture(scope="module")
def causal_truth(shipped_model, corpus_split):
    from storylens.effects.audit import audit_stories
    from storylens.table.truth import with_causal

    lm = NativeLM(shipped_model)
    quiz = corpus_split.quiz[:10]
    encoded = encode_stories(lm, quiz, name_vocabulary(quiz))
    scores = score_heads(lm, encoded, progress=False, causal=True)
    truth = truth_table(lm, scores, encoded, n_stories=2)
    a = audit_stories(lm, encoded[:2], k=1, seed=0)
    exact = {r.head: (r.exact_mean.nats, r.exact_mean.se) for r in a.rows}
    return scores, truth, a, exact, with_causal(truth, scores, exact, a.n_stories)


def test_without_causal_the_table_has_no_causal_key(causal_truth):
    _, truth, *_ = causal_truth
    assert truth.causal is None and "causal" not in truth.to_dict()


def test_every_row_gets_atp_with_its_error_and_exact_where_audited(causal_truth):
    from storylens.table.truth import Truth

    scores, truth, a, exact, t = causal_truth
    c = t.causal
    assert c.atp_stories == scores.n_stories == 10 and c.exact_stories == a.n_stories == 2
    assert [(e.detector, e.head) for e in c.rows] == [(r.detector, r.head) for r in truth.rows]
    for e in c.rows:
        h = scores.head(e.head)
        assert (e.atp, e.atp_se) == (h["atp_mean"], h["atp_mean_se"])
        assert (e.exact, e.exact_se) == exact.get(e.head, (None, None))
    assert {d for d, _ in c.rho} == {ag.detector for ag in truth.agreements}
    assert Truth.from_dict(t.to_dict()) == t  # summary.json reads back


def test_the_sentences_say_no_sign_within_two_errors_and_how_many_stories(causal_truth):
    from storylens.effects.cost import effect_text

    *_, t = causal_truth
    assert effect_text(0.01, 0.005) == "no clear effect (+0.0100 ± 0.0050)"  # exactly two errors: no sign
    assert effect_text(-0.0101, 0.005) == "-0.0101 ± 0.0050"
    assert effect_text(0.01, float("nan")) == "+0.0100 (no error: one story)" and effect_text(None, None) == ""
    for e in t.causal.rows:
        if e.head != t.rows[[r.detector for r in t.rows].index(e.detector)].head:
            continue  # each detector's sentence is about its strongest head
        line = next(s for s in t.sentences if s.startswith(f"{e.detector}:"))
        assert "by AtP over 10 stories, replacing its output by its mean " in line
        clear = f"changes the mean next-token loss by {e.atp:+.4f} ± {e.atp_se:.4f} nats"
        unclear = f"has no clear effect on the mean next-token loss ({e.atp:+.4f} ± {e.atp_se:.4f} nats)"
        assert (clear if abs(e.atp) > 2 * e.atp_se else unclear) in line
        assert "switching it off changes the loss" not in line  # the ablations' numbers carry no error
        if e.exact is not None:
            assert f"(exactly, on the 2 audited: {effect_text(e.exact, e.exact_se)} nats)" in line
