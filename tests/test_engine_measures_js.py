"""scripts/engine_measures.py reads every JavaScript function of storylens/viz/static, callbacks
included, and none of the shipped views' functions is over a screen long (issue 40, item 6)."""

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
