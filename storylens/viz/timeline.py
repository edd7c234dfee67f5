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


def induction_scores(entries: Sequence[dict]) -> list[float]:
    """The induction test's score at every evaluation: the mean loss on the first copy of the
    repeated random tokens minus that on the second (nats; how much easier copying makes it)."""
    return [e["induction"]["score"] for e in entries]


def timeline_figure(
    entries: Sequence[dict],
    column: str,
    *,
    k: int = 3,
    mark_tokens: float | None = None,
    mark_label: str = "induction appears",
    title: str | None = None,
    unit: str = "share of attention",
) -> Figure:
    """Three panels over training tokens (millions): the ``k`` strongest heads' ``column`` (top, the
    detector's own ``unit``), the quiz loss with the induction test's two copies
    (middle, nats) and the induction score, their difference (bottom, nats). ``mark_tokens``: a
    dashed line on the two panels in nats (where the induction score rose most), labelled on the
    induction score's own axis."""
    if not entries:
        raise ValueError("timeline: no evaluations to draw")
    x = [e["tokens"] / 1e6 for e in entries]
    fig = _new_figure((7.2, 6.9))
    top, losses, score = fig.subplots(3, 1, sharex=True, height_ratios=(3, 2, 1.4))
    for label in strongest_heads(entries, column, k):
        top.plot(x, column_series(entries, column, label), marker="o", ms=3, label=label)
    top.set_ylabel(f"{column} ({unit})")
    top.set_title(title or f"{column}: the {k} strongest heads at the end, over training")
    top.legend(loc="best", fontsize=8)
    top.grid(alpha=0.3)
    losses.plot(x, [e["quiz_loss"] for e in entries], color="black", label="quiz loss")
    losses.plot(
        x, [e["induction"]["second_copy_loss"] for e in entries], color="tab:red", label="induction test: second copy"
    )
    losses.plot(
        x, [e["induction"]["first_copy_loss"] for e in entries], color="tab:red", ls=":", label="... first copy"
    )
    losses.set_ylabel("loss (nats)")
    losses.legend(loc="best", fontsize=8)
    losses.grid(alpha=0.3)
    score.plot(x, induction_scores(entries), color="tab:red", marker="o", ms=3)
    score.axhline(0, color="#888", lw=0.8)
    score.set_ylabel("induction\nscore (nats)")
    score.set_xlabel("training tokens (millions); induction score = first-copy loss - second-copy loss")
    score.grid(alpha=0.3)
    if mark_tokens is not None:
        for ax in (losses, score):
            ax.axvline(mark_tokens / 1e6, color="tab:red", ls="--", lw=1)
        right_half = mark_tokens / 1e6 > (x[0] + x[-1]) / 2  # the label on the side with room
        score.annotate(  # low on the axis: the score has risen by then, so the curve is above it
            mark_label,
            (mark_tokens / 1e6, 0),
            xycoords=("data", "axes fraction"),
            xytext=(-4 if right_half else 4, 5),
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
