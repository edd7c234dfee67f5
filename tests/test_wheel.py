"""storylens as a learner gets it: a built wheel in a fresh virtual environment, run from an
unrelated folder with no corpus anywhere and no checkout on the path."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    d = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(d / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next((d / "dist").glob("storylens-*.whl"))
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "-q",
            "--disable-pip-version-check",
            "-c",
            str(ROOT / "constraints.txt"),
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return wheel, venv


def run(venv, cwd, *argv):
    env = {k: v for k, v in os.environ.items() if k not in ("STORYLENS_STORIES", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [str(venv / "bin" / "storylens"), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_wheel_carries_the_model_quiz_and_licences(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    folder = "storylens/pretrained/tiny-storyteller/"
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "quiz.txt.gz",
        "leakage.json",
        "LICENSE-DATA.md",
    ):
        assert folder + f in names, f
    assert "storylens/viz/static/widget.js" in names and "storylens/licenses/CDLA-Sharing-1.0.txt" in names
    assert {
        f"storylens/schemas/{s}.schema.json" for s in ("heads", "examples", "summary-score", "summary-report")
    } <= names
    assert any(n.endswith("/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    assert not any(n.startswith(("tests/", "notebooks/", "benchmarks/")) for n in names)


def test_fresh_environment_runs_the_lesson_with_no_corpus(installed, tmp_path):
    _, venv = installed
    work = tmp_path / "somewhere" / "else"
    work.mkdir(parents=True)
    assert not (work.parent / "shared").exists() and not (work / ".." / ".." / "shared").exists()
    r = run(venv, work, "--version")
    assert r.returncode == 0 and r.stdout.startswith("storylens ")
    r = run(venv, work, "generate", "Once upon a time", "--max-new-tokens", "20", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time") and len(r.stdout.split()) > 6
    r = run(venv, work, "report", "--out", "report")
    assert r.returncode == 0, r.stderr
    assert "stored with the model" in r.stdout and "top name head: L" in r.stdout
    assert {"report.html", "heads.csv", "heads.json", "summary.json"} <= {p.name for p in (work / "report").iterdir()}
    r = run(venv, work, "check", "--n-stories", "4", "--gen-tokens", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 quiz stories" in r.stdout and "float64" in r.stdout
    r = run(venv, work, "perplexity")
    assert r.returncode == 0 and "quiz stories shipped with the model" in r.stdout, r.stderr
    r = run(venv, work, "train", "--out", "run")  # needs a corpus: says which command gets one
    assert r.returncode == 1
    assert r.stderr.strip().endswith("or get TinyStories with: storylens data download (then --stories tinystories)")
