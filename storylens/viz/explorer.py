"""The corpus explorer: every head of a score run in one self-contained offline page (explore.html).

What it shows (built in the browser by ``static/explorer.js``, styled by ``static/explorer.css``):

* the head table: every column of heads.json, sortable by any column, filtered by expressions
  such as ``prev_token > 0.5`` or ``norm_marker >= 0.1 and output_share < 0.02``, or to the heads
  flagged as looking without moving;
* a layer x head grid of one chosen column, coloured like a heatmap with the value in each cell;
* the chosen head's top examples for one detector, at first the head's strongest (the detector on
  which its score is the largest share of the best head's): the story's tokens around each query,
  the query marked, the earlier tokens shaded by its attention, and the most-attended key marked
  and named; where that key lies before the query's window, the tokens around it come first, after
  a gap mark. The chosen example's attention over those tokens is a bar strip, so it always holds
  the key's bar. ``storylens score`` keeps at most
  :data:`~storylens.looking.example_store.PER_STORY` examples of one story per head and detector.

Every view saves as PNG and SVG (``static/export.js``, the same colours and labels as on screen).

**Size.** The page embeds the examples, never the corpus: its size grows with heads x detectors x
examples kept, not with the stories scored. Each ``(story, query)`` a head keeps is embedded once
however many of its detectors keep it, as token indices into one table of token texts, with its
weights as whole numbers of 1e-4 (``weights`` keep 4 decimals), with its key's window only where the
key lies before the query's. A 30 x 9-head model with 8 examples of 7 detectors makes a page of about
1.9 MiB, some 120 bytes per head x detector x example (measured in
``tests/viz/test_explorer_browser.py``).

Story text reaches the page only as JSON data (:func:`~storylens.viz.widget._json_for_script`) and
the DOM only through ``textContent``. The page's Content-Security-Policy, from
:meth:`~storylens.viz.widget._HtmlView.to_html`, forbids every network request.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from storylens.core.errors import StorylensError
from storylens.core.publish import write_text_atomic
from storylens.viz.widget import _HtmlView, _json_for_script, _static

__all__ = [
    "EXPLORER_FILE",
    "WEIGHT_SCALE",
    "explorer_data",
    "explorer_html",
    "explorer_view",
    "write_explorer",
    "write_explorer_for",
]

EXPLORER_FILE = "explore.html"
WEIGHT_SCALE = 10_000  # weights embedded as whole numbers of 1e-4: examples keep 4 decimals
_HEAD_KEYS = ("label", "block", "head")


def _finite(x):
    """A table value as JSON allows it: a NaN or infinity becomes None (shown as n/a)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _table(heads: Sequence[Mapping]) -> tuple[list[str], list[list], list[int]]:
    """The rows of heads.json as (columns, one list of values per head, [blocks, heads]); every head
    named once with whole-number block and head counted from 1."""
    if not heads:
        raise ValueError("explorer: no heads")
    columns = list(heads[0])
    if any(k not in columns for k in _HEAD_KEYS):
        raise ValueError(f"explorer: a head row needs {', '.join(_HEAD_KEYS)} (got {', '.join(columns)})")
    rows, seen = [], set()
    for row in heads:
        if list(row) != columns:
            raise ValueError(f"explorer: head {row.get('label')!r} has other columns than the first head")
        place = (row["block"], row["head"])
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in place) or place in seen:
            raise ValueError(f"explorer: head {row['label']!r}: block and head must be whole numbers from 1, once each")
        seen.add(place)
        rows.append([_finite(row[k]) for k in columns])
    shape = [max(b for b, _ in seen), max(h for _, h in seen)]
    return columns, rows, shape


def _examples(examples: Mapping, labels: Sequence[str]) -> dict:
    """examples.json made compact for the page: per head (in the table's order) each kept ``(story,
    query)`` once as a *site* ``[story, query, query_at, key, key_weight, key token, [tokens],
    [weights in 1e-4], key window]``, and per detector its examples best first as ``[site, value]``;
    token texts as indices into one shared list. The key window is None where the key lies in the
    query's window, else ``[key_at, [key tokens], [key weights in 1e-4]]``."""
    texts: dict[str, int] = {}

    def text(s: str) -> int:
        return texts.setdefault(str(s), len(texts))

    detectors = list(examples["detectors"])
    by_label = {h["label"]: h["examples"] for h in examples["heads"]}
    per_head = []
    for label in labels:
        sites: list[list] = []
        where: dict[tuple[int, int], int] = {}
        top: dict[str, list] = {}
        for name in detectors:
            ranked = []
            for x in by_label.get(label, {}).get(name, []):
                at = (x["story"], x["query"])
                if at not in where:
                    where[at] = len(sites)
                    sites.append(
                        [
                            x["story"],
                            x["query"],
                            x["query_at"],
                            x["key"],
                            x["key_weight"],
                            text(x["key_tokens"][x["key_at"]]),
                            [text(t) for t in x["tokens"]],
                            [round(w * WEIGHT_SCALE) for w in x["weights"]],
                            _key_window(x, text),
                        ]
                    )
                ranked.append([where[at], x["value"]])
            top[name] = ranked
        per_head.append({"sites": sites, "top": top})
    per_story = examples.get("per_story")  # None: no limit (and examples.json before the limit)
    return {"k": examples["k"], "perStory": per_story, "detectors": detectors, "tokens": list(texts), "heads": per_head}


def _key_window(x: Mapping, text) -> list | None:
    """An example's key window for the page: None where the key is among the query's window's tokens."""
    if x["key"] >= x["query"] - x["query_at"]:
        return None
    return [x["key_at"], [text(t) for t in x["key_tokens"]], [round(w * WEIGHT_SCALE) for w in x["key_weights"]]]


def explorer_data(
    heads: Sequence[Mapping],
    examples: Mapping | None,
    *,
    title: str,
    meta: Mapping,
    meanings: Mapping[str, str] | None = None,
) -> dict:
    """What the page embeds: the head table, its grid shape, ``meta`` (shown as given, in order),
    what each column means (``meanings``: heads.json's ``columns``, shown on the column headings and
    under the flag) and the examples (None: the page has the table and the grid only). ``heads`` are
    the rows of heads.json, ``examples`` the parsed examples.json."""
    columns, rows, shape = _table(heads)
    about = {str(k): str(v) for k, v in (meanings or {}).items() if k in columns}
    data = {
        "title": str(title),
        "meta": dict(meta),
        "columns": columns,
        "meanings": about,
        "rows": rows,
        "shape": shape,
    }
    if examples is None:
        return {**data, "examples": None}
    try:
        compact = _examples(examples, [str(r[columns.index("label")]) for r in rows])
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"explorer: the examples are not what examples.json holds ({type(e).__name__}: {e})") from None
    return {**data, "examples": compact}


class _Explorer(_HtmlView):
    """The explorer as a page (:meth:`to_html`, with the widget's no-network policy) or a notebook
    fragment (:meth:`_repr_html_`)."""

    kind = "explorer"

    def __init__(self, data: dict):
        super().__init__(data["title"])
        self._data = data

    def data(self) -> dict:
        return self._data

    def _fragment(self, nonce: str | None = None) -> str:
        uid = "sle-" + secrets.token_hex(6)
        n = f' nonce="{nonce}"' if nonce else ""
        boot = f"window.StorylensExplorer.mount({json.dumps(uid)});"
        return (
            f"<style{n}>{_static('explorer.css')}</style>\n"
            f'<div class="sle-root" id="{uid}"><p class="sle-loading">Loading the explorer… '
            "(if this message stays, JavaScript is off here)</p></div>\n"
            f'<script type="application/json" id="{uid}-data">{_json_for_script(self._data)}</script>\n'
            f"<script{n}>{_static('export.js')}\n{_static('explorer.js')}\n{boot}</script>\n"
        )


def explorer_view(
    heads: Sequence[Mapping],
    examples: Mapping | None,
    *,
    title: str,
    meta: Mapping,
    meanings: Mapping[str, str] | None = None,
) -> _Explorer:
    """The explorer as a notebook view: the last expression of a Jupyter cell (or ``display(...)``)
    shows it inline, the same page :func:`explorer_html` writes; ``.to_html()`` is that page."""
    return _Explorer(explorer_data(heads, examples, title=title, meta=meta, meanings=meanings))


def explorer_html(
    heads: Sequence[Mapping],
    examples: Mapping | None,
    *,
    title: str,
    meta: Mapping,
    meanings: Mapping[str, str] | None = None,
) -> str:
    """The explorer as one self-contained HTML page (see the module docstring and :func:`explorer_data`)."""
    return explorer_view(heads, examples, title=title, meta=meta, meanings=meanings).to_html()


def write_explorer(
    path: str | os.PathLike,
    heads: Sequence[Mapping],
    examples: Mapping | None,
    *,
    title: str,
    meta: Mapping,
    meanings: Mapping[str, str] | None = None,
) -> Path:
    """Write :func:`explorer_html` to ``path`` atomically; returns the path."""
    return write_text_atomic(path, explorer_html(heads, examples, title=title, meta=meta, meanings=meanings))


def write_explorer_for(folder: str | os.PathLike, *, title: str, meta: Mapping | None = None) -> Path:
    """``folder/explore.html`` from the heads.json and (when there) examples.json already written
    into ``folder``, as ``storylens score`` and ``storylens report`` leave them; returns its path."""
    folder = Path(folder)
    try:
        doc = json.loads((folder / "heads.json").read_text(encoding="utf-8"))
        heads = doc["heads"]
        meanings = {str(c["name"]): str(c["meaning"]) for c in doc.get("columns", ())}
        found = folder / "examples.json"
        examples = json.loads(found.read_text(encoding="utf-8")) if found.exists() else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StorylensError(f"{folder}: no readable heads.json or examples.json ({type(e).__name__})") from None
    return write_explorer(folder / EXPLORER_FILE, heads, examples, title=title, meta=meta or {}, meanings=meanings)
