"""The engine room's measures, read from the source (nothing is imported).

    python scripts/engine_measures.py [--rev REV] [--list]

prints, for the working tree or for a git revision (``--rev``, e.g. the commit before a change):

- **schema spelled outside the detectors**: files other than ``storylens/looking/detectors.py``
  that type the head table's columns themselves: a class body declaring three or more score
  columns as fields, or a tuple, list, set or dict literal (Python) or array/object literal
  (JS, HTML templates) holding three or more of them;
- **probes in the recording pass**: ``getattr``/``hasattr`` calls and ``cast(Any, ...)`` in
  ``storylens/engine/record.py`` and the accumulator that feeds the head table;
- **id()-keyed state**: calls of the builtin ``id`` in the package;
- **functions over 80 lines** (Python, and the JS of ``storylens/viz/static``);
- **unannotated spine parameters**: parameters named ``lm``, ``scores`` or ``model`` with no annotation;
- **files a new built-in detector touches**: the detectors module, its test, and every file of the
  first measure.

tests/test_engine_measures.py holds the package to 0 on each (the last to 2).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DETECTORS = "storylens/looking/detectors.py"
RECORDING = ("storylens/engine/record.py", "storylens/table/accumulator.py")
MAX_LINES = 80
SPINE = ("lm", "scores", "model")
# the head table's score columns, as the lesson and the first faithful round named them (a fixed
# list on purpose: the measure must find them wherever they are spelled, detectors' module or not)
COLUMNS = frozenset(
    {
        "name_mass", "name_baseline", "name_ratio", "prev_token", "prev_argmax", "prev4", "marker",
        "prev_token_first", "prev_argmax_first", "prev4_first", "duplicate_token", "induction",
        "norm_name_mass", "norm_name_ratio", "norm_prev_token", "norm_prev_argmax", "norm_prev4",
        "norm_marker", "norm_duplicate_token", "norm_induction", "output_norm", "output_share",
    }
)  # fmt: skip
WEB = (".js", ".html", ".j2", ".jinja")


@dataclass
class Measures:
    schema: list[str] = field(default_factory=list)  # file: where
    probes: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    long: list[str] = field(default_factory=list)
    untyped: list[str] = field(default_factory=list)

    def touched(self) -> list[str]:
        return [DETECTORS, "tests/analysis/test_detectors.py", *sorted({s.split(":")[0] for s in self.schema})]


def _files(rev: str | None) -> Iterator[tuple[str, str]]:
    if rev is None:
        for p in sorted((ROOT / "storylens").rglob("*")):
            if p.is_file() and p.suffix in (".py", *WEB):
                yield str(p.relative_to(ROOT)), p.read_text()
        return
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "storylens"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in names:
        if name.endswith((".py", *WEB)):
            yield (
                name,
                subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, text=True).stdout,
            )


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _schema_py(name: str, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            typed = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            hits = COLUMNS & set(typed)
            if len(hits) >= 3:
                found.append(f"{name}:{node.lineno} class {node.name} declares {len(hits)} columns")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            hits = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in COLUMNS}
            if len(hits) >= 3:
                found.append(f"{name}:{node.lineno} a literal of {len(hits)} columns")
    # a literal nested in another is counted once, at the outermost
    return sorted(set(found), key=lambda s: int(s.split(":")[1].split()[0]))


def _schema_web(name: str, text: str) -> list[str]:
    found = []
    for m in re.finditer(r"[\[{]([^\[\]{}]*)[\]}]", text):
        hits = set(re.findall(r"""["']?(\w+)["']?\s*[,:\]}]""", m.group(0) + ",")) & COLUMNS
        if len(hits) >= 3:
            found.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1} a literal of {len(hits)} columns")
    return found


def _probes(name: str, tree: ast.Module) -> list[str]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            if n.func.id in ("getattr", "hasattr"):
                out.append(f"{name}:{n.lineno} {n.func.id}")
            elif n.func.id == "cast" and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "Any":
                out.append(f"{name}:{n.lineno} cast(Any, ...)")
    return out


def _ids(name: str, tree: ast.Module) -> list[str]:
    return [
        f"{name}:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "id"
    ]


def _long_py(name: str, tree: ast.Module) -> list[str]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno is not None:
            size = n.end_lineno - n.lineno + 1
            if size > MAX_LINES:
                out.append(f"{name}:{n.lineno} {n.name} ({size} lines)")
    return out


# a JS function: `function name(`, an anonymous `function (` (a callback; named by what it is
# assigned to, if anything), or an arrow whose body is a block, `(a, b) => {` or `a => {`
_JS_FUNCTION = re.compile(
    r"(?:(\w+)\s*[:=]\s*)?(?:async\s+)?(?:function\b\s*(\w*)\s*\(|(?:\([^()]*\)|\b\w+)\s*=>\s*(?=\{))"
)


def _close(text: str, at: int, pair: str) -> int:
    """The index of the bracket closing the one opened at text[at] (pair: "()" or "{}"), by count:
    strings and regexes holding brackets are rare in storylens's JS, and a comment says so where they are."""
    depth = 0
    for i in range(at, len(text)):
        depth += {pair[0]: 1, pair[1]: -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _js_functions(text: str) -> Iterator[tuple[int, str, int]]:
    """(line, name, lines) of every function, callbacks included; a file's module wrapper, the
    `(function () {` that opens a line, is its scope, not a function, and is left out."""
    for m in _JS_FUNCTION.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if text[line_start : m.start()].strip() == "(" and m.group(0).startswith("function"):
            continue
        body = m.end()
        if "function" in m.group(0):  # past the parameters to the body's brace
            body = _close(text, m.end() - 1, "()") + 1
        body += len(text[body:]) - len(text[body:].lstrip())
        if not text.startswith("{", body):
            continue
        end = _close(text, body, "{}")
        name = m.group(1) or m.group(2) or "(anonymous)"
        yield text.count("\n", 0, m.start()) + 1, name, text.count("\n", m.start(), end) + 1


def _long_js(name: str, text: str) -> list[str]:
    """Functions whose braces span more than MAX_LINES lines."""
    return [f"{name}:{line} {fn} ({size} lines)" for line, fn, size in _js_functions(text) if size > MAX_LINES]


def _untyped(name: str, tree: ast.Module) -> list[str]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = n.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                if arg.arg in SPINE and arg.annotation is None and not isinstance(n, ast.Lambda):
                    out.append(f"{name}:{n.lineno} {n.name}({arg.arg})")
    return out


def measure(rev: str | None = None) -> Measures:
    m = Measures()
    for name, text in _files(rev):
        if not name.endswith(".py"):
            if name.startswith("storylens/viz/static/") and name.endswith(".js"):
                m.long += _long_js(name, text)
            m.schema += _schema_web(name, text)
            continue
        tree = ast.parse(text)
        if name != DETECTORS:
            m.schema += _schema_py(name, tree)
        if name in RECORDING:
            m.probes += _probes(name, tree)
        m.ids += _ids(name, tree)
        m.long += _long_py(name, tree)
        m.untyped += _untyped(name, tree)
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", help="measure this git revision instead of the working tree")
    p.add_argument("--list", action="store_true", help="list every finding")
    args = p.parse_args()
    m = measure(args.rev)
    rows = [
        ("files spelling detector columns outside the detectors' module", sorted({s.split(":")[0] for s in m.schema}), m.schema),
        ("probes in the recording pass", m.probes, m.probes),
        ("id()-keyed state (calls of id())", m.ids, m.ids),
        (f"functions over {MAX_LINES} lines", m.long, m.long),
        ("unannotated lm/scores/model parameters", m.untyped, m.untyped),
        ("files a new built-in detector touches", m.touched(), m.touched()),
    ]  # fmt: skip
    print(f"engine room at {args.rev or 'the working tree'}")
    for title, counted, found in rows:
        print(f"  {len(counted):4d}  {title}")
        if args.list:
            for f in found:
                print(f"          {f}")


if __name__ == "__main__":
    main()
