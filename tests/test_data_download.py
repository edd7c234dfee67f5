"""TinyStories from the Hugging Face Hub: fetched only when asked, read from the user cache as the
hub lays it out, and a one-line message naming the command when it is missing or offline."""

import os
import socket
import subprocess
import sys

import pytest
from test_offline import skip_hub_backoff

from storylens.cli import main
from storylens.data.stories import EOT, HUB_DATASET, HUB_FILES


def test_download_offline_is_one_line(capsys, monkeypatch):
    def refuse(*a, **k):
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    skip_hub_backoff(monkeypatch)
    assert main(["data", "download", "--split", "valid"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"storylens: error: {HUB_DATASET}: could not download {HUB_FILES['valid']} (")


def test_missing_split_names_the_command(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run(
        [sys.executable, "-m", "storylens", "perplexity", "--stories", "tinystories-valid"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 1
    assert r.stderr == (
        "storylens: error: tinystories-valid: the TinyStories valid split is not downloaded here; "
        "get it with: storylens data download --split valid; or leave out --stories to use the "
        "quiz shipped with storylens\n"
    )


@pytest.fixture
def hub_cache(tmp_path, corpus_split):
    """A Hugging Face cache holding TinyStories-valid.txt exactly where hf_hub_download puts it."""
    home = tmp_path / "hf"
    repo = home / "hub" / f"datasets--{HUB_DATASET.replace('/', '--')}"
    sha = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    stories = corpus_split.train[:300] + corpus_split.quiz
    (snap / HUB_FILES["valid"]).write_text("".join(f"{s}\n{EOT}\n" for s in stories))
    return home, stories


def test_reads_the_split_from_the_hub_cache(hub_cache):
    home, stories = hub_cache
    env = {**os.environ, "HF_HOME": str(home), "OMP_NUM_THREADS": "1"}
    code = (
        "from storylens.data import load_split; s = load_split('tinystories-valid'); "
        "t = load_split('tinystories-valid', first=250); "
        "print(len(s.train), len(s.quiz), len(t.train), len(t.quiz), t.quiz[-1][:40])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:4] == ["300", "200", "50", "200"]
    assert stories[249][:40] in r.stdout  # --first N: the first N stories, the last 200 of them the quiz
