"""The lesson's figures, drawn with matplotlib's Agg canvas.

Every function takes plain data (token texts, numpy arrays, lists of scores) and
returns a :class:`matplotlib.figure.Figure`. Figures are built without pyplot, so
nothing here changes the caller's matplotlib backend or piles up open figures.
Head labels count from 1 (``L5H3``); arrays stay 0-indexed.

Save with :func:`save_png`, or embed in a self-contained HTML page with
:func:`figure_data_uri`.
"""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize, PowerNorm, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Polygon, Rectangle

from storylens.core.heads import HeadGrid, head_label, parse_head_label
from storylens.viz.tokens import tick_label, to_numpy_attention

MASK_COLOR = "#262626"  # the causal mask's (always-zero) upper triangle
MASK_HATCH_COLOR = "#5a5a5a"
ATTENTION_CMAP = "viridis"
NAME_COLOR = "#d62728"
DEFAULT_DPI = 110

__all__ = [
    "causal_mask_figure",
    "all_heads_figure",
    "name_mass_bar_figure",
    "head_heatmap_figure",
    "name_even_share",
    "name_head_figure",
    "name_attention_profile",
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
    from matplotlib.colors import ListedColormap

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
    width, height = left + grid_w + right, top + grid_h + bottom
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    # what a page and the tests read besides the drawing: Figure has no such attributes of its own
    fig.label_fontsize = fs  # type: ignore[attr-defined]  # points: how large the token labels show
    fig.grid_image = grid.image  # type: ignore[attr-defined]
    fig.head_panels = grid.panels  # type: ignore[attr-defined]
    fig.head_maps = grid.head_maps  # type: ignore[attr-defined]
    ax = fig.add_axes((left / width, bottom / height, grid_w / width, grid_h / height))
    ax.imshow(grid.image, interpolation="nearest", aspect="equal")
    ax.set_xlim(-0.5, grid.cols - 0.5)
    ax.set_ylim(grid.rows - 0.5, -0.5)
    ax.axis("off")
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


# --------------------------------------------------------------------------- per-head scores


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
    for b in range(nb):
        for h in range(nh):
            v = grid[b, h]
            if not np.isfinite(v):
                ax.text(h, b, "–", ha="center", va="center", fontsize=9, color="#777777")
                continue
            unsure = se is not None and np.isfinite(se[b, h]) and abs(v) <= 2 * se[b, h]
            ax.text(
                h,
                b,
                f"({fmt.format(v)})" if unsure else fmt.format(v),
                ha="center",
                va="center",
                fontsize=9,
                color="black" if _is_light(cm((v - lo) / (hi - lo))) else "white",
            )
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


# --------------------------------------------------------------------------- the name head


def name_attention_profile(
    head_attention, name_positions: Sequence[int], first_mention: int | None = None
) -> tuple[np.ndarray, list[int]]:
    """Where one head looks, averaged over the queries after the name's first mention.

    ``head_attention`` is one head's ``[query, key]`` map. The queries averaged are
    every non-name position after ``first_mention`` (default: the first name
    position), as the lesson's name mass counts them. Returns ``(weights per key
    position, the query positions used)``.
    """
    att = np.asarray(head_attention, dtype=float)
    if att.ndim != 2 or att.shape[0] != att.shape[1]:
        raise ValueError(f"one head's attention must be [query, key], got {att.shape}")
    names = sorted(set(int(p) for p in name_positions))
    if not names:
        raise ValueError("no name positions given")
    start = names[0] if first_mention is None else int(first_mention)
    name_set = set(names)
    queries = [q for q in range(start + 1, att.shape[0]) if q not in name_set]
    if not queries:
        raise ValueError("no query after the first mention of the name")
    return att[queries].mean(axis=0), queries


def name_even_share(name_positions: Sequence[int], queries: Sequence[int]) -> float:
    """This story's even-spread share on the name over ``queries``: the mean over them of (name
    positions at or before q) / (q + 1), what a head spreading each query's attention evenly over
    the tokens up to itself would put on the name. The scores' ``name_baseline`` is the same mean
    over every scored story's name queries."""
    names = np.asarray(sorted(set(int(p) for p in name_positions)), dtype=np.int64)
    q = np.asarray(list(queries), dtype=np.int64)
    if q.size == 0:
        raise ValueError("no queries given")
    return float((np.searchsorted(names, q, side="right") / (q + 1)).mean())


def _token_lines(tokens: Sequence[str], line_chars: int) -> list[list[tuple[int, int, str]]]:
    """Lay ``tokens`` out as monospaced text ``line_chars`` wide, so positions need no renderer: one
    list per line of ``(position, column, text)`` pieces. A newline inside a token shows as ``↵``
    and breaks the line; a piece that would overflow starts the next line, its leading spaces dropped."""
    rows: list[list[tuple[int, int, str]]] = [[]]
    col = 0
    for i, token in enumerate(tokens):
        pieces = token.replace("\r", "").replace("\t", " ").split("\n")
        for j, piece in enumerate(pieces):
            if j > 0:  # a newline inside the token: show it, then break the line
                rows[-1].append((i, col, "↵"))
                rows.append([])
                col = 0
            if not piece:
                continue
            if col + len(piece) > line_chars and col > 0:
                rows.append([])
                col = 0
                piece = piece.lstrip(" ") or piece
            rows[-1].append((i, col, piece))
            col += len(piece)
    return [r for r in rows if r] or [[]]


def _shade_tokens(ax, lines, w: np.ndarray, norm: Normalize, names: set[int], first, font_pt: float) -> None:
    """Draw each laid-out token on a background shaded by its weight in ``w`` (one line a data unit
    down, one character a unit across); name tokens in red, boxed, the first mention's box thicker."""
    cmap = colormaps["Blues"]
    for r, row in enumerate(lines):
        for pos, c, text in row:
            face = cmap(norm(w[pos]) * 0.85)
            ax.add_patch(Rectangle((c - 0.5, r + 0.08), len(text), 0.84, facecolor=face, edgecolor="none", zorder=1))
            light = 0.299 * face[0] + 0.587 * face[1] + 0.114 * face[2]
            is_name = pos in names
            ax.text(
                c - 0.5,
                r + 0.5,
                text,
                family="DejaVu Sans Mono",
                fontsize=font_pt,
                va="center",
                ha="left",
                zorder=3,
                color=("#7f0000" if light > 0.55 else "#ffdede") if is_name else ("black" if light > 0.55 else "white"),
                fontweight="bold" if is_name else "normal",
            )
            if is_name:  # the first mention (where averaging starts) gets a thicker box
                ax.add_patch(
                    Rectangle(
                        (c - 0.5, r + 0.08),
                        len(text),
                        0.84,
                        fill=False,
                        edgecolor=NAME_COLOR,
                        linewidth=2.6 if pos == first else 1.3,
                        zorder=4,
                    )
                )


def _name_head_title(label: str, names: list[int], share: float, queries, n: int, n_tokens: int) -> str:
    """The name-head figure's title: the head, its ``share`` on the name and, when the ``queries``
    averaged are known, that share over this story's even spread on them; what is shown."""
    lines = [f"{label}: where it looks in this story", f"share on the name (red boxes): {share:.3f}"]
    if queries is not None and names:
        even = name_even_share(names, queries)
        lines[1] += f" = {share / even:.1f}× this story's even spread ({even:.3f})"
    how = [f"both over the same {len(queries)} queries after the first mention"] if queries is not None else []
    if n < n_tokens:
        how.append(f"first {n} of {n_tokens} tokens shown")
    if how:
        lines.append("; ".join(how))
    return "\n".join(lines)


def name_head_figure(
    tokens: Sequence[str],
    weights,
    name_positions: Sequence[int],
    *,
    label: str,
    first_mention: int | None = None,
    queries: Sequence[int] | None = None,
    max_tokens: int | None = None,
    line_chars: int = 84,
    title: str | None = None,
    gamma: float = 0.6,
    vmax: float | None = None,
) -> Figure:
    """One head's view of one story: each token shaded by the attention it gets.

    ``weights`` is either one value per token (e.g. from :func:`name_attention_profile`)
    or that head's ``[query, key]`` map, which is then averaged over the queries after
    the first mention. Name tokens get a red box, the first mention a thicker one.
    The colour scale tops out at ``vmax`` (default: the largest weight on any token
    but the first, so an attention sink on the end-of-story marker does not wash
    out the rest; larger weights get the darkest shade).
    ``label`` is the head label (``"L5H3"``). The title reports the share on the name and,
    where the queries averaged are known (a map, or ``queries`` beside a profile, as
    :func:`name_attention_profile` returns them), that share over this story's own even spread
    on the same queries (:func:`name_even_share`): the same story and queries on both sides of
    the ratio.
    """
    w = np.asarray(weights, dtype=float)
    if w.ndim == 2:
        w, queries = name_attention_profile(w, name_positions, first_mention)
    if w.shape[0] != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {w.shape[0]} weights")
    names = sorted(set(int(p) for p in name_positions))
    first = names[0] if first_mention is None and names else first_mention
    name_share = float(w[names].sum()) if names else 0.0
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    lines = _token_lines(tokens[:n], line_chars)
    font_pt = 9.0
    char_in = 0.602 * font_pt / 72  # DejaVu Sans Mono's advance is 0.602 em
    line_in = 1.75 * font_pt / 72
    # Exact placement (no automatic layout): one data unit on x is one character wide.
    margin, title_h, cbar_h, below_cbar, gap = 0.3, 0.85, 0.16, 0.45, 0.2  # title: up to three lines
    text_w, text_h = (line_chars + 1) * char_in, len(lines) * line_in
    W = text_w + 2 * margin
    H = title_h + text_h + gap + cbar_h + below_cbar
    fig = Figure(figsize=(W, H))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((margin / W, (below_cbar + cbar_h + gap) / H, text_w / W, text_h / H))
    cax = fig.add_axes((margin / W, below_cbar / H, text_w / W, cbar_h / H))
    ax.set_xlim(-0.5, line_chars + 0.5)
    ax.set_ylim(len(lines), 0)
    ax.axis("off")
    if vmax is None:
        rest = w[1:n] if n > 1 else w[:n]
        vmax = float(rest.max()) if rest.size else 1.0
    norm = PowerNorm(gamma=gamma, vmin=0.0, vmax=vmax if vmax > 0 else 1.0, clip=True)
    _shade_tokens(ax, lines, w, norm, set(names), first, font_pt)
    cb = fig.colorbar(ScalarMappable(norm=norm, cmap=_truncated_blues()), cax=cax, orientation="horizontal")
    cb.set_label(
        "attention share received (mean over queries after the first mention)"
        + (f"; ≥ {norm.vmax:.3g} darkest" if norm.vmax is not None and float(w[:n].max()) > norm.vmax else ""),
        fontsize=8,
    )
    cax.tick_params(labelsize=7)
    fig.suptitle(
        title or _name_head_title(label, names, name_share, queries, n, len(tokens)),
        fontsize=10,
        y=1 - 0.1 / H,
        va="top",
    )
    return fig


def _truncated_blues():
    from matplotlib.colors import LinearSegmentedColormap

    base = colormaps["Blues"]
    return LinearSegmentedColormap.from_list("blues85", [base(x) for x in np.linspace(0, 0.85, 64)])


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
