"""The engine room's measures (scripts/engine_measures.py, issue 40) find what they count, and the
package is held to 0 on each: no detector column spelled outside the detectors' module, no probe in the
recording pass, no id()-keyed state, no function over 80 lines (Python or the views' JavaScript,
callbacks included), no unannotated lm/scores/model parameter; a new built-in detector touches its
definition and its test only."""

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _measures():
    spec = importlib.util.spec_from_file_location("engine_measures", ROOT / "scripts" / "engine_measures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_measures"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SAMPLE = """(function () {
  "use strict";
  function named(a, b) {
    return a + b;
  }
  var assigned = function (x) { return x; };
  var spec = {
    fill: function (r, c) {
      return r;
    }
  };
  list.forEach(function (r) {
    use(r);
    use(r);
  });
  var arrow = (a, b) => {
    return a;
  };
  var bare = x => x + 1;
  var n = typeof f === "function" ? f() : f;
})();
"""


def test_every_function_form_is_found_and_the_module_wrapper_is_not():
    found = list(_measures()._js_functions(SAMPLE))
    assert found == [
        (3, "named", 3),
        (6, "assigned", 1),
        (8, "fill", 3),
        (12, "(anonymous)", 4),
        (16, "arrow", 3),
    ]


def test_a_long_callback_is_counted():
    body = "".join(f"    step({i});\n" for i in range(90))
    text = f"(function () {{\n  items.forEach(function (x) {{\n{body}  }});\n}})();\n"
    assert _measures()._long_js("w.js", text) == ["w.js:2 (anonymous) (92 lines)"]


def test_the_shipped_javascript_has_no_function_over_80_lines():
    m = _measures()
    long = [
        s
        for p in sorted((ROOT / "storylens" / "viz" / "static").glob("*.js"))
        for s in m._long_js(p.name, p.read_text())
    ]
    assert long == []


BAD = """
from typing import Any, cast


class Row:
    name_mass: float
    prev_token: float
    marker: float


TITLES = {"name_mass": "a", "prev4": "b", "induction": "c"}


def record(lm, measures, model: object = None):
    streams = [getattr(m, "rows", True) for m in measures]
    fed = {id(m): m for m in measures}
    cast(Any, measures[0]).block_rows(0)
    return hasattr(lm, "stream"), streams, fed
"""


def test_each_python_measure_finds_what_it_counts():
    m = _measures()
    tree = ast.parse(BAD)
    assert [s.split(" ", 1)[1] for s in m._schema_py("x.py", tree)] == [
        "class Row declares 3 columns",
        "a literal of 3 columns",
    ]
    assert len(m._probes("x.py", tree)) == 3  # getattr, cast(Any, ...), hasattr
    assert m._ids("x.py", tree) == ["x.py:16"]
    assert m._untyped("x.py", tree) == ["x.py:14 record(lm)"]  # `model` is annotated
    long = "def f():\n" + "".join(f"    x = {i}\n" for i in range(80))
    assert m._long_py("x.py", ast.parse(long)) == ["x.py:1 f (81 lines)"]


def test_the_package_is_held_to_zero_on_every_measure():
    found = _measures().measure()
    assert found.schema == [], "columns spelled outside storylens/looking/detectors.py"
    assert found.probes == [], "probes in the recording pass"
    assert found.ids == [], "id()-keyed state"
    assert found.long == [], "functions over 80 lines"
    assert found.untyped == [], "unannotated lm/scores/model parameters"
    assert found.touched() == ["storylens/looking/detectors.py", "tests/analysis/test_detectors.py"]
