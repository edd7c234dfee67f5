"""``storylens timeline RUN [RUN ...] --out DIR``: a training run's head timeline as figures and one
self-contained page; several runs side by side.

For each run: one figure per detector (its strongest heads over training tokens, above the quiz
loss and the induction test), with the step where the induction score rose most marked, written
as PNG and SVG; ``timeline.html`` shows every figure (embedded) and a table per run of when and
where each kind of head formed. Nothing here trains or runs a model: it reads the timelines.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined

from storylens.core.errors import StorylensError
from storylens.core.files import read_json
from storylens.core.publish import publish_folder
from storylens.looking.detectors import BUILTIN_DETECTORS, TIMELINE
from storylens.training.copying import read_copying
from storylens.training.timeline import (
    TIMELINE_FILE,
    evaluations,
    formation,
    induction_step,
    loss_bumps,
    read_timeline,
)
from storylens.viz.figures import figure_png_bytes
from storylens.viz.timeline import figure_svg, timeline_figure

COLUMNS = tuple(d.name for d in BUILTIN_DETECTORS if TIMELINE in d.shown)  # one figure each
KINDS = {d.name: d.kind for d in BUILTIN_DETECTORS if d.kind}  # the formation table: the kind of head each finds

_ENV = Environment(loader=PackageLoader("storylens.training", "templates"), autoescape=True, undefined=StrictUndefined)


def _run_name(path: Path) -> str:
    path = path.resolve()
    return path.parent.name if path.name == TIMELINE_FILE else path.name


RESULT_FILES = (
    "result.json",
    "train_state.json",
)  # where a run's training time is kept (scripts/train_sizes.py, train)


def train_minutes(run: str | Path) -> float | None:
    """The training steps' wall clock of a run, in minutes, from its ``result.json`` or the
    ``train_state.json`` a finished run writes; None where it has neither (an exported model)."""
    path = Path(run)
    folder = path.parent if path.is_file() else path
    for name in RESULT_FILES:
        try:
            kept = read_json(folder / name)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise StorylensError(f"{folder / name}: unreadable ({e})") from None
        seconds = kept.get("train_seconds") if isinstance(kept, dict) else None
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds):
            return float(seconds) / 60
    return None


def run_summary(name: str, entries: Sequence[dict]) -> dict:
    """What the page says about one run, as data."""
    last = entries[-1]
    labels = [h["label"] for h in last["heads"]]
    blocks = max(h["block"] for h in last["heads"])
    return {
        "name": name,
        "blocks": blocks,
        "heads_per_block": len(labels) // blocks,
        "evaluations": len(evaluations(entries)),
        "initial": entries[0]["step"] == 0,  # the timeline starts at the initial weights
        "tokens": last["tokens"],
        "quiz_perplexity": last["quiz_perplexity"],
        "second_copy_loss": last["induction"]["second_copy_loss"],
        "first_copy_loss": last["induction"]["first_copy_loss"],
        "in_context": last["in_context"]["score"],
        "induction_step": induction_step(entries),
        "loss_bumps": loss_bumps(entries),
        "formation": {kind: formation(entries, col) for col, kind in KINDS.items()},
    }


def write_timeline_page(runs: Sequence[str | Path], out: str | Path, *, k: int = 3) -> Path:
    """Read each run's timeline and publish the figures and ``timeline.html`` into ``out``."""
    if not runs:
        raise StorylensError("timeline: give at least one training run folder")
    named = []
    for run in runs:
        path = Path(run)
        entries = read_timeline(path)
        if not entries:
            raise StorylensError(f"{path}: the head timeline has no evaluation yet")
        named.append((_run_name(path), entries, read_copying(path), train_minutes(path)))
    if len({n for n, *_ in named}) < len(named):
        raise StorylensError("timeline: two runs share a folder name; give folders with different names")
    out = Path(out)
    with publish_folder(out, "timeline") as tmp:
        views = []
        for name, entries, copied, minutes in named:
            summary = {**run_summary(name, entries), "copying": copied, "train_minutes": minutes}
            mark = summary["induction_step"]
            figures = []
            for column in COLUMNS:
                fig = timeline_figure(
                    entries,
                    column,
                    k=k,
                    mark_tokens=mark["tokens"] if mark else None,
                    mark_label=f"induction score's largest rise ({mark['rise']:+.2f} nats)" if mark else "",
                    title=f"{name}: {column}, the {k} strongest heads at the end",
                )
                stem = f"{name}-{column}"
                png = figure_png_bytes(fig, dpi=110)
                (tmp / f"{stem}.png").write_bytes(png)
                (tmp / f"{stem}.svg").write_text(figure_svg(fig), encoding="utf-8")
                figures.append(
                    {
                        "column": column,
                        "stem": stem,
                        "uri": "data:image/png;base64," + base64.b64encode(png).decode("ascii"),
                    }
                )
            views.append({**summary, "figures": figures})
        page = _ENV.get_template("timeline.html.j2").render(runs=views, columns=COLUMNS, k=k, fmt=_fmt)
        (tmp / "timeline.html").write_text(page, encoding="utf-8")
    return out


def _fmt(x, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)
