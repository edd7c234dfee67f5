"""The package's wings hold: lint-imports checks the layered contract in pyproject.toml's
[tool.importlinter] (each wing imports only the wings below it), the import graph read from
the source has no cycle even counting imports inside functions, and the package's own
imports sit at the top of modules."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_IMPORTS = 25  # the package's own imports inside function bodies (issue 22)
MAX_TOP_MODULES = 3  # plain modules beside __init__ and __main__ at the package's top level


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.is_file(), f"{lint.name} not beside {Path(sys.executable).name}: pip install '.[test]'"
    # --no-cache: nothing written into the repository
    done = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"lint-imports exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_no_import_cycle_and_imports_at_the_top():
    graph = _import_graph()
    edges = graph.imports()
    assert edges, "the import graph found no imports: it reads the wrong folder"
    assert graph.cycles(edges) == []
    inner = sorted({(e.source, e.line) for e in edges if e.in_function})
    assert len(inner) <= MAX_FUNCTION_IMPORTS, inner


def test_the_graph_sees_cycles_and_function_imports(tmp_path):
    """The checker itself: a two-module cycle made through a function-level import is found."""
    graph = _import_graph()
    pkg = tmp_path / "storylens"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from storylens.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    edges = graph.imports(pkg)
    assert graph.cycles(edges) == [["storylens.a", "storylens.b"]]
    assert [(e.source, e.target) for e in edges if e.in_function] == [("storylens.b", "storylens.a")]


def test_few_plain_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "storylens").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def _docs_tree() -> set[str]:
    """The module paths the docs' tree names (the ``storylens/`` block of docs/development.md)."""
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    block = text.split("# Inside the package", 1)[1].split("```", 2)[1]
    names, folder = set(), ""
    for line in block.splitlines():
        entry = line.strip().split(" ", 1)[0]
        if not entry or line.startswith(" " * 10):  # a continuation line
            continue
        if entry.endswith("/") and entry != "storylens/":
            folder = entry if line.startswith("  ") and not line.startswith("    ") else folder
        elif entry.endswith(".py"):
            names.add((folder if line.startswith("    ") else "") + entry)
    return names


def test_the_docs_tree_names_every_module():
    modules = {
        str(p.relative_to(ROOT / "storylens"))
        for p in (ROOT / "storylens").rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    assert _docs_tree() == modules
