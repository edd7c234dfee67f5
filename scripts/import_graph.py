"""storylens's own import graph, read from the source (no module is imported).

    python scripts/import_graph.py [--edges]

prints the imports of storylens's modules made inside function bodies, the import cycles
between modules (imports inside functions counted too) and, with ``--edges``, every module's
imports. scripts/tree_measures.py reads its cycles (tests/test_layers.py holds the package to none,
and to no import inside a function but the optional dependencies').
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "storylens"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the storylens module imported
    line: int
    in_function: bool


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """``storylens.x.y`` -> its file, for every module and package of the package."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _in_functions(tree: ast.Module) -> set[int]:
    inside = set()
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(f))
    return inside


def imports(package: Path = PACKAGE) -> list[Import]:
    """Every import of one storylens module by another (``from a import b`` of a submodule ``b``
    counts as importing ``a.b``)."""
    names = module_names(package)
    found = []
    for module, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inside = _in_functions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            else:
                continue
            for target in targets:
                while target not in names and "." in target:  # a name from a module: the module
                    target = target.rsplit(".", 1)[0]
                if target in names and target != module:
                    found.append(Import(module, target, node.lineno, id(node) in inside))
    return found


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", action="store_true", help="also print every module's imports")
    args = parser.parse_args(argv)
    edges = imports()
    inner = sorted({(e.source, e.line, e.target) for e in edges if e.in_function})
    print(f"{len(module_names())} modules; {len(inner)} imports of storylens's own modules inside functions")
    for source, line, target in inner:
        print(f"  {source}:{line} -> {target}")
    found = cycles(edges)
    print(f"{len(found)} import cycles" + "".join(f"\n  {' -> '.join(c)}" for c in found))
    if args.edges:
        for source in sorted({e.source for e in edges}):
            print(source, "->", ", ".join(sorted({e.target for e in edges if e.source == source})))


if __name__ == "__main__":
    main()
