"""``circuit.html``: the circuit as a layered graph (blocks as rows from the input at the bottom to the logits
at the top, heads and MLPs as nodes, edges coloured by the sign of their score and as wide as its size, query,
key and value edges told apart by their dash), a slider over the circuit sizes (the top edges by |score|), the
faithfulness curve, every shown edge in a table, and a click on a head showing its attention on a pair, clean and
corrupt; PNG/SVG export. One self-contained page (jinja2 template
``templates/circuit.html.j2``, data escaped in a ``<script type="application/json">``, scripts inlined under a
Content-Security-Policy that forbids every request)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

import jinja2

from storylens.viz.widget import _json_for_script, _static

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("storylens.viz", "templates"), autoescape=True, keep_trailing_newline=True
)
SHOWN = 300  # the most edges the page draws (the top by |score|): enough for every size up to it


def circuit_html(result: Mapping, *, title: str, pairs: Sequence[Mapping] = ()) -> str:
    """The page for a circuit result as a dict (``CircuitResult.to_dict()``) and, for a click on a head, the first
    pairs' (or stories') tokens and attention (:func:`~storylens.effects.patching.pair_patterns`,
    :func:`~storylens.circuits.stories.story_patterns`)."""
    edges = sorted(result["edges"], key=lambda e: -abs(e["score"]))[:SHOWN]
    data = {k: v for k, v in result.items() if k != "edges"} | {"edges": edges, "pairs": list(pairs)}
    return _ENV.get_template("circuit.html.j2").render(
        title=title,
        verdict=result.get("verdict", ""),
        task=result.get("task", "pairs"),
        ablation=result.get("ablation", "corrupt"),
        nonce=secrets.token_urlsafe(16),
        data=_json_for_script(data),
        export_js=_static("export.js"),
        circuit_js=_static("circuit.js"),
    )
