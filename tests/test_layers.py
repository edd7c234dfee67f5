"""The package's wings hold: lint-imports checks the layered contract in pyproject.toml's
[tool.importlinter] (each wing imports only the wings below it); scripts/tree_measures.py, reading
the source, finds no file over 600 lines, no folder over a quarter of the package, no function over 60
lines, no import cycle, no upward import and no import inside a function but the optional
dependencies'; the docs' tree names every module; the old module paths still import, with a warning."""

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_TOP_MODULES = 3  # plain modules beside __init__ and __main__ at the package's top level


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _import_graph():
    return _script("import_graph")


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.is_file(), f"{lint.name} not beside {Path(sys.executable).name}: pip install '.[test]'"
    # --no-cache: nothing written into the repository
    done = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"lint-imports exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_the_tree_measures_are_all_zero():
    tree = _script("tree_measures")
    m = tree.measure(ROOT)
    assert m.total > 10_000 and len(m.folders) >= 10, "the measures read the wrong folder"
    assert m.big_files == []
    assert m.big_folders == []
    assert m.long_functions == []
    assert m.cycles == []
    assert m.upward == []
    assert m.inner == []


def test_the_tree_measures_see_what_they_count(tmp_path):
    """The measures themselves, on a made-up package: a long function, an upward import, a sideways
    import, an import inside a function (an optional dependency's is allowed) and a big file are found."""
    tree = _script("tree_measures")
    pkg = tmp_path / "storylens"
    for wing in ("low", "high", "left", "right"):
        (pkg / wing).mkdir(parents=True)
        (pkg / wing / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from storylens.high.b import g\n")  # upward
    (pkg / "left" / "c.py").write_text("from storylens.right.d import h\n")  # sideways
    (pkg / "right" / "d.py").write_text("def h():\n    import json\n    import pandas\n    return json\n")
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    (pkg / "high" / "b.py").write_text(f"def g():\n{body}    return 0\n" + "#\n" * 600)
    (tmp_path / "pyproject.toml").write_text(
        '[[tool.importlinter.contracts]]\nname = "x"\ntype = "layers"\n'
        'layers = ["storylens.high", "storylens.left | storylens.right", "storylens.low"]\n'
    )
    m = tree.measure(tmp_path)
    assert [f.split(":")[0] for f in m.long_functions] == ["storylens/high/b.py"]
    assert m.big_files == ["storylens/high/b.py (663 lines)"]
    assert m.upward == ["storylens.left.c:1 -> storylens.right.d", "storylens.low.a:1 -> storylens.high.b"]
    assert m.inner == ["storylens/right/d.py:2 json"]
    assert m.big_folders  # high/ holds most of this package


OLD_PATHS = json.loads((ROOT / "tests" / "old_paths.json").read_text())  # the public names before the regroup


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_module_path_imports_with_a_warning(old):
    """Every module that moved imports from its old path for one release, with a DeprecationWarning that
    names where it went, and holds every public name it held (the same objects as the new homes')."""
    from storylens.core.moved import MOVED

    sys.modules.pop(old, None)
    parent, _, child = old.rpartition(".")
    vars(importlib.import_module(parent)).pop(child, None)
    with pytest.warns(DeprecationWarning, match=f"{old} has moved to {MOVED[old][0]}"):
        module = importlib.import_module(old)
    homes = [importlib.import_module(new) for new in MOVED[old]]
    for name in OLD_PATHS[old]:
        assert hasattr(module, name), f"{old}.{name} is gone"
        assert any(getattr(home, name, None) is getattr(module, name) for home in homes), f"{old}.{name}"


def test_the_new_paths_import_without_a_warning():
    code = (
        "import warnings; warnings.simplefilter('error');"
        "import storylens, storylens.analysis, storylens.lm, storylens.cli, storylens.corpus.score, storylens.lesson.report;"
        "from storylens.analysis import score_heads; from storylens.lm import load_lm;"
        "from storylens import load_patch, load_heads"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_an_old_submodule_is_an_attribute_too():
    import storylens.analysis

    sys.modules.pop("storylens.analysis.truth", None)
    vars(storylens.analysis).pop("truth", None)  # set by an earlier import of the submodule
    with pytest.warns(DeprecationWarning, match="storylens.analysis.truth has moved to storylens.table.truth"):
        truth = storylens.analysis.truth
    assert truth.truth_table is importlib.import_module("storylens.table.truth").truth_table
    with pytest.raises(AttributeError):
        storylens.analysis.no_such_module  # noqa: B018


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
    blocks = text.split("# Inside the package", 1)[1].split("```")[1::2]
    block = next(b for b in blocks if b.lstrip().startswith("storylens/"))
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


def test_an_old_path_is_the_code_itself():
    """What a test or a user sets on an old path reaches the code that reads it, split module or not, and
    importing an old path leaves the new module's own spec (so reload and resources still find it)."""
    import storylens.effects.cost as cost
    import storylens.looking.sinks as sinks

    for old in ("storylens.analysis.truth", "storylens.analysis.sinks"):  # imported afresh
        sys.modules.pop(old, None)
        vars(importlib.import_module("storylens.analysis")).pop(old.rsplit(".", 1)[1], None)
    with pytest.warns(DeprecationWarning):
        old_truth = importlib.import_module("storylens.analysis.truth")
        importlib.import_module("storylens.analysis.sinks")
    limit = cost.ABLATION_LIMIT_FLOPS
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(old_truth, "ABLATION_LIMIT_FLOPS", 5.0)
        assert cost.ABLATION_LIMIT_FLOPS == 5.0 == old_truth.ABLATION_LIMIT_FLOPS
    assert cost.ABLATION_LIMIT_FLOPS == limit == old_truth.ABLATION_LIMIT_FLOPS  # put back, not deleted
    assert sinks.__spec__.name == "storylens.looking.sinks" and sinks.__spec__.origin == sinks.__file__
    assert "truth_table" in dir(old_truth) and old_truth.check_ablation_budget is cost.check_ablation_budget


def test_a_name_that_left_a_module_still_imports_from_it():
    from storylens.viz.name_head import name_head_figure
    from storylens.viz.score_figures import head_heatmap_figure

    with pytest.warns(DeprecationWarning, match="storylens.viz.figures.name_head_figure has moved"):
        from storylens.viz.figures import name_head_figure as old
    assert old is name_head_figure
    with pytest.warns(DeprecationWarning, match="head_heatmap_figure has moved"):
        from storylens.viz.figures import head_heatmap_figure as old_heatmap
    assert old_heatmap is head_heatmap_figure
    with pytest.raises(ImportError):
        from storylens.viz.figures import no_such_figure  # noqa: F401
