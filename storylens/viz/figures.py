"""The lesson's figures, drawn with matplotlib's Agg canvas.

Every function takes plain data (token texts, numpy arrays, lists of scores) and
returns a :class:`matplotlib.figure.Figure`. Figures are built without pyplot, so
nothing here changes the caller's matplotlib backend or piles up open figures.
Head labels count from 1 (``L5H3``); arrays stay 0-indexed.

Save with :func:`save_png`, or embed in a self-contained HTML page with
:func:`figure_data_uri`.

This module draws the causal mask and every head on one story, and writes any figure out;
:mod:`storylens.viz.score_figures` draws per-head scores (bars, heatmaps) and
:mod:`storylens.viz.name_head` one head's view of a story.
"""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import ListedColormap, Normalize, PowerNorm, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Polygon, Rectangle

from storylens.core.heads import head_label
from storylens.core.moved import moved_name
from storylens.viz.tokens import tick_label, to_numpy_attention

MASK_COLOR = "#262626"  # the causal mask's (always-zero) upper triangle
MASK_HATCH_COLOR = "#5a5a5a"
ATTENTION_CMAP = "viridis"
NAME_COLOR = "#d62728"
DEFAULT_DPI = 110

__all__ = [
    "causal_mask_figure",
    "all_heads_figure",
    "save_png",
    "figure_png_bytes",
    "figure_data_uri",
]


def _new_figure(figsize) -> Figure:
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global backend
    return fig


def _draw_mask(ax, n: int, *, hatch: bool = True) -> None:
    """Cover the strict upper triangle of an n x n image (cells centred on integers)."""
    # a staircase along the diagonal: exactly the cells with key > query
    stairs = []
    for q in range(n):
        stairs += [(q + 0.5, q - 0.5), (q + 0.5, q + 0.5)]
    pts = stairs + [(n - 0.5, -0.5)]
    ax.add_patch(
        Polygon(
            pts,
            closed=True,
            facecolor=MASK_COLOR,
            edgecolor=MASK_HATCH_COLOR if hatch else MASK_COLOR,
            hatch="//" if hatch else None,
            linewidth=0,
            zorder=2,
        )
    )


# --------------------------------------------------------------------------- causal mask


def causal_mask_figure(tokens: Sequence[str] | int = 8, *, title: str | None = None) -> Figure:
    """The causal mask as a small T x T table.

    ``tokens`` is a list of token texts (a short story prefix) or just a size T.
    Allowed cells (key at or before the query) are light and marked "score";
    masked cells (key after the query) are dark and marked "−∞": their share
    after the softmax is exactly zero.
    """
    labels = [tick_label(t) for t in tokens] if not isinstance(tokens, int) else [str(i) for i in range(tokens)]
    n = len(labels)
    if n < 1:
        raise ValueError("the mask needs at least one token")
    size = max(3.2, 0.55 * n + 1.6)
    fig = _new_figure((size + 0.6, size))
    ax = fig.add_subplot()
    allowed = np.tril(np.ones((n, n)))
    ax.imshow(allowed, cmap=_two_tone(), vmin=0, vmax=1, interpolation="nearest")
    fs = 9 if n <= 10 else 7 if n <= 16 else 5
    for q in range(n):
        for k in range(n):
            if k <= q:
                ax.text(k, q, "score", ha="center", va="center", fontsize=fs - 1, color="#1f3b57")
            else:
                ax.text(k, q, "−∞", ha="center", va="center", fontsize=fs + 1, color="#f0f0f0", fontweight="bold")
    ax.set_xticks(range(n), labels, rotation=60, ha="right", rotation_mode="anchor", fontsize=fs + 1)
    ax.set_yticks(range(n), labels, fontsize=fs + 1)
    ax.set_xlabel("key: the word looked at (earlier words)")
    ax.set_ylabel("query: the word doing the looking")
    ax.set_xticks(np.arange(-0.5, n, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, n, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.2)
    ax.tick_params(which="minor", length=0)
    ax.set_title(
        title
        or "The causal mask: a word may look only at itself and earlier words\n"
        "dark = masked (score set to −∞ before the softmax, share exactly 0)",
        fontsize=10,
    )
    return fig


def _two_tone():
    return ListedColormap([MASK_COLOR, "#cfe3f5"])


# --------------------------------------------------------------------------- all heads


def _tick_positions(n: int, max_labels: int) -> list[int]:
    step = max(1, math.ceil(n / max(1, max_labels)))
    return list(range(0, n, step))


@dataclass(frozen=True)
class _HeadGrid:
    """Every head's map side by side as one RGBA image: ``n_block`` rows of ``n_head`` panels of
    n x n cells, ``gap`` cells apart across and ``vgap`` down (the room above a panel holds its label)."""

    n_block: int
    n_head: int
    n: int
    gap: int
    vgap: int
    image: np.ndarray  # [rows, cols, RGBA], white between the panels
    panels: dict[str, tuple[slice, slice]]  # head label -> its (row, column) slice of the image
    head_maps: dict[str, np.ma.MaskedArray]  # head label -> the [query, key] map drawn, mask hidden

    @property
    def rows(self) -> int:
        return self.image.shape[0]

    @property
    def cols(self) -> int:
        return self.image.shape[1]

    def panel_row(self, block: int) -> int:
        """The image row where the panels of ``block`` (0-indexed) start."""
        return self.vgap + block * (self.n + self.vgap)

    def panel_col(self, head: int) -> int:
        """The image column where the panels of ``head`` (0-indexed) start."""
        return head * (self.n + self.gap)


def _head_grid(patterns: np.ndarray, cell: float, norm: Normalize) -> _HeadGrid:
    """Colour ``patterns`` (``[block, head, n, n]``) into one image, a panel ``cell`` inches wide:
    the masked upper triangle dark, the rest through the attention colour map on ``norm``'s scale."""
    n_block, n_head, n, _ = patterns.shape
    gap = max(1, round(n * 0.12 / cell))
    vgap = max(2, round(n * (0.12 + 0.26) / cell))
    rows, cols = n_block * n + (n_block - 1) * vgap + vgap, n_head * n + (n_head - 1) * gap
    grid = _HeadGrid(n_block, n_head, n, gap, vgap, np.ones((rows, cols, 4)), {}, {})
    cmap = colormaps[ATTENTION_CMAP]
    upper = np.triu(np.ones((n, n), bool), 1)
    mask_rgba = np.array(to_rgba(MASK_COLOR))
    for b in range(n_block):
        for h in range(n_head):
            r0, c0 = grid.panel_row(b), grid.panel_col(h)
            lab = head_label(b, h)
            grid.head_maps[lab] = np.ma.masked_array(patterns[b, h], mask=upper)
            rgba = cmap(norm(np.clip(patterns[b, h], 0.0, 1.0)))  # [n, n, RGBA]
            rgba[upper] = mask_rgba
            grid.image[r0 : r0 + n, c0 : c0 + n] = rgba
            grid.panels[lab] = (slice(r0, r0 + n), slice(c0, c0 + n))
    return grid


def _label_head_grid(ax, grid: _HeadGrid, labels: list[str], ticks: list[int], fontsize: float) -> None:
    """Name and frame each panel; name the tokens at ``ticks`` along the left edge of every row of
    panels and under every column of the bottom row."""
    n = grid.n
    for lab, (rs, cs) in grid.panels.items():
        ax.text(
            cs.start + n / 2 - 0.5,
            rs.start - 0.6,
            lab,
            ha="center",
            va="bottom",
            fontsize=10,
            fontweight="bold",
            gid="head-label",
        )
        ax.add_patch(Rectangle((cs.start - 0.5, rs.start - 0.5), n, n, fill=False, edgecolor="#444444", linewidth=0.6))
    for b in range(grid.n_block):
        for i in ticks:
            ax.text(
                -0.75, grid.panel_row(b) + i, labels[i], ha="right", va="center", fontsize=fontsize, gid="token-label-y"
            )
    for h in range(grid.n_head):
        for i in ticks:
            ax.text(
                grid.panel_col(h) + i,
                grid.rows - 0.25,
                labels[i],
                rotation=90,
                ha="center",
                va="top",
                fontsize=fontsize,
                gid="token-label-x",
            )


def _caption_head_grid(fig: Figure, norm: Normalize, colorbar_label: str, title: str, box: tuple) -> None:
    """The colour bar under the grid, the title above it and the names of its two axes, placed in
    inches: ``box`` is the grid's ``(left, bottom, width, height)`` on a figure of ``fig``'s size."""
    left, bottom, grid_w, grid_h = box
    width, height = fig.get_size_inches()
    cax = fig.add_axes(((left + 0.25 * grid_w) / width, 0.42 / height, 0.5 * grid_w / width, 0.12 / height))
    cb = fig.colorbar(ScalarMappable(norm=norm, cmap=colormaps[ATTENTION_CMAP]), cax=cax, orientation="horizontal")
    cb.set_label(colorbar_label, fontsize=9)
    fig.suptitle(title, fontsize=13, y=1 - 0.2 / height)
    fig.text(
        (left + grid_w / 2) / width,
        0.72 / height,
        "key (the earlier token looked at)",
        ha="center",
        va="bottom",
        fontsize=10,
    )
    fig.text(
        0.12 / width,
        (bottom + grid_h / 2) / height,
        "query (the token doing the looking)",
        rotation=90,
        ha="left",
        va="center",
        fontsize=10,
    )


def _grid_figure(grid: _HeadGrid, size: tuple[float, float], box: tuple, fontsize: float) -> tuple[Figure, Axes]:
    """A figure ``size`` inches large showing ``grid``'s image, frameless, on one axes at ``box`` (the
    grid's ``(left, bottom, width, height)`` in inches); returns it and that axes."""
    width, height = size
    left, bottom, grid_w, grid_h = box
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    # what a page and the tests read besides the drawing: Figure has no such attributes of its own
    fig.label_fontsize = fontsize  # type: ignore[attr-defined]  # points: how large the token labels show
    fig.grid_image = grid.image  # type: ignore[attr-defined]
    fig.head_panels = grid.panels  # type: ignore[attr-defined]
    fig.head_maps = grid.head_maps  # type: ignore[attr-defined]
    ax = fig.add_axes((left / width, bottom / height, grid_w / width, grid_h / height))
    ax.imshow(grid.image, interpolation="nearest", aspect="equal")
    ax.set_xlim(-0.5, grid.cols - 0.5)
    ax.set_ylim(grid.rows - 0.5, -0.5)
    ax.axis("off")
    return fig, ax


def all_heads_figure(
    patterns,
    tokens: Sequence[str],
    *,
    max_tokens: int | None = 32,
    max_labels: int = 32,
    gamma: float = 0.5,
    title: str | None = None,
    cell_inches: float | None = None,
    label_fontsize: float | None = None,
) -> Figure:
    """Every head's attention map on one story, as a blocks x heads grid (6 x 4 here).

    ``patterns`` is ``[block, head, query, key]`` (or ``model(...).patterns``),
    ``tokens`` the display text of each position. Only the first ``max_tokens``
    positions are drawn (``None`` = all); at most ``max_labels`` tokens are named along
    the left and bottom edges (every k-th token when there are more). Colours use a power
    scale (``gamma``; 1 = linear) so small shares stay visible; the dark upper triangle is
    the causal mask.

    The grid is one image on one axes (the patterns side by side with gaps), labelled with
    plain texts, in a layout fixed in inches: 24 separate axes took several times longer to
    make and draw. ``fig.head_panels`` maps each head label (``"L5H3"``) to its panel's
    ``(row, column)`` slice of ``fig.grid_image`` (``[rows, columns, RGBA]``), and
    ``fig.head_maps`` to the attention drawn there (a masked ``[query, key]`` array).
    """
    patterns = to_numpy_attention(patterns)
    n_block, n_head, T, _ = patterns.shape
    if len(tokens) != T:
        raise ValueError(f"{len(tokens)} tokens but the attention covers {T} positions")
    n = T if max_tokens is None else min(T, max_tokens)
    labels = [tick_label(t, 10) for t in tokens[:n]]
    ticks = _tick_positions(n, max_labels)
    cell = cell_inches or (3.6 if n <= 40 else 3.2)
    fs = label_fontsize or (6 if len(ticks) > 24 else 7)
    norm = PowerNorm(gamma=gamma, vmin=0.0, vmax=1.0) if gamma != 1 else Normalize(0.0, 1.0)
    grid = _head_grid(patterns[:, :, :n, :n], cell, norm)
    # margins in inches: room for the token labels (about 0.6 of a point size per character)
    label_in = max(len(x) for x in labels) * fs * 0.62 / 72 + 0.12
    left, bottom, top, right = 0.35 + label_in, 0.95 + label_in, 0.5, 0.15
    per_cell = cell / n
    grid_w, grid_h = grid.cols * per_cell, grid.rows * per_cell
    size = (left + grid_w + right, top + grid_h + bottom)
    fig, ax = _grid_figure(grid, size, (left, bottom, grid_w, grid_h), fs)
    _label_head_grid(ax, grid, labels, ticks, fs)
    shown = f"first {n} of {T} tokens" if n < T else f"{T} tokens"
    _caption_head_grid(
        fig,
        norm,
        "attention share" + (f" (power scale, γ={gamma:g})" if gamma != 1 else ""),
        title or f"All {n_block * n_head} heads on one story ({shown}); rows: query, columns: key",
        (left, bottom, grid_w, grid_h),
    )
    return fig


# --------------------------------------------------------------------------- output


def figure_png_bytes(fig: Figure, *, dpi: int = DEFAULT_DPI) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return buf.getvalue()


def save_png(fig: Figure, path: str | os.PathLike, *, dpi: int = DEFAULT_DPI) -> Path:
    """Write the figure as a PNG (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(figure_png_bytes(fig, dpi=dpi))
    return path


def figure_svg_bytes(fig: Figure) -> bytes:
    """The figure as SVG bytes, its text kept as text (``svg.fonttype: none``): editable in a
    paper or slides, and small. Heatmaps keep their cells as matplotlib's embedded image."""
    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "storylens"}):
        fig.savefig(buf, format="svg", facecolor="white")
    return buf.getvalue()


def save_svg(fig: Figure, path: str | os.PathLike) -> Path:
    """Write the figure as an SVG (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(figure_svg_bytes(fig))
    return path


def save_figure(fig: Figure, stem: str | os.PathLike, *, dpi: int = DEFAULT_DPI) -> tuple[Path, Path]:
    """Write ``STEM.png`` and ``STEM.svg`` (same figure, same colours and labels); returns both."""
    stem = Path(stem)
    return save_png(fig, stem.with_name(stem.name + ".png"), dpi=dpi), save_svg(fig, stem.with_name(stem.name + ".svg"))


def figure_data_uri(fig: Figure, *, dpi: int = DEFAULT_DPI) -> str:
    """``data:image/png;base64,...`` for an ``<img src=...>`` in a self-contained HTML page."""
    return "data:image/png;base64," + base64.b64encode(figure_png_bytes(fig, dpi=dpi)).decode("ascii")


def __getattr__(name: str):
    return moved_name(__name__, name)  # the name head's and the score figures, moved out, for one release
