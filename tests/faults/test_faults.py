"""Fault injection: kill report, export-hf and train at every publish step and at many moments,
run two at once, fill the disk; afterwards the target holds exactly the old set or exactly the new
one, and the next run leaves no temporary folder behind.

Kills are real SIGKILLs of a real ``storylens`` process: at named points
(``STORYLENS_INJECT_KILL``, see storylens.core.publish.fault_point) and after a range of delays.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storylens.data.stories import EOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def storylens(*argv, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "storylens", *map(str, argv)],
        capture_output=True,
        text=True,
        env={**ENV, **(env or {})},
        **kw,
    )


def snapshot(folder: Path) -> dict[str, str]:
    """Every file in the folder and its sha256 (the manifest included)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def leftovers(out: Path) -> list[str]:
    """Temporary folders or files beside ``out``, the lock file included (a finished run removes it)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def wait_until(condition, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline and not condition():
        time.sleep(0.05)


def assert_refused_by_lock(first, second, out):
    """The first run finishes; the second, started while the first held the lock, is refused in one line."""
    assert first.wait() == 0, first.stderr.read()
    assert second.returncode == 1
    assert second.stderr == (
        f"storylens: error: {out}: another storylens run is writing it right now; "
        "try again when that one has finished\n"
    )


# ---------------------------------------------------------------- report


@pytest.fixture(scope="module")
def quizzes(tmp_path_factory, corpus_split):
    d = tmp_path_factory.mktemp("quizzes")
    a, b = d / "a.txt", d / "b.txt"
    a.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:10]))
    b.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[10:20]))
    return a, b


def report(out, quiz, env=None):
    # no ablations (the truth section is written, with nothing switched off): the same files and the
    # same publish steps in half the time (its ablation passes were half of a 10-story report)
    return storylens("report", "--out", out, "--quiz", quiz, "--no-progress", "--truth-stories", "0", env=env)


def assert_report_is(out: Path, quiz_name: str, expected_files: set[str]):
    files = {p.name for p in out.iterdir()}
    assert files == expected_files
    manifest = json.loads((out / ".storylens.json").read_text())
    assert set(manifest["files"]) | {".storylens.json"} == files
    assert json.loads((out / "summary.json").read_text())["quiz"]["source"] == quiz_name


@pytest.fixture(scope="module")
def old_report(tmp_path_factory, quizzes):
    a, _ = quizzes
    ref = tmp_path_factory.mktemp("ref") / "report"
    r = report(ref, a)
    assert r.returncode == 0, r.stderr
    return ref, snapshot(ref)


@pytest.mark.parametrize("point", ["folder-built", "folder-before-swap", "folder-after-swap"])
def test_report_killed_at_each_publish_step(tmp_path, quizzes, old_report, point):
    a, b = quizzes
    ref, ref_files = old_report
    out = tmp_path / "report"
    shutil.copytree(ref, out)
    r = report(out, b, env={"STORYLENS_INJECT_KILL": point})
    assert r.returncode == -signal.SIGKILL
    if point == "folder-after-swap":  # the swap happened: the new set, whole
        assert_report_is(out, "b.txt", set(ref_files))
    else:  # not yet: the old set, byte for byte
        assert snapshot(out) == ref_files
    assert leftovers(out)  # the killed run's temporary folder ...
    r = report(out, b)
    assert r.returncode == 0, r.stderr
    assert_report_is(out, "b.txt", set(ref_files))
    assert leftovers(out) == []  # ... is gone after the next run


def test_report_killed_after_many_delays(tmp_path, quizzes, old_report):
    a, b = quizzes
    ref, ref_files = old_report
    out = tmp_path / "report"
    shutil.copytree(ref, out)
    seen = set()
    for delay in (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 7.0):
        p = subprocess.Popen(
            [sys.executable, "-m", "storylens", "report", "--out", str(out), "--quiz", str(b), "--no-progress"],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        if snapshot(out) == ref_files:
            seen.add("old")
        else:
            assert_report_is(out, "b.txt", set(ref_files))
            seen.add("new")
            shutil.rmtree(out)
            shutil.copytree(ref, out)
    assert "old" in seen
    r = report(out, b)
    assert r.returncode == 0 and leftovers(out) == []


def test_two_reports_at_once_one_is_refused(tmp_path, quizzes):
    a, b = quizzes
    out = tmp_path / "report"
    first = subprocess.Popen(
        [sys.executable, "-m", "storylens", "report", "--out", str(out), "--quiz", str(a), "--no-progress"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: leftovers(out))  # the first holds the lock once its build folder exists
    assert_refused_by_lock(first, report(out, b), out)
    assert json.loads((out / "summary.json").read_text())["quiz"]["source"] == "a.txt"
    assert leftovers(out) == []


# ---------------------------------------------------------------- export-hf


@pytest.fixture(scope="module")
def old_export(tmp_path_factory):
    ref = tmp_path_factory.mktemp("exp") / "hf"
    r = storylens("export-hf", ref)
    assert r.returncode == 0, r.stderr
    return ref, snapshot(ref)


@pytest.mark.parametrize("point", ["folder-built", "folder-before-swap", "folder-after-swap"])
@pytest.mark.parametrize("before", ["nothing", "an older export"])
def test_export_killed_at_each_publish_step(tmp_path, old_export, point, before):
    ref, ref_files = old_export
    out = tmp_path / "hf"
    if before == "an older export":
        shutil.copytree(ref, out)
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "note": "an older export"}))
        older = snapshot(out)
    r = storylens("export-hf", out, env={"STORYLENS_INJECT_KILL": point})
    if point == "folder-after-swap" and before == "nothing":
        assert r.returncode == 0  # a new folder lands with one rename: there is no "after the swap" step
    else:
        assert r.returncode == -signal.SIGKILL
    if point == "folder-after-swap":
        assert snapshot(out) == ref_files  # the new set, whole (the export is deterministic)
    elif before == "nothing":
        assert not out.exists()  # nothing was there before, nothing half-written is there now
    else:
        assert snapshot(out) == older  # the older export, byte for byte
    r = storylens("export-hf", out)
    assert r.returncode == 0, r.stderr
    assert snapshot(out) == ref_files and leftovers(out) == []


def test_export_never_touches_what_it_did_not_write(tmp_path, old_export):
    ref, ref_files = old_export
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    r = storylens("export-hf", mine)
    assert r.returncode == 1
    assert r.stderr == (
        f"storylens: error: {mine}: holds files storylens did not write (config.json); give an empty or new folder\n"
    )
    assert (mine / "config.json").read_text() == '{"mine": true}'
    # a previous export plus one file of the user's: refused, both left as they were
    out = tmp_path / "hf"
    shutil.copytree(ref, out)
    (out / "notes.md").write_text("notes")
    r = storylens("export-hf", out)
    assert r.returncode == 1 and "holds files storylens did not write (notes.md)" in r.stderr
    assert (out / "notes.md").read_text() == "notes" and {**snapshot(out)} == {
        **ref_files,
        "notes.md": snapshot(out)["notes.md"],
    }
    # a symlink to a folder, and a file
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    r = storylens("export-hf", link)
    assert r.returncode == 1 and r.stderr == f"storylens: error: {link}: is a symbolic link; give a real folder\n"
    assert not (tmp_path / "elsewhere").exists()
    f = tmp_path / "file"
    f.write_text("x")
    r = storylens("export-hf", f)
    assert r.returncode == 1 and r.stderr == f"storylens: error: {f}: exists and is not a folder\n"
    assert f.read_text() == "x"


# ---------------------------------------------------------------- train


@pytest.fixture(scope="module")
def slice_file(tmp_path_factory, corpus_split):
    p = tmp_path_factory.mktemp("slice") / "slice.txt"
    p.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.train[:60] + corpus_split.quiz))
    return p


# The checkpoint's publishing, locking and validation are the point here, not the model's size: a
# 2-block model of width 64 and no copying check (the default 6 x 256 recipe with its 50 generated
# stories took ten times as long a run for the same code paths).
SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--copying-samples", "0"]


def train(out, stories, *extra, env=None, popen=False):
    argv = [
        sys.executable,
        "-m",
        "storylens",
        "train",
        "--stories",
        str(stories),
        "--out",
        str(out),
        "--max-steps",
        "6",
        "--batch-size",
        "2",
        "--eval-every",
        "3",
        "--checkpoint-minutes",
        "0",
        "--vocab-size",
        "1024",
        *SMALL,
        *map(str, extra),
    ]
    if popen:
        return subprocess.Popen(
            argv, env={**ENV, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(argv, capture_output=True, text=True, env={**ENV, **(env or {})})


def test_train_killed_while_replacing_a_checkpoint(tmp_path, slice_file):
    from storylens.training.checkpoint import load_checkpoint

    out = tmp_path / "run"
    r = train(out, slice_file, env={"STORYLENS_INJECT_KILL": "checkpoint-before-replace"})
    assert r.returncode == -signal.SIGKILL
    assert not (out / "checkpoint.safetensors").exists()  # the first checkpoint never landed
    assert [p.name for p in out.glob(".checkpoint.safetensors.tmp-*")]  # its temporary file did
    r = train(out, slice_file)
    assert r.returncode == 0, r.stderr
    assert load_checkpoint(out / "checkpoint.safetensors")[2]["step"] == 6
    assert list(out.glob(".*.tmp-*")) == []  # the stale temporary was removed under the lock


def test_two_trainings_into_one_folder(tmp_path, slice_file):
    out = tmp_path / "run"
    first = train(out, slice_file, popen=True)
    wait_until(lambda: (out / "tokenizer.json").exists())  # written under the run's lock
    assert_refused_by_lock(first, train(out, slice_file), out)


def test_resume_refuses_a_changed_corpus_or_tokenizer(tmp_path, slice_file, corpus_split):
    out = tmp_path / "run"
    assert train(out, slice_file, "--max-steps", "2").returncode == 0
    ckpt = out / "checkpoint.safetensors"
    other = tmp_path / "other.txt"
    other.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.train[1:61] + corpus_split.quiz))
    r = train(out, other, "--max-steps", "2", "--resume")
    assert r.returncode == 1
    assert r.stderr == (
        f"storylens: error: {ckpt}: the training stories changed since this run started; "
        "restore them or train into a new --out\n"
    )
    tok = out / "tokenizer.json"
    data = json.loads(tok.read_text())
    data["model"]["vocab"]["zzzz"] = data["model"]["vocab"].pop(next(iter(data["model"]["vocab"])))
    tok.write_text(json.dumps(data))
    r = train(out, slice_file, "--max-steps", "2", "--resume")
    assert r.returncode == 1
    assert r.stderr == (
        f"storylens: error: {ckpt}: tokenizer.json changed since this run started; "
        "restore them or train into a new --out\n"
    )


def test_resume_validates_the_checkpoint_tensors(tmp_path, slice_file):
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path / "run"
    assert train(out, slice_file, "--max-steps", "2").returncode == 0
    ckpt = out / "checkpoint.safetensors"
    with safe_open(str(ckpt), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    good = dict(tensors)
    cases = {
        "nan": (
            "model.transformer.h.0.attn.query.weight",
            lambda t: t.index_fill(0, __import__("torch").tensor([0]), float("nan")),
            "weights transformer.h.0.attn.query.weight holds NaN or infinite numbers",
        ),
        "shape": (
            "model.transformer.ln_f.bias",
            lambda t: t[:10],
            "weights transformer.ln_f.bias has shape (10,), expected (64,)",
        ),
        "dtype": (
            "optim.0.exp_avg",
            lambda t: t.double(),
            "optimizer state 0 exp_avg is torch.float64, expected torch.float32",
        ),
    }
    for name, (key, change, why) in cases.items():
        bad = dict(good)
        bad[key] = change(good[key]).contiguous()
        save_file(bad, str(ckpt), metadata=meta)
        r = train(out, slice_file, "--max-steps", "2", "--resume")
        assert r.returncode == 1 and r.stderr == f"storylens: error: {ckpt}: {why}\n", (name, r.stderr)


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MB tmpfs, where the machine lets us mount one (root in a sandbox usually can)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): disk-full not tested")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_report_and_export(tiny_disk, quizzes):
    a, _ = quizzes
    out = tiny_disk / "report"
    r = report(out, a)
    assert r.returncode == 1
    assert r.stderr.startswith(f"storylens: error: {out}: cannot write (No space left on device)"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and leftovers(out) == []
    hf = tiny_disk / "hf"
    r = storylens("export-hf", hf)
    assert r.returncode == 1 and "No space left on device" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not hf.exists() and leftovers(hf) == []
