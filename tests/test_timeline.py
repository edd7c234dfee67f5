"""The head timeline of a training run: one entry per evaluation, kept whole across a kill and a
resume, equal to `storylens score` of the exported model; the induction probe on a hand-built
copier; the model size options."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from storylens.cli import main
from storylens.core.errors import StorylensError
from storylens.data.stories import EOT
from storylens.training.checkpoint import load_checkpoint
from storylens.training.copying import COPYING_FILE, read_copying
from storylens.training.timeline import (
    TIMELINE_FILE,
    PositionLosses,
    in_context_score,
    induction_sequences,
    induction_test,
    read_timeline,
)
from storylens.training.train import CHECKPOINT

SHIPPED_TIMELINE = Path(__file__).resolve().parents[1] / "storylens" / "pretrained" / "tiny-storyteller" / TIMELINE_FILE

STEPS, EVERY = 12, 4
COPY_SAMPLES = 4  # stories the finished run writes for its copying check
SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64"]


@pytest.fixture(scope="module")
def slice_files(tmp_path_factory, corpus_split):
    """60 real training stories and the 200 quiz stories: the run's corpus, and the quiz alone."""
    folder = tmp_path_factory.mktemp("timeline")
    stories = corpus_split.train[:60] + corpus_split.quiz
    corpus = folder / "slice.txt"
    corpus.write_text("".join(f"{s}\n{EOT}\n" for s in stories))
    quiz = folder / "quiz.txt"
    quiz.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz))
    return corpus, quiz


def _train(corpus, out, *extra):
    cmd = [sys.executable, "-m", "storylens", "train", "--stories", str(corpus), "--out", str(out)]
    cmd += ["--max-steps", str(STEPS), "--eval-every", str(EVERY), "--batch-size", "2", "--vocab-size", "1024"]
    return cmd + ["--checkpoint-minutes", "0", "--copying-samples", str(COPY_SAMPLES), *SMALL, *extra]


def _step(path: Path) -> int:
    try:
        return load_checkpoint(path)[2]["step"]
    except StorylensError:
        return -1  # being replaced this instant


def _without_seconds(entries):
    return [{k: v for k, v in e.items() if k != "seconds"} for e in entries]


@pytest.fixture(scope="module")
def reference_run(slice_files, tmp_path_factory):
    corpus, _ = slice_files
    out = tmp_path_factory.mktemp("ref") / "run"
    export = out.parent / "model"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(_train(corpus, out, "--export", str(export)), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out, export, done.stdout


def test_one_entry_per_evaluation(reference_run):
    out, _, printed = reference_run
    initial, *entries = read_timeline(out / TIMELINE_FILE)
    assert [e["step"] for e in entries] == list(range(EVERY, STEPS + 1, EVERY))
    assert (initial["step"], initial["tokens"], initial["weights"]) == (0, 0, "initial")  # before any step
    state = json.loads((out / "train_state.json").read_text())
    assert [e["step"] for e in state["evals"]] == [e["step"] for e in entries]
    for e, row in zip(entries, state["evals"]):
        assert e["tokens"] == row["tokens"] == e["step"] * 2 * 256
        assert e["weights"] in ("ema", "raw")
        labels = [h["label"] for h in e["heads"]]
        assert labels == [f"L{b}H{h}" for b in (1, 2) for h in (1, 2)]
        for h in e["heads"]:
            for col in ("name_mass", "prev_token", "prev_argmax", "prev4", "marker", "duplicate_token", "induction"):
                assert 0.0 <= h[col] <= 1.0, (col, h)
        assert math.isclose(e["quiz_perplexity"], math.exp(e["quiz_loss"]))
        # the weights measured are the ones the run would ship: their quiz perplexity is the eval's
        shipped = row["quiz_perplexity_ema"] if e["weights"] == "ema" else row["quiz_perplexity"]
        assert math.isclose(e["quiz_perplexity"], shipped, rel_tol=1e-5)
        assert e["in_context"]["early"] == [16, 31] and e["in_context"]["late_tokens"] > 0
    assert "head timeline: 3 evaluations" in printed and "% of the training steps' time" in printed


def test_the_initial_entry_is_the_seeded_initial_weights(reference_run, slice_files):
    """Step 0 made again afterwards from the run's recipe and seed (scripts/timeline_initial.py's
    way, for a timeline recorded without it) is the line the run wrote before its first step: the
    same weights and code, on the same CPU and thread count, so equal to the last bit."""
    out, _, _ = reference_run
    _, quiz = slice_files
    code = (
        "import json, sys; from storylens.data.stories import read_stories; "
        "from storylens.model.tokenizer import load_tokenizer; "
        "from storylens.training.timeline import initial_entry; from storylens.training.train import TrainConfig; "
        "cfg = TrainConfig(**json.load(open(sys.argv[1]))['train_config']); "
        "e = initial_entry(cfg.model_config(), cfg.seed, load_tokenizer(sys.argv[2]), list(read_stories(sys.argv[3]))); "
        "print(json.dumps(e))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the run was made
    args = [str(out / "train_state.json"), str(out / "tokenizer.json"), str(quiz)]
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    again = json.loads(done.stdout)
    assert _without_seconds([again]) == _without_seconds(read_timeline(out / TIMELINE_FILE)[:1])


def test_the_timeline_ships_with_the_exported_model(reference_run):
    out, export, _ = reference_run
    assert (export / TIMELINE_FILE).read_bytes() == (out / TIMELINE_FILE).read_bytes()
    assert (export / COPYING_FILE).read_bytes() == (out / COPYING_FILE).read_bytes()


def test_a_finished_run_counts_what_it_copies_from_its_training_stories(reference_run, corpus_split):
    from storylens.data.leakage import run_hashes
    from storylens.lm import wrap
    from storylens.model.hub import load_model
    from storylens.training.copying import copied_share, generated_stories

    out, export, printed = reference_run
    copied = read_copying(out)
    assert copied["step"] == STEPS and copied["samples"] == COPY_SAMPLES and copied["run_words"] == 8
    # the same seeds from the exported model write the same stories, and count the same
    stories = generated_stories(wrap(load_model(export)), samples=COPY_SAMPLES, seed=copied["seed"])
    assert stories[0] == copied["example"] and all("<|endoftext|>" not in s for s in stories)
    again = copied_share(stories, run_hashes(corpus_split.train[:60]))
    assert {k: copied[k] for k in again} == again
    assert f"copying: {100 * copied['share']:.1f}% of the 8-word runs in {COPY_SAMPLES} generated stories" in printed


def test_the_copied_share_counts_runs_found_word_for_word():
    from storylens.data.leakage import run_hashes
    from storylens.training.copying import copied_share

    train = ["Once upon a time there was a little girl named Lily who loved to play outside."]
    copied = "Once upon a time there was a little girl named Lily who loved"  # 13 words: 6 runs, all found
    new = "A big red dog ran to the park and ate a green apple."  # 13 words: 6 runs, none found
    half = "Once upon a time there was a little dog"  # 9 words: 2 runs, the first found
    got = copied_share([copied, new, half, "too short"], run_hashes(train))
    assert (got["runs"], got["runs_found"]) == (6 + 6 + 2, 6 + 1)
    assert got["share"] == 7 / 14 and got["max_story_share"] == 1.0 and got["stories_with_runs"] == 3
    assert copied_share(["there was a little girl named Lily who sang"], run_hashes(train))["share"] == 0.5
    assert copied_share(["Once upon a time there was a Little"], run_hashes(train))["share"] == 0.0  # case kept


def test_a_killed_run_resumes_with_the_same_timeline(reference_run, slice_files, tmp_path):
    ref_out, _, _ = reference_run
    corpus, _ = slice_files
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    proc = subprocess.Popen(_train(corpus, run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and _step(run / CHECKPOINT) < EVERY + 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = _step(run / CHECKPOINT)
    assert EVERY < killed_at < STEPS
    assert [e["step"] for e in read_timeline(run / TIMELINE_FILE)][:2] == [0, EVERY]
    done = subprocess.run(_train(corpus, run, "--resume"), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    resumed = read_timeline(run / TIMELINE_FILE)
    assert [e["step"] for e in resumed] == [0, *range(EVERY, STEPS + 1, EVERY)]  # none twice, none missing
    assert _without_seconds(resumed) == _without_seconds(read_timeline(ref_out / TIMELINE_FILE))


def test_an_entry_past_the_checkpoint_is_dropped_on_resume(slice_files, tmp_path):
    """A kill between an evaluation and the next checkpoint leaves an entry the checkpoint has not
    reached: the resumed run drops it (and measures that step again when it gets there)."""
    corpus, _ = slice_files
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    cmd = _train(corpus, run)
    cmd[cmd.index("--max-steps") + 1] = str(EVERY + 1)
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    entries = read_timeline(run / TIMELINE_FILE)
    assert [e["step"] for e in entries] == [0, EVERY, EVERY + 1]  # before any step, every eval_every, the last
    fake = dict(entries[-1], step=EVERY + 4)  # as if step 8 had been measured after the last checkpoint
    (run / TIMELINE_FILE).write_text("".join(json.dumps(e) + "\n" for e in entries + [fake]))
    subprocess.run(cmd + ["--resume"], env=env, check=True, capture_output=True)
    assert _without_seconds(read_timeline(run / TIMELINE_FILE)) == _without_seconds(entries)


def test_the_last_entry_is_storylens_score_of_the_exported_model(reference_run, slice_files, tmp_path):
    out, export, _ = reference_run
    _, quiz = slice_files
    last = read_timeline(out / TIMELINE_FILE)[-1]
    scored = tmp_path / "score"
    assert main(["score", "--model", str(export), "--stories", str(quiz), "--out", str(scored), "--no-progress"]) == 0
    table = json.loads((scored / "heads.json").read_text())
    rows = {h["label"]: h for h in table["heads"]}
    assert len(rows) == len(last["heads"]) == 4
    for h in last["heads"]:
        for col, value in h.items():
            # the same batches and code as storylens score: equal, and within the 1e-6 on any CPU
            if isinstance(value, float) and col in rows[h["label"]]:
                assert abs(value - rows[h["label"]][col]) <= 1e-6, (h["label"], col)
    assert last["counts"]["n_stories"] == table["counts"]["n_stories"] == 200


class Copier:
    """A hand-built model that copies perfectly: at every position past the first copy it puts a
    logit of ``gap`` on the token ``length`` places back's successor, 0 on every other token."""

    def __init__(self, vocab: int, length: int, gap: float):
        self.vocab, self.length, self.gap = vocab, length, gap

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        logits = torch.zeros(B, T, self.vocab, dtype=torch.float64)
        for t in range(self.length + 1, T):  # query t predicts token t + 1 = token t + 1 - length
            logits[torch.arange(B), t, ids[:, t + 1 - self.length]] = self.gap
        return logits


def test_the_induction_probe_on_a_perfect_copier():
    vocab, length, gap = 50, 10, 7.0
    seqs = induction_sequences(vocab, [0], length=length, n=5, seed=3, marker=0)
    assert seqs.shape == (5, 1 + 2 * length) and (seqs[:, 1 : 1 + length] == seqs[:, 1 + length :]).all()
    assert (seqs[:, 1:] != 0).all()  # the marker is never drawn
    r = induction_test(Copier(vocab, length, gap), seqs, batch_size=2)
    assert r["length"] == length and r["sequences"] == 5
    assert math.isclose(r["first_copy_loss"], math.log(vocab), rel_tol=1e-12)  # uniform: ln V
    expected = math.log(1 + (vocab - 1) * math.exp(-gap))  # -log softmax of the right token
    assert math.isclose(r["second_copy_loss"], expected, rel_tol=1e-9)
    assert math.isclose(r["score"], math.log(vocab) - expected, rel_tol=1e-9)


def test_the_in_context_score_is_late_minus_early():
    sums = torch.zeros(256, dtype=torch.float64)
    counts = torch.zeros(256, dtype=torch.long)
    sums[16:32], counts[16:32] = 3.0 * 2, 2  # mean 3 early
    sums[112:128], counts[112:128] = 1.5, 1  # mean 1.5 late
    s = in_context_score(PositionLosses(sums, counts))
    assert s["early_loss"] == 3.0 and s["late_loss"] == 1.5 and s["score"] == -1.5 and s["late_tokens"] == 16
    counts[112:128] = 0
    assert in_context_score(PositionLosses(sums, counts))["score"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n-layer", "0"], "storylens: error: --n-layer: must be a whole number of at least 1 (got 0)"),
        (["--n-head", "3"], "storylens: error: --n-embd: 256 is not divisible by n_head=3"),
        (["--n-embd", "-64"], "storylens: error: --n-embd: must be a whole number of at least 1 (got -64)"),
    ],
)
def test_size_options_are_checked_in_one_line(argv, message, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), *argv]) == 2
    assert capsys.readouterr().err.strip() == message
    assert not (tmp_path / "r").exists()


def test_a_broken_timeline_is_one_line(tmp_path):
    with pytest.raises(StorylensError, match="no head timeline here"):
        read_timeline(tmp_path)
    (tmp_path / TIMELINE_FILE).write_text('{"step": 4, "heads": []}\nnot json\n')
    with pytest.raises(StorylensError, match=r"heads_timeline.jsonl:1: not a timeline entry"):
        read_timeline(tmp_path)  # no heads: not what storylens train writes
    (tmp_path / TIMELINE_FILE).write_text("\n".join(SHIPPED_TIMELINE.read_text().splitlines()[:1] + ["not json"]))
    with pytest.raises(StorylensError, match=r"heads_timeline.jsonl:2: not a timeline entry"):
        read_timeline(tmp_path)


def test_storylens_timeline_draws_a_run_and_compares_two(reference_run, tmp_path):
    out, export, _ = reference_run
    page = tmp_path / "page"
    assert main(["timeline", str(out), "--out", str(page)]) == 0
    html = (page / "timeline.html").read_text()
    for column in ("prev_token", "name_mass", "induction", "duplicate_token", "marker"):
        assert (page / f"run-{column}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (page / f"run-{column}.svg").read_text().lstrip().startswith("<?xml")
    assert "2 blocks x 2 heads" in html and html.count('<img src="data:image/png;base64,') == 5
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html  # offline
    # an exported model folder holds the same timeline: two runs side by side
    both = tmp_path / "both"
    assert main(["timeline", str(out), str(export), "--out", str(both)]) == 0
    html = (both / "timeline.html").read_text()
    assert "The runs side by side" in html and "<td>run</td>" in html and "<td>model</td>" in html
    share = f"{100 * read_copying(out)['share']:.1f}% of {read_copying(out)['runs']:,}"
    assert html.count(share) == 2  # both runs' copying check, the same file
    # a run's training time, from its result.json (scripts/train_sizes.py) or else the train_state.json
    # a finished run writes; the exported model has neither
    minutes = json.loads((out / "train_state.json").read_text())["train_seconds"] / 60
    assert f"in {minutes:.1f} minutes of training steps" in html and html.count("minutes of training steps") == 1
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / TIMELINE_FILE).write_bytes((out / TIMELINE_FILE).read_bytes())
    (kept / "result.json").write_text(json.dumps({"step": 12, "train_seconds": 5430.0}))
    assert main(["timeline", str(kept), str(export), "--out", str(tmp_path / "kept-page")]) == 0
    html = (tmp_path / "kept-page" / "timeline.html").read_text()
    assert "<td>90.5</td>" in html and "in 90.5 minutes of training steps" in html


def test_timeline_command_errors_are_one_line(tmp_path, capsys):
    assert main(["timeline", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert "no head timeline here" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path), "--heads", "0", "--out", str(tmp_path / "o")]) == 2


def _entry(step, induction_score, quiz_loss, prev):
    heads = [
        {"label": "L1H1", "block": 1, "head": 1, "prev_token": prev},
        {"label": "L2H1", "block": 2, "head": 1, "prev_token": 0.1},
    ]
    return {
        "step": step,
        "tokens": step * 100,
        "quiz_loss": quiz_loss,
        "heads": heads,
        "induction": {"score": induction_score},
    }


def test_reading_a_timeline_induction_bumps_and_formation():
    from storylens.training.timeline import formation, induction_step, loss_bumps

    entries = [_entry(1, 0.0, 5.0, 0.1), _entry(2, 0.2, 4.0, 0.2), _entry(3, 1.5, 4.1, 0.6), _entry(4, 1.6, 3.0, 0.7)]
    assert induction_step(entries) == {"step": 3, "tokens": 300, "rise": 1.3}
    assert [b["step"] for b in loss_bumps(entries)] == [3]
    f = formation(entries, "prev_token")
    assert f["head"] == "L1H1" and f["block"] == 1 and f["half_way_step"] == 3  # 0.1 -> 0.7: half way is 0.4
    assert (f["peak"], f["peak_step"], f["at_first"]) == (0.7, 4, False)
    # a rise and a fall: half way to the highest score (0.1 -> 0.9 -> 0.3: half way is 0.5), not to the last
    rise_fall = [_entry(s, 0.0, 1.0, v) for s, v in ((1, 0.1), (2, 0.4), (3, 0.9), (4, 0.6), (5, 0.3))]
    f = formation(rise_fall, "prev_token")
    assert (f["half_way_step"], f["peak"], f["peak_step"], f["at_first"]) == (3, 0.9, 3, False)
    # a head that only weakens was there by the first evaluation (the timeline cannot say how much earlier)
    fading = [_entry(s, 0.0, 1.0, v) for s, v in ((1, 0.6), (2, 0.5), (3, 0.4))]
    f = formation(fading, "prev_token")
    assert (f["half_way_step"], f["at_first"], f["last"]) == (1, True, 0.4)
    assert induction_step(entries[:1]) is None
    # the initial weights' line is where scores start, not an evaluation: no rise or bump is counted from it
    started = [_entry(0, -5.0, 9.0, 0.0), *entries]
    assert induction_step(started) == induction_step(entries) and loss_bumps(started) == loss_bumps(entries)
    assert formation(started, "prev_token")["half_way_step"] == 3  # 0.0 -> 0.7: half way is 0.35


def test_the_docs_size_table_is_the_kept_runs():
    """The docs' four-size table is what scripts/readme_sizes_table.py makes of benchmarks/sizes
    (never typed in), and every kept run holds a timeline from step 0 and a copying check."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from scripts.readme_sizes_table import kept_runs, table
    from scripts.readme_tables import shown_between

    runs = kept_runs()
    assert {r.name for r in runs} == {"blocks-1", "blocks-2", "blocks-4", "blocks-6"}  # the four sizes
    for run in runs:
        assert read_timeline(run)[0]["step"] == 0 and read_copying(run) is not None, run.name
    assert shown_between("sizes") == table(runs)


def test_the_timeline_page_defines_its_induction_score_and_marks_it_in_nats(tmp_path):
    """On a kept run's real timeline: the page defines the induction score; each figure's heads
    panel is in shares of attention with no marker, and the marker (a dashed line and its nats
    label) sits on the panels in nats, the induction score's own panel plotting that score."""
    from storylens.training.timeline import induction_step
    from storylens.viz.timeline import timeline_figure

    run = Path(__file__).resolve().parents[1] / "benchmarks" / "sizes" / "blocks-2"
    entries = read_timeline(run)
    assert main(["timeline", str(run), "--out", str(tmp_path / "page")]) == 0
    html = (tmp_path / "page" / "timeline.html").read_text()
    assert 'id="induction-score"' in html and html.count('href="#induction-score"') == 1
    assert "induction score</b> is the induction test's mean loss on the first copy minus its" in html
    mark = induction_step(entries)
    fig = timeline_figure(
        entries, "prev_token", mark_tokens=mark["tokens"], mark_label=f"rise {mark['rise']:+.2f} nats"
    )
    heads, losses, score = fig.axes
    assert heads.get_ylabel() == "prev_token (share of attention)" and "nats" in losses.get_ylabel()
    assert "induction" in score.get_ylabel() and "nats" in score.get_ylabel()

    def marked(ax):
        return [ln for ln in ax.get_lines() if ln.get_linestyle() == "--" and ln.get_xdata()[0] == mark["tokens"] / 1e6]

    assert marked(heads) == [] and not any("nats" in t.get_text() for t in heads.texts)
    assert len(marked(losses)) == len(marked(score)) == 1
    assert [t.get_text() for t in score.texts] == [f"rise {mark['rise']:+.2f} nats"]
    plotted = [ln for ln in score.get_lines() if len(ln.get_ydata()) == len(entries)][0].get_ydata()
    first_minus_second = [e["induction"]["first_copy_loss"] - e["induction"]["second_copy_loss"] for e in entries]
    assert list(plotted) == pytest.approx(first_minus_second, abs=1e-12)  # the stored score is that difference
