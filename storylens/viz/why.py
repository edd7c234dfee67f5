"""``why.html``: one head's query-key attribution (:mod:`storylens.looking.why`) as a page: the largest terms as
sentences, and every (query-side writer, key-side writer) term as a table shaded by its mean (red raises the chosen
keys' scores, blue lowers them), each with its standard error. One self-contained file (jinja2 template
``templates/why.html.j2``), no network, the data also in a ``<script type="application/json">`` with ``<``, ``>``
and ``&`` escaped."""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Mapping, Sequence

import jinja2

from storylens.core.figures import plus_minus, sign_claimed
from storylens.viz.widget import _json_for_script, _static

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("storylens.viz", "templates"), autoescape=True, keep_trailing_newline=True
)
SAID = {
    "name": "queries after the first mention and the name tokens before them",
    "prev": "queries and the position just before each",
    "first": "queries and position 0 (the opening token)",
    "induction": "queries and the token after an earlier copy of each one's token",
    "custom": "the (query, key) pairs a file names",
}


def _color(value: float, top: float) -> str:
    """Red for positive, blue for negative, white at 0; full strength at ``top``."""
    a = 0.0 if not top or not math.isfinite(value) else min(abs(value) / top, 1.0)
    r, g, b = (220, 60, 50) if value > 0 else (50, 100, 220)
    return f"rgba({r},{g},{b},{a * 0.85:.3f})"


def _digits(se: float | None) -> int:
    """Decimals that show an error's first two digits (3 at least): no error printed as 0.000."""
    if se is None or not math.isfinite(se) or se <= 0 or se >= 0.005:
        return 3
    return min(-math.floor(math.log10(se)) + 1, 8)


def sentence(doc: Mapping, term: Mapping) -> str:
    """One term as a sentence (the form the issue asks for). A term within two standard errors of 0 (or with no
    error: one story) is not claimed as a reason: the sentence says so instead."""
    said = plus_minus(term["mean"], term["se"], _digits(term["se"]))
    contrast = f"{plus_minus(doc['total'], doc['total_se'])} logit contrast"
    if not sign_claimed(term["mean"], term["se"]):
        return (
            f"{doc['head']}: {term['query']} on the query with {term['key']} on the key, {said} of the {contrast}, "
            "is not told apart from 0 (within two standard errors, or no error from one story)"
        )
    return (
        f"{doc['head']} finds the {doc['positions']} keys because {term['query']} on the query meets "
        f"{term['key']} on the key: {said} of the {contrast} ({100 * term['share']:.0f} %)"
    )


SHOWN_WRITERS = 24  # the table's rows and columns: past this many writers, the largest and one "other writers"


def shown_terms(doc: Mapping) -> tuple[list[str], list[list[float]], list[list[float | None]]]:
    """The writers, means and errors the table shows: every writer where there are at most :data:`SHOWN_WRITERS`;
    else the ``SHOWN_WRITERS - 1`` whose terms are largest (a row's and a column's sizes together) and one "other
    writers" row and column holding the rest's sum (exact; its error not known from the terms' own, so none)."""
    writers, mean, se = list(doc["writers"]), doc["mean"], doc["se"]
    if len(writers) <= SHOWN_WRITERS:
        return writers, mean, se
    size = [sum(abs(v) for v in mean[i]) + sum(abs(row[i]) for row in mean) for i in range(len(writers))]
    kept = sorted(sorted(range(len(writers)), key=lambda i: -size[i])[: SHOWN_WRITERS - 1])
    rest = [i for i in range(len(writers)) if i not in set(kept)]
    groups = [[i] for i in kept] + [rest]
    means = [[sum(mean[a][b] for a in ga for b in gb) for gb in groups] for ga in groups]
    ses = [[se[ga[0]][gb[0]] if len(ga) == len(gb) == 1 else None for gb in groups] for ga in groups]
    return [writers[i] for i in kept] + [f"{len(rest)} other writers"], means, ses


HEAD_WRITER = re.compile(r"^L[1-9][0-9]*H[1-9][0-9]*$")


def writer_links(writers: Sequence[str], explorer: str | None) -> dict[str, str]:
    """Each writer that is a head, to its own page: ``explorer#L2H1`` (an explore.html, which opens the head its
    address names); none without an explorer."""
    if not explorer:
        return {}
    return {w: f"{explorer}#{w}" for w in writers if HEAD_WRITER.match(w)}


def why_html(doc: Mapping, *, title: str, explorer: str | None = None) -> str:
    """The page for a why.json document ``doc``; ``explorer``: the address of an explore.html (relative to the page)
    whose head pages the writer heads link to."""
    writers, mean, se = shown_terms(doc)
    links = writer_links(writers, explorer)
    top = max((abs(v) for row in mean for v in row), default=0.0)
    rows = []
    for w, means, ses in zip(writers, mean, se):
        cells = []
        for key, m, s in zip(writers, means, ses):
            beyond = s is not None and math.isfinite(s) and abs(m) > 2 * s
            text = f"{m:+.2f}" if beyond else f"({m:+.2f})"
            cells.append(
                {"color": _color(m, top), "title": f"{w} x {key}: {plus_minus(m, s, _digits(s))}", "text": text}
            )
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
        top=[
            {
                "sentence": sentence(doc, t),
                "links": [(w, links[w]) for w in dict.fromkeys((t["query"], t["key"])) if w in links],
            }
            for t in doc["top"]
        ],
        links=links,
        writers=writers,
        folded=len(writers) < len(doc["writers"]),
        all_writers=len(doc["writers"]),
        rows=rows,
        nonce=secrets.token_urlsafe(16),
        data=_json_for_script(dict(doc)),
        export_js=_static("export.js"),
    )
