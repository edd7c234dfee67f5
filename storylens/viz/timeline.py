"""Heads over training: one detector's strongest heads against the tokens seen, beside the losses.

The entries are a training run's head timeline (``RUN/heads_timeline.jsonl``, one dict per
evaluation: ``tokens``, ``quiz_loss``, ``induction``, ``heads``); nothing here runs a model.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.figure import Figure

from storylens.viz.figures import _new_figure


def column_series(entries: Sequence[dict], column: str, label: str) -> list[float | None]:
    """One head's ``column`` at every evaluation (None where the entry has no value)."""
    out: list[float | None] = []
    for e in entries:
        row = next((h for h in e["heads"] if h["label"] == label), None)
        out.append(None if row is None else row.get(column))
    return out


def strongest_heads(entries: Sequence[dict], column: str, k: int = 3) -> list[str]:
    """The ``k`` heads with the highest ``column`` at the last evaluation, highest first."""
    if not entries:
        return []
    rows = [h for h in entries[-1]["heads"] if isinstance(h.get(column), (int, float))]
    return [h["label"] for h in sorted(rows, key=lambda h: -h[column])[:k]]


def timeline_figure(
    entries: Sequence[dict],
    column: str,
    *,
    k: int = 3,
    mark_tokens: float | None = None,
    mark_label: str = "induction appears",
    title: str | None = None,
) -> Figure:
    """Two panels over training tokens (millions): the ``k`` strongest heads' ``column`` (top) and
    the quiz loss with the induction test's second-copy loss (bottom); ``mark_tokens``: a dashed
    line on both (where the induction score rose most)."""
    if not entries:
        raise ValueError("timeline: no evaluations to draw")
    x = [e["tokens"] / 1e6 for e in entries]
    fig = _new_figure((7.2, 5.4))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for label in strongest_heads(entries, column, k):
        top.plot(x, column_series(entries, column, label), marker="o", ms=3, label=label)
    top.set_ylabel(column)
    top.set_title(title or f"{column}: the {k} strongest heads at the end, over training")
    top.legend(loc="best", fontsize=8)
    top.grid(alpha=0.3)
    bottom.plot(x, [e["quiz_loss"] for e in entries], color="black", label="quiz loss")
    bottom.plot(
        x, [e["induction"]["second_copy_loss"] for e in entries], color="tab:red", label="induction test: second copy"
    )
    bottom.plot(
        x, [e["induction"]["first_copy_loss"] for e in entries], color="tab:red", ls=":", label="... first copy"
    )
    bottom.set_xlabel("training tokens (millions)")
    bottom.set_ylabel("loss (nats)")
    bottom.legend(loc="best", fontsize=8)
    bottom.grid(alpha=0.3)
    if mark_tokens is not None:
        for ax in (top, bottom):
            ax.axvline(mark_tokens / 1e6, color="tab:red", ls="--", lw=1)
        right_half = mark_tokens / 1e6 > (x[0] + x[-1]) / 2  # the label on the side with room
        top.annotate(
            mark_label,
            (mark_tokens / 1e6, 1),
            xycoords=("data", "axes fraction"),
            xytext=(-4 if right_half else 4, -12),
            textcoords="offset points",
            ha="right" if right_half else "left",
            color="tab:red",
            fontsize=8,
        )
    return fig


def figure_svg(fig: Figure) -> str:
    """The figure as SVG text (fonts as paths: it shows the same without them)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", facecolor="white")
    return buf.getvalue()
