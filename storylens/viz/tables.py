"""Per-head scores as HTML heatmap tables: blocks down, heads across, every cell coloured and
annotated, for a self-contained page (no image to draw, numbers a reader can select and copy).

:func:`head_heatmap_html` takes the same ``[block, head]`` grid, dict or pairs as
:func:`storylens.viz.head_heatmap_figure` and the same colour map; labels are the lesson's
``L{block}H{head}`` (rows ``L1`` .., columns ``H1`` ..), counted from 1.
"""

from __future__ import annotations

import html
from collections.abc import Collection

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_hex

from storylens.core.figures import sign_claimed
from storylens.core.heads import HeadGrid, head_label, parse_head_label
from storylens.viz.score_figures import _colour_range, _is_light, _score_grid

HEATMAP_CSS = (
    ".slh{border-collapse:collapse;margin:.3em 0;font:13px/1.2 system-ui,sans-serif}"
    ".slh caption{font-weight:600;padding:.2em 0 .4em;text-align:left}"
    ".slh th{font-weight:500;color:#444;padding:.25em .5em}"
    ".slh td{width:4.2em;height:1.9em;text-align:center;font-variant-numeric:tabular-nums}"
    ".slh td.best{outline:3px solid #00bfff;outline-offset:-3px}"
    ".slh td.marked{outline:2px dashed #c0392b;outline-offset:-4px}"
)


def head_heatmap_html(
    scores: HeadGrid,
    *,
    title: str = "Score per head",
    fmt: str = "{:.3f}",
    cmap: str = "magma",
    vmin: float | None = None,
    vmax: float | None = None,
    highlight: str | None = None,
    n_block: int | None = None,
    n_head: int | None = None,
    marked: Collection[str] = (),
    mark_name: str = "marked",
    errors: HeadGrid | None = None,
) -> str:
    """A ``<table class="slh">`` heatmap (style: :data:`HEATMAP_CSS`); ``highlight`` (a head label)
    gets a box, the heads in ``marked`` a dashed one (their tooltips say ``mark_name``). With
    ``errors`` (standard errors, same grid), a value within two of them of zero is shown in
    parentheses: its sign is not established. Each cell carries ``data-head="L5H3"`` and ``data-value``."""
    grid = _score_grid(scores, n_block, n_head)
    se = _score_grid(errors, n_block, n_head) if errors is not None else None
    nb, nh = grid.shape
    lo, hi = _colour_range(grid, vmin, vmax)
    cm = colormaps[cmap]
    best = parse_head_label(highlight) if highlight else None
    rows = ["<tr><th></th>" + "".join(f"<th>H{h + 1}</th>" for h in range(nh)) + "</tr>"]
    for b in range(nb):
        cells = [f"<th>L{b + 1}</th>"]
        for h in range(nh):
            v = grid[b, h]
            label = head_label(b, h)
            classes = [c for c, on in (("best", best == (b, h)), ("marked", label in marked)) if on]
            mark = f' class="{" ".join(classes)}"' if classes else ""
            note = f" ({html.escape(mark_name)})" if label in marked else ""
            if not np.isfinite(v):
                cells.append(f'<td{mark} data-head="{label}" style="background:#f4f4f4;color:#777">–</td>')
                continue
            colour = cm((v - lo) / (hi - lo))
            ink = "#000" if _is_light(colour) else "#fff"
            text, tip = fmt.format(v), f"{v:.6g}"
            if se is not None and np.isfinite(se[b, h]):
                tip += f" ± {se[b, h]:.2g}"
            if se is not None and not sign_claimed(float(v), float(se[b, h])):
                text, tip = (
                    f"({text})",
                    tip
                    + (", within two standard errors of zero" if np.isfinite(se[b, h]) else ", no error (one story)")
                    + ": no sign",
                )
            cells.append(
                f'<td{mark} data-head="{label}" data-value="{float(v)!r}" title="{label}: {tip}{note}" '
                f'style="background:{to_hex(colour[:3])};color:{ink}">{html.escape(text)}</td>'
            )
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="slh"><caption>{html.escape(title)}</caption>' + "".join(rows) + "</table>"
