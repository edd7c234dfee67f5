"""One head's view of one story: each token shaded by the attention it gets, the name boxed.

:func:`name_attention_profile` averages a head's ``[query, key]`` map over the queries after the
name's first mention (as the lesson's name mass counts them), :func:`name_even_share` is an even
spread's share on the name over the same queries, and :func:`name_head_figure` draws the story.
Drawn with matplotlib's Agg canvas, without pyplot (see :mod:`storylens.viz.figures`, which writes
figures out).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, Normalize, PowerNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from storylens.viz.figures import NAME_COLOR

__all__ = ["name_attention_profile", "name_even_share", "name_head_figure"]


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


def _text_figure(n_lines: int, line_chars: int, font_pt: float) -> tuple[Figure, Axes, Axes]:
    """A figure laid out for ``n_lines`` lines of ``line_chars`` monospaced characters at ``font_pt``
    points, the room for a title above: the text's axes (one data unit across is one character, one
    down is one line) and a horizontal colour bar's axes under it."""
    char_in = 0.602 * font_pt / 72  # DejaVu Sans Mono's advance is 0.602 em
    line_in = 1.75 * font_pt / 72
    # Exact placement (no automatic layout): one data unit on x is one character wide.
    margin, title_h, cbar_h, below_cbar, gap = 0.3, 0.85, 0.16, 0.45, 0.2  # title: up to three lines
    text_w, text_h = (line_chars + 1) * char_in, n_lines * line_in
    W = text_w + 2 * margin
    H = title_h + text_h + gap + cbar_h + below_cbar
    fig = Figure(figsize=(W, H))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((margin / W, (below_cbar + cbar_h + gap) / H, text_w / W, text_h / H))
    cax = fig.add_axes((margin / W, below_cbar / H, text_w / W, cbar_h / H))
    ax.set_xlim(-0.5, line_chars + 0.5)
    ax.set_ylim(n_lines, 0)
    ax.axis("off")
    return fig, ax, cax


def _weight_norm(w: np.ndarray, gamma: float, vmax: float | None) -> PowerNorm:
    """The shading's power scale over the weights ``w`` drawn: up to ``vmax``, by default the largest
    weight on any token but the first (an attention sink on the opening marker would wash out the rest)."""
    n = len(w)
    if vmax is None:
        rest = w[1:n] if n > 1 else w[:n]
        vmax = float(rest.max()) if rest.size else 1.0
    return PowerNorm(gamma=gamma, vmin=0.0, vmax=vmax if vmax > 0 else 1.0, clip=True)


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
    fig, ax, cax = _text_figure(len(lines), line_chars, font_pt)
    norm = _weight_norm(w[:n], gamma, vmax)
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
        y=1 - 0.1 / fig.get_figheight(),
        va="top",
    )
    return fig


def _truncated_blues():
    base = colormaps["Blues"]
    return LinearSegmentedColormap.from_list("blues85", [base(x) for x in np.linspace(0, 0.85, 64)])
