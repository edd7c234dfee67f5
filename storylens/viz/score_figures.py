"""Per-head scores as figures: a bar per head against a baseline, a blocks x heads heatmap.

Drawn with matplotlib's Agg canvas, without pyplot (see :mod:`storylens.viz.figures`, which writes
them out). Scores come as a ``[block, head]`` array, a ``{"L5H3": value}`` dict or ``(label, value)``
pairs; head labels count from 1, arrays stay 0-indexed. :mod:`storylens.viz.tables` draws the same
heatmap as an HTML table with the helpers here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from storylens.core.figures import sign_claimed
from storylens.core.heads import HeadGrid, parse_head_label
from storylens.viz.figures import NAME_COLOR, _new_figure

__all__ = ["name_mass_bar_figure", "head_heatmap_figure"]


def name_mass_bar_figure(
    scores: Sequence[tuple[str, float]],
    baseline: float,
    *,
    title: str | None = None,
    ylabel: str = "name mass (share of attention on the name)",
    sort: bool = False,
    baseline_label: str | None = None,
) -> Figure:
    """Bar chart of a per-head score (e.g. name mass) with the even-spread baseline.

    ``scores`` is a list of ``(head label, value)`` pairs, drawn in the given order
    (``sort=True`` orders them from highest). Bars above the baseline are coloured,
    the rest grey; each bar is annotated with its value and its ratio to the baseline.
    """
    items = [(str(label), float(v)) for label, v in scores]
    if not items:
        raise ValueError("no scores to plot")
    if sort:
        items.sort(key=lambda lv: lv[1], reverse=True)
    labels = [label for label, _ in items]
    values = np.array([v for _, v in items])
    fig = _new_figure((max(5.0, 0.42 * len(items) + 2.2), 4.2))
    ax = fig.add_subplot()
    colors = ["#1f77b4" if v > baseline else "#b0b0b0" for v in values]
    bars = ax.bar(range(len(items)), values, color=colors, edgecolor="#333333", linewidth=0.5)
    ax.axhline(
        baseline,
        color=NAME_COLOR,
        linestyle="--",
        linewidth=1.5,
        label=baseline_label or f"even-spread baseline {baseline:.3f}",
    )
    fs = 8 if len(items) <= 12 else 6
    for rect, v in zip(bars, values):
        txt = f"{v:.3f}"
        if baseline > 0 and len(items) <= 12:
            txt += f"\n{v / baseline:.1f}×"
        ax.text(rect.get_x() + rect.get_width() / 2, rect.get_height(), txt, ha="center", va="bottom", fontsize=fs)
    ax.set_xticks(range(len(items)), labels, rotation=0 if len(items) <= 12 else 90, fontsize=9)
    ax.set_xlabel("head (block, head; counted from 1)")
    ax.set_ylabel(ylabel)
    top = max(float(values.max()), baseline)
    ax.set_ylim(0, top * 1.22 if top > 0 else 1)
    ax.legend(loc="upper right", fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title or "Name mass per head against an even spread", fontsize=11)
    return fig


def _score_grid(scores: HeadGrid, n_block: int | None, n_head: int | None) -> np.ndarray:
    if isinstance(scores, Mapping):
        parsed = {parse_head_label(k): float(v) for k, v in scores.items()}
        nb = n_block or (max(b for b, _ in parsed) + 1)
        nh = n_head or (max(h for _, h in parsed) + 1)
        grid = np.full((nb, nh), np.nan)
        for (b, h), v in parsed.items():
            grid[b, h] = v
        return grid
    if (
        isinstance(scores, (list, tuple))
        and scores
        and isinstance(scores[0], (list, tuple))
        and len(scores[0]) == 2
        and isinstance(scores[0][0], str)
    ):
        return _score_grid(dict(scores), n_block, n_head)
    grid = np.asarray(scores, dtype=float)
    if grid.ndim != 2:
        raise ValueError(
            f"scores must be [block, head], a {{label: value}} dict or (label, value) pairs; got shape {grid.shape}"
        )
    return grid


def _colour_range(grid: np.ndarray, vmin: float | None, vmax: float | None) -> tuple[float, float]:
    """The colour scale of a score grid: ``vmin``/``vmax`` when given, else its finite extremes."""
    finite = grid[np.isfinite(grid)]
    lo = vmin if vmin is not None else (float(finite.min()) if finite.size else 0.0)
    hi = vmax if vmax is not None else (float(finite.max()) if finite.size else 1.0)
    return lo, (hi if hi > lo else lo + 1e-9)


def _is_light(rgba) -> bool:
    """Black text reads on this colour (perceived brightness above one half), else white."""
    r, g, b = rgba[:3]
    return 0.299 * r + 0.587 * g + 0.114 * b > 0.5


def _annotate_cells(ax, grid: np.ndarray, se: np.ndarray | None, fmt: str, cm, scale: tuple[float, float]) -> None:
    """Write each cell's value (``fmt``) in black or white, whichever reads on its colour (``cm`` over
    ``scale``); "–" where there is none; in parentheses within two standard errors ``se`` of zero."""
    lo, hi = scale
    nb, nh = grid.shape
    for b in range(nb):
        for h in range(nh):
            v = grid[b, h]
            if not np.isfinite(v):
                ax.text(h, b, "–", ha="center", va="center", fontsize=9, color="#777777")
                continue
            unsure = se is not None and not sign_claimed(float(v), float(se[b, h]))  # no sign: within 2 se, or no se
            ax.text(
                h,
                b,
                f"({fmt.format(v)})" if unsure else fmt.format(v),
                ha="center",
                va="center",
                fontsize=9,
                color="black" if _is_light(cm((v - lo) / (hi - lo))) else "white",
            )


def head_heatmap_figure(
    scores: HeadGrid,
    *,
    title: str = "Score per head",
    colorbar_label: str = "score",
    fmt: str = "{:.3f}",
    cmap: str = "magma",
    vmin: float | None = None,
    vmax: float | None = None,
    highlight: str | None = None,
    n_block: int | None = None,
    n_head: int | None = None,
    errors: HeadGrid | None = None,
) -> Figure:
    """A blocks x heads heatmap of any per-head score, every cell annotated.

    ``scores`` is a ``[block, head]`` array, a ``{"L5H3": value}`` dict or a list of
    ``(label, value)`` pairs. Rows are L1..L6, columns H1..H4. ``highlight`` (a head
    label) gets a box drawn round it. With ``errors`` (standard errors, same grid), a value
    within two of them of zero is written in parentheses: its sign is not established.
    """
    grid = _score_grid(scores, n_block, n_head)
    se = _score_grid(errors, n_block, n_head) if errors is not None else None
    nb, nh = grid.shape
    # compact (two fit side by side on a page), laid out in fixed inches: no layout engine to run
    width, height = 0.95 * nh + 1.9, 0.42 * nb + 1.3
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    left, right, top, bottom, bar = 0.62, 1.05, 0.8, 0.12, 0.14
    ax = fig.add_axes((left / width, bottom / height, (width - left - right) / width, (height - top - bottom) / height))
    cax = fig.add_axes(((width - right + 0.12) / width, bottom / height, bar / width, (height - top - bottom) / height))
    lo, hi = _colour_range(grid, vmin, vmax)
    cm = colormaps[cmap]
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cm, vmin=lo, vmax=hi, aspect="auto")
    _annotate_cells(ax, grid, se, fmt, cm, (lo, hi))
    ax.set_xticks(range(nh), [f"H{h + 1}" for h in range(nh)])
    ax.set_yticks(range(nb), [f"L{b + 1}" for b in range(nb)])
    ax.set_xlabel("head")
    ax.set_ylabel("block (layer)")
    ax.tick_params(length=0)
    ax.xaxis.set_ticks_position("top")
    ax.xaxis.set_label_position("top")
    if highlight:
        hb, hh = parse_head_label(highlight)
        ax.add_patch(Rectangle((hh - 0.5, hb - 0.5), 1, 1, fill=False, edgecolor="#00bfff", linewidth=2.5))
    cb = fig.colorbar(im, cax=cax)
    cb.set_label(colorbar_label)
    fig.suptitle(title, fontsize=11, y=1 - 0.08 / height, va="top")
    return fig
