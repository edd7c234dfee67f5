"""The package's layout, measured from the source (nothing of storylens is imported).

    python scripts/tree_measures.py [--rev REV] [--tree]

prints, for the working tree or a git revision (``--rev``, e.g. the commit before a regroup):

- **the tree** (``--tree``): every folder of the package with its lines of Python and its share of the package;
- **files over 600 lines**, **folders over 25 %** of the package's lines, **functions over 60 lines**
  (from the first decorator to the last line);
- **import cycles** between modules (imports inside functions counted too: ``scripts/import_graph.py``);
- **upward imports**: a module importing a wing above its own, or a wing beside it, by the layers of
  ``[tool.importlinter]`` in that tree's pyproject.toml (imports inside functions counted too);
- **inner imports**: imports inside function bodies, of anything, except the optional dependencies
  (:data:`OPTIONAL`: a core install lacks them, so they are imported where they are needed).

``tests/test_layers.py`` holds the working tree to 0 on each.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import import_graph  # noqa: E402  (beside this script: the import graph read from the source)

MAX_FILE = 600
MAX_SHARE = 0.25
MAX_FUNCTION = 60
# The optional dependencies (pyproject's extras hf, pandas, ray; pyarrow comes with datasets and
# ray[data]): imported inside the functions that need them, so a core install runs without them.
OPTIONAL = frozenset({"transformers", "datasets", "pyarrow", "ray", "pandas"})


@dataclass
class Measures:
    folders: dict[str, int] = field(default_factory=dict)  # folder -> lines of Python
    total: int = 0
    big_files: list[str] = field(default_factory=list)
    big_folders: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)
    upward: list[str] = field(default_factory=list)
    inner: list[str] = field(default_factory=list)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _long_functions(rel: str, tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            size = node.end_lineno - start + 1
            if size > MAX_FUNCTION:
                out.append(f"{rel}:{start} {node.name} ({size} lines)")
    return out


def _inner_imports(rel: str, tree: ast.Module) -> list[str]:
    out = set()
    for f in ast.walk(tree):
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(f):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in OPTIONAL:
                    out.add(f"{rel}:{node.lineno} {name}")
    return sorted(out, key=lambda s: (s.split(":")[0], int(s.split(":")[1].split()[0])))


def _layers(pyproject: Path) -> list[list[str]]:
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            return [[w.strip() for w in layer.split("|")] for layer in contract["layers"]]
    return []


def _wing(module: str, layers: list[list[str]]) -> tuple[int, str] | None:
    for i, layer in enumerate(layers):
        for wing in layer:
            if module == wing or module.startswith(wing + "."):
                return i, wing
    return None


def _upward(edges, layers: list[list[str]]) -> list[str]:
    out = set()
    for e in edges:
        src, dst = _wing(e.source, layers), _wing(e.target, layers)
        if src is None or dst is None or src[1] == dst[1]:
            continue
        if dst[0] < src[0] or dst[0] == src[0]:  # above, or beside in the same layer
            out.add(f"{e.source}:{e.line} -> {e.target}")
    return sorted(out)


def measure(root: Path) -> Measures:
    package = root / "storylens"
    m = Measures()
    for path in sorted(package.rglob("*.py")):
        rel = str(path.relative_to(root))
        n = _lines(path)
        m.total += n
        folder = str(path.parent.relative_to(root)) + "/"
        m.folders[folder] = m.folders.get(folder, 0) + n
        if n > MAX_FILE:
            m.big_files.append(f"{rel} ({n} lines)")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        m.long_functions += _long_functions(rel, tree)
        m.inner += _inner_imports(rel, tree)
    top = "storylens/"
    m.big_folders = [f"{f} ({n / m.total:.0%})" for f, n in m.folders.items() if f != top and n > MAX_SHARE * m.total]
    edges = import_graph.imports(package)
    m.cycles = import_graph.cycles(edges)
    m.upward = _upward(edges, _layers(root / "pyproject.toml"))
    return m


def _checkout(rev: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "archive", rev, "storylens", "pyproject.toml"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def report(m: Measures, what: str, tree: bool) -> str:
    lines = [f"storylens at {what}: {m.total:,} lines of Python"]
    if tree:
        for folder, n in sorted(m.folders.items()):
            lines.append(f"  {folder:24} {n:6,}  {n / m.total:5.1%}")
    rows = [
        (f"files over {MAX_FILE} lines", m.big_files),
        (f"folders over {MAX_SHARE:.0%} of the package", m.big_folders),
        (f"functions over {MAX_FUNCTION} lines", m.long_functions),
        ("import cycles", [" -> ".join(c) for c in m.cycles]),
        ("upward or sideways imports", m.upward),
        ("imports inside functions (other than the optional dependencies)", m.inner),
    ]
    for title, items in rows:
        lines.append(f"{len(items):6}  {title}")
        lines += [f"          {item}" for item in items]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="measure this git revision instead of the working tree")
    parser.add_argument("--tree", action="store_true", help="print every folder with its lines")
    args = parser.parse_args()
    if args.rev:
        with tempfile.TemporaryDirectory() as tmp:
            print(report(measure(_checkout(args.rev, Path(tmp))), args.rev, args.tree))
    else:
        print(report(measure(ROOT), "the working tree", args.tree))


if __name__ == "__main__":
    main()
