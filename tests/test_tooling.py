"""Lint, format and types: ruff and mypy, configured in pyproject.toml, are clean."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> Path:
    tool = Path(sys.executable).with_name(name)
    if not tool.is_file():
        pytest.fail(f"{name} not beside {Path(sys.executable).name}: bash scripts/setup.sh installs it")
    return tool


def _run(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_lint_is_clean():
    done = _run(str(_tool("ruff")), "check", "--no-cache", "--output-format", "concise")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_clean():
    done = _run(str(_tool("ruff")), "format", "--check", "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean():
    # the files come from pyproject.toml ([tool.mypy] files): a bare mypy checks the package
    done = _run(str(_tool("mypy")), "--no-incremental", "--cache-dir", "/dev/null")
    assert done.returncode == 0, done.stdout + done.stderr
