"""A head table in a notebook: :meth:`HeadScores._repr_html_ <storylens.table.scores.HeadScores>`
shows one column as a compact block x head grid, an HTML ``<table>`` with inline styles (no script,
no stylesheet, nothing fetched), every text escaped.

Blocks run down (``L1`` ..), heads across (``H1`` ..), counted from 1 like the labels. A cell's
shade is its value between the column's smallest and largest (white to blue), a missing value a
grey dash; each cell's tooltip is the head's label and the value to 6 digits.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

_LOW, _HIGH = (255, 255, 255), (33, 102, 172)  # white to a mid blue
_CELL = "padding:2px 6px;text-align:right;font-variant-numeric:tabular-nums;min-width:3.2em"


def _shade(t: float) -> tuple[str, str]:
    """Background and ink for a value at ``t`` in [0, 1] of the column's range."""
    rgb = [round(lo + (hi - lo) * t) for lo, hi in zip(_LOW, _HIGH)]
    light = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 140
    return "#{:02x}{:02x}{:02x}".format(*rgb), "#000" if light else "#fff"


def grid_html(grid: Sequence[Sequence[float | None]], title: str, note: str = "") -> str:
    """``grid[block][head]`` (0-indexed) as a shaded ``<table>`` under ``title`` (and ``note``, smaller)."""
    seen = [v for row in grid for v in row if v is not None and math.isfinite(v)]
    lo, hi = (min(seen), max(seen)) if seen else (0.0, 1.0)
    span = hi - lo or 1.0
    n_head = max((len(row) for row in grid), default=0)
    head_row = "".join(f'<th style="padding:2px 6px">H{h + 1}</th>' for h in range(n_head))
    rows = [f"<tr><th></th>{head_row}</tr>"]
    for b, row in enumerate(grid):
        cells = [f'<th style="padding:2px 6px">L{b + 1}</th>']
        for h, v in enumerate(row):
            label = f"L{b + 1}H{h + 1}"
            if v is None or not math.isfinite(v):
                cells.append(f'<td title="{label}: not computed" style="{_CELL};color:#999">–</td>')
                continue
            bg, ink = _shade((v - lo) / span)
            cells.append(f'<td title="{label}: {v:.6g}" style="{_CELL};background:{bg};color:{ink}">{v:.3f}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    caption = f"<b>{html.escape(title)}</b>" + (f"<br><small>{html.escape(note)}</small>" if note else "")
    return (
        '<table style="border-collapse:collapse;font-size:12px">'
        f'<caption style="caption-side:top;text-align:left">{caption}</caption>' + "".join(rows) + "</table>"
    )
