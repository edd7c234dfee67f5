"""Issue 61, class 2: every reader of a user's file bounds what it holds before the expensive step. A table of
readers, each handed a FIFO where its file should be (opening one blocks until a writer comes: a hang) and, where
its kind has a size, a file past it (a pairs line of 2 MB used to be tokenised, 190 MB a megabyte): each is one
StorylensError line naming the file, at once. The results read back are test_read_back.py's."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from storylens.cli import main
from storylens.cli.options import load_detector
from storylens.core.errors import StorylensError
from storylens.data.stories import EOT, text_lines
from storylens.effects.patching import MAX_PAIR_LINE_BYTES, read_pairs
from storylens.lm import load_lm
from storylens.training.checkpoint import load_checkpoint
from storylens.training.timeline import read_timeline

SHIPPED = Path(__file__).resolve().parents[1] / "storylens" / "pretrained" / "tiny-storyteller"


@pytest.fixture
def alarm():
    """A reader that blocks fails the test in 20 s instead of hanging the suite."""

    def stuck(*_):
        raise TimeoutError("the reader blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _model_with(tmp_path, name, make):
    folder = tmp_path / "model"
    shutil.copytree(SHIPPED, folder)
    (folder / name).unlink()
    make(folder / name)
    return folder


def _fifo(path):
    os.mkfifo(path)


def _huge_config(path):
    path.write_text(json.dumps({"n_layer": 6, "pad": "x" * (65 << 20)}))  # past the 64 MiB a config can have


READERS = [  # (what, call(tmp_path) that reads the hostile file, words of its one line)
    ("a pairs file that is a FIFO", lambda t: read_pairs(_made(t / "p.jsonl", _fifo)), "not a regular file"),
    ("a stories file that is a FIFO", lambda t: list(text_lines(_made(t / "s.txt", _fifo))), "not a regular file"),
    ("a native config that is a FIFO", lambda t: load_lm(str(_model_with(t, "config.json", _fifo))), "not a regular"),
    ("a native config of 65 MB", lambda t: load_lm(str(_model_with(t, "config.json", _huge_config))), "a file of its"),
    ("weights that are a FIFO", lambda t: load_lm(str(_model_with(t, "model.safetensors", _fifo))), "not a regular"),
    ("a training checkpoint that is a FIFO", lambda t: load_checkpoint(_made(t / "c", _fifo)), "not a regular file"),
    ("a timeline that is a FIFO", lambda t: read_timeline(_made(t / "heads_timeline.jsonl", _fifo)), "not a regular"),
    ("a detector that is a FIFO", lambda t: load_detector(str(_made(t / "d.py", _fifo))), "not a regular file"),
]


def _made(path, make):
    make(path)
    return path


@pytest.mark.parametrize("what, call, words", READERS, ids=[r[0] for r in READERS])
def test_a_reader_refuses_what_it_cannot_bound(tmp_path, alarm, what, call, words):
    with pytest.raises(StorylensError) as e:
        call(tmp_path)
    said = str(e.value)
    assert words in said and "\n" not in said and str(tmp_path) in said, said


def test_a_long_pairs_line_is_refused_before_it_is_parsed(tmp_path):
    line = json.dumps({"clean": "a" * MAX_PAIR_LINE_BYTES, "corrupt": "b", "answer": "c", "wrong": "d"})
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"clean": "a", "corrupt": "b", "answer": "c", "wrong": "d"}) + "\n" + line
    )
    with pytest.raises(StorylensError, match=r"p.jsonl:2: longer than 1,048,576 bytes"):
        read_pairs(tmp_path / "p.jsonl")


@pytest.mark.parametrize("command", ["score", "circuit"])
def test_a_checkpoint_that_is_a_fifo_is_refused_on_resume(corpus_split, tmp_path, alarm, command, capsys):
    (tmp_path / "s.txt").write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:2]))
    out = tmp_path / "run"
    suffix = ".checkpoint.json" if command == "score" else ".checkpoint.safetensors"
    os.mkfifo(tmp_path / f"run{suffix}")
    argv = [command, "--stories", str(tmp_path / "s.txt"), "--out", str(out), "--no-progress", "--resume"]
    if command == "circuit":
        argv += ["--ablation", "mean"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a regular file" in err[0] and f"run{suffix}" in err[0], err
