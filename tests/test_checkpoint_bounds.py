"""Issue 61, class 5: a checkpoint is resumed only when it can be right. Every accumulator's state is checked
against what its stories can give (counts no more than the stories, finite sums, and the Cauchy-Schwarz bounds
between a sum, its squares and its cross terms: an edited sum breaks one unless the others are edited to match),
and the checkpoint carries a digest of what it holds, so a state edited within every bound is still refused.
A table of hand edits of a real ``score --causal`` checkpoint (the shipped model, killed after its checkpoint at
8 of 12 stories), the causal, sink and exact accumulators included, and an edited ``circuit --stories``
checkpoint; each is one line naming what is wrong, and nothing is resumed."""

import json
import os
import subprocess
import sys

import pytest

from storylens.cli import main
from storylens.data.stories import EOT

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _score(out, *argv):
    return ["score", "--out", str(out), "--no-progress", "--batch-size", "4", "--chunk-stories", "4", "--causal",
            "--exact-stories", "4", "--checkpoint-every", "1", *argv]  # fmt: skip


@pytest.fixture(scope="module")
def stories(corpus_split, tmp_path_factory):
    f = tmp_path_factory.mktemp("c") / "s.txt"
    f.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:12]))
    return f


@pytest.fixture(scope="module")
def killed(stories, tmp_path_factory):
    """A --causal run killed after its last checkpoint (8 of 12 stories), before its table is published."""
    out = tmp_path_factory.mktemp("killed") / "o"
    argv = [sys.executable, "-m", "storylens", *_score(out, "--stories", str(stories))]
    r = subprocess.run(argv, env={**ENV, "STORYLENS_INJECT_KILL": "folder-built"}, capture_output=True, text=True)
    assert r.returncode < 0, r.stderr
    text = out.with_name("o.checkpoint.json").read_text()
    doc = json.loads(text)
    assert doc["stats"][0] == 8 and doc["state"]["causal"] is not None and doc["state"]["sinks"] is not None
    assert doc["state"]["exact"] is not None
    return text


def _first(nested, value):
    """Set the first number of a nested list to ``value``."""
    while isinstance(nested[0], list):
        nested = nested[0]
    nested[0] = value


def _causal(c):
    return c["state"]["causal"]


EDITS = [  # (what, edit, words of the one line)
    ("one causal sum at 1e30", lambda c: _first(_causal(c)["sums"]["G"], 1e30), "sums.G: cannot come from"),
    ("a cross sum at 1e30", lambda c: _first(_causal(c)["sums"]["AG"], 1e30), "sums.AG: cannot come from"),
    ("a Gram cross term past its diagonal", lambda c: _causal(c)["sums"]["GG"][0][0][0].__setitem__(1, 1e30),
     "sums.GG: not a sum of outer products"),
    ("positions 1e9 for 8 stories", lambda c: _causal(c).update(positions=1e9), "positions 1e+09: not the"),
    ("a loss sum at 1e30", lambda c: _first(_causal(c)["zero"]["c"], 1e30), "sums c and c2 cannot come from 8"),
    ("token counts of 1e9", lambda c: _causal(c)["zero"].update(n=1e9), "token counts"),
    ("a story count past the stories", lambda c: c["state"]["exact"]["mean"].update(count=99), "99 stories, more"),
    ("an exact sum at 1e30", lambda c: _first(c["state"]["exact"]["mean"]["c"], 1e30), "sums c and c2 cannot"),
    ("a sink output sum at 1e30", lambda c: _first(c["state"]["sinks"]["total"], 1e30), "output sums: cannot come"),
    ("a sink square at 1e30", lambda c: _first(c["state"]["sinks"]["square"], 1e30), "the squares about the first"),
    ("a sum of squares alone at 1e30 (every bound holds)", lambda c: _first(_causal(c)["zero"]["c2"], 1e30),
     "digest does not match"),
    ("a score within 0..count", lambda c: _first(c["state"]["means"]["name_mass"]["total"], 0.5),
     "digest does not match"),
    ("no digest (an older storylens)", lambda c: c.pop("digest"), "digest does not match"),
]  # fmt: skip


@pytest.mark.parametrize("what, edit, words", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_score_checkpoint_is_refused(stories, killed, tmp_path, capsys, what, edit, words):
    c = json.loads(killed)
    edit(c)
    ckpt = tmp_path / "o.checkpoint.json"
    ckpt.write_text(json.dumps(c))
    capsys.readouterr()
    assert main(_score(tmp_path / "o", "--stories", str(stories), "--resume")) == 1
    said = capsys.readouterr().err.strip().splitlines()[-1]  # after the line saying what the exact pass costs
    assert said.startswith(f"storylens: error: {ckpt}: not a valid checkpoint (") and words in said, said
    assert said.endswith("delete it to start again") and not (tmp_path / "o").exists()


def test_the_unedited_checkpoint_resumes(stories, killed, tmp_path):
    (tmp_path / "o.checkpoint.json").write_text(killed)
    assert main(_score(tmp_path / "o", "--stories", str(stories), "--resume")) == 0
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["engine"]["resumed_from"] == 8


def test_an_edited_circuit_checkpoint_is_refused(shipped_model, corpus_split, tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import storylens.corpus.circuit as cc
    from storylens.core.errors import StorylensError
    from storylens.lm import NativeLM

    lm = NativeLM(shipped_model)
    kw = dict(chunk_stories=2, oracle=0, resamples=0, progress=False)
    monkeypatch.setattr(cc, "CHECKPOINT_S", 0.0)
    job = cc.chunk_job

    def dies(lm, j, start, texts):
        if j["phase"] == "scores":
            raise KeyboardInterrupt
        return job(lm, j, start, texts)

    monkeypatch.setattr(cc, "chunk_job", dies)
    with pytest.raises(KeyboardInterrupt):
        cc.circuit_over_stories(lm, list(corpus_split.quiz[:4]), tmp_path / "cut", **kw)
    monkeypatch.setattr(cc, "chunk_job", job)
    ckpt = cc.checkpoint_path(tmp_path / "cut")
    with safe_open(str(ckpt), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(ckpt))
    key = next(iter(tensors))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] += 0.25  # a mean nudged: every bound a sum has still holds
    save_file(tensors, str(ckpt), metadata=meta)
    with pytest.raises(StorylensError, match="digest does not match what it holds"):
        cc.circuit_over_stories(lm, list(corpus_split.quiz[:4]), tmp_path / "cut", resume=True, **kw)
