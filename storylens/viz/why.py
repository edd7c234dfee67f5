"""``why.html``: one head's query-key attribution (:mod:`storylens.looking.why`) as a page: the largest terms as
sentences, and every (query-side writer, key-side writer) term as a table shaded by its mean (red raises the chosen
keys' scores, blue lowers them), each with its standard error. One self-contained file (jinja2 template
``templates/why.html.j2``), no network, the data also in a ``<script type="application/json">`` with ``<``, ``>``
and ``&`` escaped."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping

import jinja2

from storylens.core.figures import plus_minus
from storylens.viz.widget import _json_for_script, _static

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("storylens.viz", "templates"), autoescape=True, keep_trailing_newline=True
)
SAID = {
    "name": "queries after the first mention and the name tokens before them",
    "prev": "queries and the position just before each",
    "first": "queries and position 0 (the opening token)",
    "induction": "queries and the token after an earlier copy of each one's token",
}


def _color(value: float, top: float) -> str:
    """Red for positive, blue for negative, white at 0; full strength at ``top``."""
    a = 0.0 if not top or not math.isfinite(value) else min(abs(value) / top, 1.0)
    r, g, b = (220, 60, 50) if value > 0 else (50, 100, 220)
    return f"rgba({r},{g},{b},{a * 0.85:.3f})"


def sentence(doc: Mapping, term: Mapping) -> str:
    """One term as a sentence (the form the issue asks for)."""
    return (
        f"{doc['head']} finds the {doc['positions']} keys because {term['query']} on the query meets "
        f"{term['key']} on the key: {plus_minus(term['mean'], term['se'])} of the "
        f"{plus_minus(doc['total'], doc['total_se'])} logit contrast ({100 * term['share']:.0f} %)"
    )


def why_html(doc: Mapping, *, title: str) -> str:
    """The page for a why.json document ``doc``."""
    writers = list(doc["writers"])
    top = max((abs(v) for row in doc["mean"] for v in row), default=0.0)
    rows = []
    for w, means, ses in zip(writers, doc["mean"], doc["se"]):
        cells = []
        for key, m, s in zip(writers, means, ses):
            known = s is not None and math.isfinite(s)
            text = f"{m:+.2f}" if known and abs(m) > 2 * s else f"({m:+.2f})"
            cells.append({"color": _color(m, top), "title": f"{w} x {key}: {plus_minus(m, s)}", "text": text})
        rows.append({"writer": w, "cells": cells})
    headline = (
        f"{doc['head']}: the {doc['positions']} keys score {plus_minus(doc['total'], doc['total_se'])} above the "
        f"average key ({doc['stories']} stories)"
    )
    return _ENV.get_template("why.html.j2").render(
        title=title,
        headline=headline,
        positions_said=SAID[doc["positions"]],
        stories=doc["stories"],
        pairs=doc["pairs"],
        gap=f"{doc['check']['gap']:.1e}",
        bound=f"{doc['check']['bound']:.1e}",
        top=[{"sentence": sentence(doc, t)} for t in doc["top"]],
        writers=writers,
        rows=rows,
        nonce=secrets.token_urlsafe(16),
        data=_json_for_script(dict(doc)),
        export_js=_static("export.js"),
    )
