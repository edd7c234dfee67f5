"""storylens score: any corpus streamed (text, gzip, JSON lines, Parquet, a saved dataset), the same
table whatever the format, checkpoints that resume to the same numbers, and the name vocabulary as a
mergeable first pass."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from storylens.cli import main
from storylens.data.names import NameVocabulary, name_vocabulary
from storylens.data.stories import EOT

N = 48


@pytest.fixture(scope="module")
def stories(corpus_split):
    return corpus_split.quiz[:N]


@pytest.fixture(scope="module")
def files(stories, tmp_path_factory):
    d = tmp_path_factory.mktemp("sources")
    text = "".join(f"{s}\n{EOT}\n" for s in stories)
    (d / "s.txt").write_text(text)
    (d / "s.txt.gz").write_bytes(gzip.compress(text.encode()))
    lines = "".join(json.dumps({"id": i, "story": s}) + "\n" for i, s in enumerate(stories))
    (d / "s.jsonl").write_text(lines)
    (d / "s.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"story": stories}), d / "s.parquet", row_group_size=7)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"story": stories}).save_to_disk(str(d / "saved"))
    return d


def _score(tmp_path, name, *argv):
    out = tmp_path / name
    assert main(["score", "--out", str(out), "--no-progress", "--batch-size", "8", "--chunk-stories", "16", *argv]) == 0
    return json.loads((out / "heads.json").read_text()), json.loads((out / "summary.json").read_text())


def test_every_format_gives_the_same_table(files, tmp_path):
    ref, summary = _score(tmp_path, "txt", "--stories", str(files / "s.txt"))
    assert summary["stories"]["stories"] == N and len(ref["heads"]) == 24
    assert {"duplicate_token", "induction", "name_mass"} <= set(ref["heads"][0])
    for name, extra in [
        ("s.txt.gz", []),
        ("s.jsonl", ["--text-field", "story"]),
        ("s.jsonl.gz", ["--text-field", "story"]),
        ("s.parquet", ["--text-field", "story"]),
        ("saved", ["--text-field", "story"]),
    ]:
        got, _ = _score(tmp_path, name.replace(".", "_"), "--stories", str(files / name), *extra)
        assert got == ref, name  # the same stories, the same chunks and batches: the same numbers
    half, s = _score(tmp_path, "limit", "--stories", str(files / "s.jsonl"), "--text-field", "story", "--limit", "20")
    assert s["stories"]["stories"] == 20 and half != ref


def test_the_summary_is_typed_and_named_as_the_reports(files, tmp_path):
    """score's summary.json reads back into its types and writes back the same text; the model and the
    stories carry the report's names (the same ModelInfo, the report's quiz keys)."""
    from dataclasses import fields

    from storylens.corpus.summary import load
    from storylens.lesson.summary import QuizInfo

    _score(tmp_path, "typed", "--stories", str(files / "s.txt"))
    text = (tmp_path / "typed" / "summary.json").read_text(encoding="utf-8")
    s = load(tmp_path / "typed")
    assert s.to_json() == text
    assert s.model.display_name == "Tiny Storyteller" and s.model.parameters > 0 and s.model.n_heads == 24
    assert list(s.stories.to_dict()) == [f.name for f in fields(QuizInfo)][: len(s.stories.to_dict())]
    assert set(s.timings_s) == {"first_pass", "scoring"} and s.top["name_mass"].head.startswith("L")


def test_options_are_checked_once_when_built():
    """Bad settings are refused when the options are built, before any model or story."""
    from storylens.core.errors import UsageError
    from storylens.corpus.options import ScoreOptions

    for bad in ({"batch_size": 0}, {"engine": "spark"}, {"workers": 0}, {"examples": -1}, {"checkpoint_every": 0}):
        with pytest.raises(UsageError):
            ScoreOptions(**bad)
    assert ScoreOptions(detectors=[]).detectors == ()


def test_bad_sources_are_one_line(files, tmp_path, capsys):
    def err(*argv, code=1):
        assert main(["score", "--out", str(tmp_path / "x"), "--no-progress", *argv]) == code
        e = capsys.readouterr().err.strip()
        assert len(e.splitlines()) == 1 and "Traceback" not in e
        return e

    assert "no column 'text'" in err("--stories", str(files / "s.parquet"))
    assert "has no field 'text'" in err("--stories", str(files / "s.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{oops\n')
    assert "line 2 is not JSON" in err("--stories", str(bad))
    assert "no such file" in err("--stories", str(tmp_path / "missing.txt"))
    assert "--allow-download" in err("--stories", "hf:no-such-owner/no-such-dataset")  # offline, not fetched
    assert "--limit" in err("--stories", str(files / "s.txt"), "--limit", "0", code=2)
    assert "only with --engine ray" in err("--stories", str(files / "s.txt"), "--workers", "3", code=2)
    assert not (tmp_path / "x").exists()


def test_names_are_a_mergeable_first_pass(stories):
    a, b = NameVocabulary(), NameVocabulary()
    for s in stories[:20]:
        a.add(s)
    for s in stories[20:]:
        b.add(s)
    assert b.merge(a).names() == name_vocabulary(stories)
    # a word is a name only if its lower-case form is written nowhere in the whole set
    v = NameVocabulary()
    v.add("Lily saw a Bird.")
    assert "Bird" in v.names()
    v.merge(NameVocabulary(lower={"bird"}))
    assert "Bird" not in v.names() and "Lily" in v.names()


def _cli(*argv):
    return [sys.executable, "-m", "storylens", "score", "--no-progress", *argv]


def test_a_killed_run_resumes_to_the_same_numbers(files, tmp_path):
    common = ["--stories", str(files / "s.txt"), "--batch-size", "4", "--chunk-stories", "8", "--checkpoint-every", "1"]
    whole = tmp_path / "whole"
    assert subprocess.run(_cli(*common, "--out", str(whole)), capture_output=True).returncode == 0
    out = tmp_path / "cut"
    ckpt = tmp_path / "cut.checkpoint.json"
    p = subprocess.Popen(_cli(*common, "--out", str(out)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not ckpt.exists() and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert ckpt.exists() and not out.exists()  # killed after a checkpoint, before the table
    done = json.loads(ckpt.read_text())["stats"][0]
    assert 0 < done < N
    # a checkpoint is not overwritten by a fresh run, nor used with other settings
    r = subprocess.run(_cli(*common, "--out", str(out)), capture_output=True, text=True)
    assert r.returncode == 1 and "--resume" in r.stderr
    other = ["--stories", str(files / "s.txt"), "--batch-size", "8", "--chunk-stories", "8", "--checkpoint-every", "1"]
    r = subprocess.run(_cli(*other, "--out", str(out), "--resume"), capture_output=True, text=True)
    assert r.returncode == 1 and "other settings" in r.stderr
    r = subprocess.run(_cli(*common, "--out", str(out), "--resume"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "heads.json").read_text()) == json.loads((whole / "heads.json").read_text())
    examples = json.loads((out / "examples.json").read_text())
    assert examples == json.loads((whole / "examples.json").read_text()) and examples["k"] == 8
    assert json.loads((out / "summary.json").read_text())["engine"]["resumed_from"] == done
    assert not ckpt.exists()


def test_the_causal_columns_are_written_and_a_checkpoint_carries_them(files, stories, shipped_model, tmp_path):
    """--causal: the six AtP/DLA columns in heads.json (None without it), and the accumulator's state (what a
    checkpoint holds) read back and merged with the rest equals one pass within 1e-9."""
    from storylens.engine.record import RecordStats, record
    from storylens.lm import NativeLM
    from storylens.table.accumulator import HeadScoreAccumulator
    from storylens.table.scores import score_table

    few = files / "few.txt"
    few.write_text("".join(f"{s}\n{EOT}\n" for s in stories[:8]))
    heads, _ = _score(tmp_path, "causal", "--stories", str(few), "--causal")
    causal = ("atp_mean", "atp_mean_se", "atp_zero", "atp_zero_se", "dla", "dla_se")
    assert all(h[c] is not None for h in heads["heads"] for c in causal)
    assert max(abs(h["atp_mean"]) for h in heads["heads"]) > 0
    lm, names = NativeLM(shipped_model), name_vocabulary(stories[:8])
    plain = HeadScoreAccumulator(lm.n_layer, lm.n_head)  # without --causal: the columns are there, None
    assert all(h[c] is None for h in score_table(plain, RecordStats(0, 0, 0), None, 8).to_rows() for c in causal)

    def run(part, start=0):
        acc = HeadScoreAccumulator(lm.n_layer, lm.n_head, causal=True)
        record(lm, part, [acc], batch_size=4, chunk_stories=4, names=names, progress=False, start=start)
        return acc

    whole = run(stories[:8]).columns(False)
    resumed = HeadScoreAccumulator(lm.n_layer, lm.n_head, causal=True)
    resumed.load_state(json.loads(json.dumps(run(stories[:4]).state())))
    merged = resumed.merge(run(stories[4:8], start=4)).columns(False)
    for c in causal:
        assert (merged[c] - whole[c]).abs().max().item() <= 1e-9, c


def test_a_stream_needs_its_names(shipped_model, stories):
    from storylens.core.errors import StorylensError
    from storylens.engine.record import record
    from storylens.lm import NativeLM

    with pytest.raises(StorylensError, match="pass names"):
        record(NativeLM(shipped_model), iter(stories), [], progress=False)
    assert os.environ.get("HF_HUB_OFFLINE") != "0"


def test_ray_missing_is_one_line(files, tmp_path):
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from storylens.cli import main\n"
        f"sys.exit(main(['score', '--stories', {str(files / 's.txt')!r}, '--out', {str(tmp_path / 'r')!r}, "
        "'--engine', 'ray', '--no-progress']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    from storylens.core.errors import install_hint

    assert install_hint("ray").startswith("pip install 'storylens[ray] @ git+https://")
    assert r.returncode == 1 and r.stderr.strip() == f"storylens: error: --engine ray needs Ray: {install_hint('ray')}"
