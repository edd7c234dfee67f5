"""The package's layers hold: lint-imports checks the contracts in pyproject.toml's
[tool.importlinter] (analysis computes, viz draws, the report is data then a template)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.is_file(), f"{lint.name} not beside {Path(sys.executable).name}: pip install '.[test]'"
    # --no-cache: nothing written into the repository
    done = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"lint-imports exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
