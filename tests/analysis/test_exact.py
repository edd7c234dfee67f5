"""Every head's exact effect over a corpus (storylens.effects.exact) as ``score --exact`` measures it: resample
ablation against the donor's outputs put in by hand (a pre-hook on the output projection's input, GPT-2, GPT-Neo,
Llama with grouped key/value heads and the native model, float64); the donors' draw; the recording pass against
the same passes run on a list; a run resumed from its state equal to one run; the budget said and refused."""

import json

import jsonschema
import pytest
import torch

pytest.importorskip("transformers")

from tiny_lms import KINDS, head_inputs, loss_change, tiny_lm

from storylens.core.errors import StorylensError, UsageError
from storylens.core.schema import schema
from storylens.corpus.score import score_corpus
from storylens.data.names import name_vocabulary
from storylens.data.sources import open_source
from storylens.effects.ablation import head_output_means
from storylens.effects.exact import EXACT_MODES, ExactPlan, draw_donors, exact_cost, exact_head_effects
from storylens.engine.encode import EncodedStory, encode_stories
from storylens.engine.record import record
from storylens.lm import NativeLM
from storylens.table.accumulator import HeadScoreAccumulator

WORDS = (30, 22, 30, 14, 26, 9)  # stories of several lengths: some donors shorter than their receiver


@pytest.fixture(scope="module", params=KINDS)
def lm(request, shipped_model, tmp_path_factory):
    return tiny_lm(request.param, shipped_model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ids(lm, corpus_split):
    return [lm.encode(" ".join(s.split()[:n])) for s, n in zip(corpus_split.quiz, WORDS)]


def _records(ids, first=0):
    return [EncodedStory(first + i, tuple(s), False, None, (), ()) for i, s in enumerate(ids)]


def test_resample_puts_in_the_donors_own_outputs(lm, ids):
    """Resample ablation with a fixed seed equals the computation by hand: each story's donor (drawn by
    draw_donors) run alone, the head's output projection input read at the donor's positions (position t,
    past the donor's end its positions again from 1) and put in the story's place after position 0. The same
    float64 operations batched otherwise: sums of a few hundred token losses of order 10 round far under 1e-9."""
    seed = 7
    acc = exact_head_effects(lm, ids, ("resample",), seed=seed, batch_size=4)
    chunk = _records(ids)
    donors = draw_donors(chunk, chunk, seed)
    assert any(len(d.ids) < len(s) for d, s in zip(donors, ids))  # the wrap past a donor's end is checked too
    for layer, head in [(0, 1), (lm.n_layer - 1, lm.n_head - 1)]:
        per = []
        for story, donor in zip(ids, donors):
            z = head_inputs(lm, list(donor.ids), layer, head)  # [donor length, d]
            t, n = torch.arange(1, len(story)), len(donor.ids)
            per.append(loss_change(lm, story, layer, head, z[torch.where(t < n, t, 1 + (t - 1) % (n - 1))]))
        expected = sum(c for c, _ in per) / sum(t for _, t in per)
        assert abs(acc.columns()["exact_resample"][layer, head].item() - expected) <= 1e-9, (layer, head)
    assert acc.counts() == {"resample": len(ids)}


def test_donors_are_other_stories_drawn_by_seed_and_index():
    """Another story, as long or longer where one is; the same draw in any order of the chunk; another seed
    another draw; a story alone in its chunk has none."""
    lengths = [5, 9, 9, 3, 7, 1, 4, 6, 8, 2] * 5
    chunk = [EncodedStory(i, tuple(range(n)), False, None, (), ()) for i, n in enumerate(lengths)]
    drawn = draw_donors(chunk, chunk, 0)
    for s, d in zip(chunk, drawn):
        assert d is not None and d.index != s.index and len(d.ids) >= max(2, min(len(s.ids), 9))
    assert [d.index for d in draw_donors(chunk[::-1], chunk, 0)] == [d.index for d in drawn]
    assert [d.index for d in draw_donors(chunk, chunk, 1)] != [d.index for d in drawn]
    assert draw_donors(chunk[:1], chunk[:1], 0) == [None]


@pytest.fixture(scope="module")
def native(shipped_model):
    return NativeLM(shipped_model)


@pytest.fixture(scope="module")
def quiz(native, corpus_split):
    texts = [" ".join(s.split()[:40]) for s in corpus_split.quiz[:8]]  # short: every head, three modes, cheap
    names = frozenset(name_vocabulary(texts))
    encoded = encode_stories(native, texts, names)
    means = head_output_means(native, [e.ids for e in encoded], include_marker=False)
    return texts, names, encoded, ExactPlan(EXACT_MODES, means, len(encoded), seed=3)


def _recorded(lm, texts, names, plan, chunk, start=0, estimator=None):
    acc = HeadScoreAccumulator(lm.n_layer, lm.n_head, exact=plan, estimator=estimator)
    record(lm, texts, [acc], batch_size=4, chunk_stories=chunk, names=names, progress=False, start=start)
    return acc


@pytest.mark.slow  # every head of the shipped model rerun in three modes, twice over
def test_the_recording_pass_measures_what_the_list_function_does(native, quiz):
    """score's pass (the head table's accumulator, its exact part rerunning each batch after the recording)
    and exact_head_effects on the same encoded stories: the same batches, the same operations."""
    texts, names, encoded, plan = quiz
    acc = _recorded(native, texts, names, plan, chunk=8)
    ref = exact_head_effects(native, [e.ids for e in encoded], EXACT_MODES, means=plan.means, seed=3, batch_size=4)
    cols = acc.columns(False)
    for name, col in ref.columns().items():
        assert (cols[name] - col).abs().max().item() <= 1e-9, name
    assert ref.columns()["exact_mean"].abs().min() > 0  # measured, not left at zero


@pytest.mark.slow  # every head of the shipped model rerun over stories, a run of score too
def test_a_resumed_run_equals_one_run(native, quiz):
    """Two chunks: the first's state through JSON (a checkpoint), merged with the second, equals one run (the
    exact columns and an estimator's beside them); a state ablated to other means is refused."""
    texts, names, _, plan = quiz
    whole = _recorded(native, texts, names, plan, chunk=4, estimator="atp").columns(False)
    first = json.loads(json.dumps(_recorded(native, texts[:4], names, plan, chunk=4, estimator="atp").state()))
    resumed = HeadScoreAccumulator(native.n_layer, native.n_head, exact=plan, estimator="atp").load_state(first)
    second = _recorded(native, texts[4:], names, plan, chunk=4, start=4, estimator="atp")
    merged = resumed.merge(second).columns(False)
    columns = [f"{k}_{m}{s}" for k in ("exact", "atp") for m in EXACT_MODES for s in ("", "_se")]
    for name in columns:
        assert (merged[name] - whole[name]).abs().max().item() <= 1e-9, name
    other = ExactPlan(EXACT_MODES, plan.means + 1.0, 8, seed=3)
    with pytest.raises(ValueError, match="other heads, modes or means"):
        HeadScoreAccumulator(native.n_layer, native.n_head, exact=other, estimator="atp").load_state(first)
    with pytest.raises(ValueError, match="estimate columns kept in one"):
        HeadScoreAccumulator(native.n_layer, native.n_head, exact=plan).load_state(first)


def test_the_stories_past_exact_stories_are_not_ablated(native, quiz):
    texts, names, _, plan = quiz
    three = ExactPlan(plan.modes, plan.means, plan.mean_stories, stories=3, seed=3)
    acc = _recorded(native, texts, names, three, chunk=8)
    assert acc.exact is not None and acc.exact.acc.counts() == dict.fromkeys(EXACT_MODES, 3)
    with pytest.raises(StorylensError, match="--exact-stories"):
        ExactPlan(("zero",), stories=0)
    with pytest.raises(StorylensError, match="needs the heads' means"):
        ExactPlan(("mean",))


@pytest.mark.slow  # every head of the shipped model rerun over stories, a run of score too
def test_the_cost_is_said_and_past_the_budget_refused(native, corpus_split, tmp_path, monkeypatch):
    """Counted as the other ablations are: per mode every head reruns the blocks from its own; past the budget
    the refusal names how many stories would fit."""
    L, H = native.n_layer, native.n_head
    one = exact_cost(native, 100.0, ("zero",)).passes
    assert one == pytest.approx(1 + H * (L + 1) / 2)  # the clean run, then head h of block l: (L - l) / L
    two = exact_cost(native, 100.0, ("zero", "resample")).passes
    assert two == pytest.approx(one + 1 + H * (L + 1) / 2)  # and the donors' run
    path = tmp_path / "s.txt"
    path.write_text("".join(f"{s}\n<|endoftext|>\n" for s in corpus_split.quiz[:6]))
    per_story = exact_cost(native, 180.0, ("mean",)).flops
    monkeypatch.setattr("storylens.corpus.exact_plan.ABLATION_LIMIT_FLOPS", 2.5 * per_story)
    with pytest.raises(UsageError, match=r"pass --exact-stories \d+ \(fits it\) or --over-budget"):
        score_corpus(native, open_source(path), tmp_path / "out", exact=("mean",), progress=False, examples=0)
    run = score_corpus(native, open_source(path), tmp_path / "out", exact=("mean",), exact_stories=2, progress=False)
    assert run.summary.exact is not None and run.summary.exact.stories == {"mean": 2}
    assert run.summary.exact.mean_stories == 2  # the mean over the stories measured, not a sample
    assert all(h.scores["exact_mean"] is not None for h in run.scores.heads)
    monkeypatch.undo()
    est = score_corpus(
        native, open_source(path), tmp_path / "est", exact=("zero",), exact_stories=3, estimator="quadratic",
        progress=False, examples=0,
    )  # fmt: skip
    (audit,) = est.summary.estimators
    assert (audit.estimator, audit.mode, audit.n_stories, audit.heads) == ("quadratic", "zero", 3, 24)
    assert audit.rho is not None and audit.missed is not None
    summary = json.loads((tmp_path / "est" / "summary.json").read_text())
    jsonschema.Draft202012Validator(schema("summary-score")).validate(summary)
    assert summary["estimators"][0]["estimator"] == "quadratic"


def test_the_atp_audit_measures_the_atp_columns_where_the_exact_effect_ran(shipped_model, corpus_split, tmp_path):
    """score --causal audits its AtP columns against the exact effect: AtP is measured again (the estimators'
    slopes, storylens.effects.estimators) on the stories the exact effect covers, with its means. Where those are
    every story, the two implementations measure one quantity: the gradient pass's sums (mu . G - A per story)
    and the slope of the loss along z + a (mu - z) at a = 0, in float64 on sums of a few hundred terms of order
    1, so equal far within 1e-9. Over the first 3 stories only, the audit counts 3."""
    lm = tiny_lm("llama", shipped_model, tmp_path)
    texts = [" ".join(s.split()[:40]) for s in corpus_split.quiz[:8]]
    names = frozenset(name_vocabulary(texts))
    encoded = encode_stories(lm, texts, names)
    means = head_output_means(lm, [e.ids for e in encoded], include_marker=False)
    for stories in (None, 3):
        plan = ExactPlan(("mean",), means, len(encoded), stories=stories)
        acc = HeadScoreAccumulator(lm.n_layer, lm.n_head, causal=True, exact=plan, audit_atp=True)
        record(lm, texts, [acc], batch_size=4, chunk_stories=8, names=names, progress=False)
        audit = acc.effects.atp_audit
        assert audit is not None and audit.acc.counts() == {"mean": 0}  # the audit alone: no columns of its own
        assert audit.audited.counts() == {"mean": stories or len(encoded)}
        if stories is None:
            got, ref = audit.audited.columns(), acc.causal.columns()
            assert ref["atp_mean"].abs().max() > 1e-6  # measured, not zeros compared
            for name in ("atp_mean", "atp_mean_se"):
                assert (got[name] - ref[name]).abs().max().item() <= 1e-9, name
        state = json.loads(json.dumps(acc.state()))
        again = HeadScoreAccumulator(lm.n_layer, lm.n_head, causal=True, exact=plan, audit_atp=True).load_state(state)
        assert again.effects.atp_audit.audited.state() == audit.audited.state()


@pytest.mark.slow  # the shipped model scored three times over six stories, with its exact effect
def test_causal_alone_measures_the_exact_effect_within_budget(native, corpus_split, tmp_path, monkeypatch, capsys):
    """score --causal: every head's exact effect in mean ablation on the first stories the budget allows (here
    every one of six) and AtP audited against it; --exact-stories N asks for N; where not one story fits the
    budget it says so, and the AtP columns stand unaudited."""
    from storylens.cli import main

    path = tmp_path / "s.txt"
    path.write_text("".join(f"{' '.join(s.split()[:60])}\n<|endoftext|>\n" for s in corpus_split.quiz[:6]))
    run = score_corpus(native, open_source(path), tmp_path / "a", causal=True, progress=False, examples=0)
    exact = run.summary.exact
    assert exact is not None and (exact.chosen, exact.stories, exact.limit) == ("budget", {"mean": 6}, None)
    (audit,) = run.summary.estimators
    assert (audit.estimator, audit.mode, audit.n_stories, audit.heads) == ("atp", "mean", 6, 24)
    assert all(h.scores["exact_mean"] is not None and h.scores["atp_mean"] is not None for h in run.scores.heads)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    jsonschema.Draft202012Validator(schema("summary-score")).validate(summary)
    assert summary["exact"]["chosen"] == "budget"
    two = score_corpus(native, open_source(path), tmp_path / "b", causal=True, exact_stories=2, progress=False)
    assert two.summary.exact is not None and (two.summary.exact.chosen, two.summary.exact.stories) == (
        "asked", {"mean": 2},
    )  # fmt: skip
    monkeypatch.setattr("storylens.corpus.exact_plan.TRUTH_FLOOR_FLOPS", 1.0)  # and 20% of the pass fits none
    capsys.readouterr()
    argv = ["score", "--stories", str(path), "--out", str(tmp_path / "c"), "--causal", "--no-progress"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "not one story fits the default budget" in err and "the AtP columns are unaudited" in out
    assert "exact" not in json.loads((tmp_path / "c" / "summary.json").read_text())
