"""Training on a small real slice: checkpoints, a hard kill, and a resume that matches."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storylens.core.errors import StorylensError
from storylens.core.progress import PROGRESS_EVERY_ENV
from storylens.data.stories import EOT
from storylens.training.checkpoint import load_checkpoint
from storylens.training.train import CHECKPOINT, TrainConfig, lr_at

STEPS = 10
SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64"]


@pytest.fixture(scope="module")
def slice_file(tmp_path_factory, corpus_split):
    # 260 real stories: 60 to train on, the last 200 as the quiz (so evaluation runs too)
    stories = corpus_split.train[:60] + corpus_split.quiz
    p = tmp_path_factory.mktemp("slice") / "slice.txt"
    p.write_text("".join(f"{s}\n{EOT}\n" for s in stories))
    return p


def _train_cmd(slice_file, out, *extra):
    return [
        sys.executable,
        "-m",
        "storylens",
        "train",
        "--stories",
        str(slice_file),
        "--out",
        str(out),
        "--max-steps",
        str(STEPS),
        "--batch-size",
        "2",
        "--eval-every",
        "5",
        "--checkpoint-minutes",
        "0",
        "--vocab-size",
        "1024",
        "--copying-samples",
        "2",  # the check at the end of a run: two stories are enough here
        *SMALL,  # a 2-block model: the same recipe and code, a fraction of the time
        *extra,
    ]


def _losses(out: Path):
    return json.loads((out / "train_state.json").read_text())["losses"]


def _checkpoint_step(path: Path) -> int:
    try:
        return load_checkpoint(path)[2]["step"]
    except StorylensError:
        return -1  # being replaced right now (never half-written: see the atomic rename)


def test_killed_run_resumes_with_the_uninterrupted_losses(slice_file, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"
    # stderr is a pipe (no tqdm bar): the steps are counted in progress lines instead, here every line
    p = subprocess.run(
        _train_cmd(slice_file, ref), check=True, env={**env, PROGRESS_EVERY_ENV: "0"}, capture_output=True, text=True
    )
    steps = [x.split(",")[0] for x in p.stderr.splitlines() if x.startswith("storylens: train: training ")]
    assert steps == [f"storylens: train: training {i}/{STEPS} steps" for i in range(1, STEPS + 1)], p.stderr
    reference = _losses(ref)
    assert len(reference) == STEPS and reference[-1] < reference[0]

    run = tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(slice_file, run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and _checkpoint_step(run / CHECKPOINT) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: only periodic checkpoints survive
    proc.wait()
    killed_at = _checkpoint_step(run / CHECKPOINT)
    assert 3 <= killed_at < STEPS
    assert not (run / "train_state.json").exists()

    subprocess.run(_train_cmd(slice_file, run, "--resume"), check=True, env=env, capture_output=True)
    assert _losses(run) == reference  # same data order, same dropout, same numbers


def test_corrupt_or_truncated_checkpoint_is_refused(tmp_path, slice_file):
    from storylens.cli import main

    ckpt = tmp_path / CHECKPOINT
    ckpt.write_bytes(b"\x00" * 100)
    with pytest.raises(StorylensError, match="corrupt or truncated checkpoint"):
        load_checkpoint(ckpt)
    assert main(["train", "--stories", str(slice_file), "--out", str(tmp_path), "--resume"]) == 1


def test_resume_with_other_settings_is_refused(tmp_path, slice_file):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "r"
    cmd = _train_cmd(slice_file, out)
    cmd[cmd.index("--max-steps") + 1] = "2"
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    good = out / CHECKPOINT
    data = good.read_bytes()
    (out / "truncated").write_bytes(data[: len(data) - 1000])
    with pytest.raises(StorylensError, match="corrupt or truncated"):
        load_checkpoint(out / "truncated")
    r = subprocess.run(_train_cmd(slice_file, out, "--resume"), env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "other settings" in r.stderr and "Traceback" not in r.stderr


def test_learning_rate_warms_up_then_decays():
    cfg = TrainConfig(max_steps=1000, warmup_steps=100, lr=1e-3, min_lr=1e-4)
    assert lr_at(0, cfg) == pytest.approx(1e-5)
    assert lr_at(99, cfg) == pytest.approx(1e-3)
    assert lr_at(550, cfg) == pytest.approx(5.5e-4)
    assert lr_at(1000, cfg) == pytest.approx(1e-4)
