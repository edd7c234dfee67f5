"""A run read back: :func:`load_heads` reads the folder ``storylens score`` or ``report`` wrote
(heads.json, and where there examples.json and summary.json) as typed results, or as pandas frames.

Every file's ``schema_version`` is checked first (:mod:`storylens.core.schema`): an older run's
files, a file of another version or one missing a key give one StorylensError line naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storylens.core.errors import StorylensError
from storylens.core.frames import need_pandas, to_frame
from storylens.core.schema import check_schema, read_versioned, schema
from storylens.corpus.summary import ScoreSummary
from storylens.lesson.summary import ReportSummary
from storylens.looking.example_store import EXAMPLE_FIELDS
from storylens.table.scores import HeadScores


@dataclass(frozen=True)
class Run:
    """A run read back. ``heads``: the head table (a :class:`~storylens.table.scores.HeadScores`,
    or a data frame equal to ``pandas.read_csv(heads.csv)``); ``examples``: examples.json as written
    (or a frame, one row per kept example), None where the run kept none; ``summary``: a
    :class:`~storylens.corpus.summary.ScoreSummary` (``storylens score``) or
    :class:`~storylens.lesson.summary.ReportSummary` (``report``), None where the folder has none."""

    folder: Path
    heads: Any
    examples: Any
    summary: ScoreSummary | ReportSummary | None


def _summary(path: Path) -> ScoreSummary | ReportSummary:
    doc = read_versioned(path)
    report = "quiz" in doc  # the report's stories are its quiz
    check_schema(doc, schema("summary-report" if report else "summary-score"), str(path))
    kind = ReportSummary if report else ScoreSummary
    try:
        return kind.from_dict(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StorylensError(f"{path}: not a storylens summary.json ({type(e).__name__}: {e})") from None


def _examples(path: Path, as_pandas: bool) -> Any:
    """examples.json as written (checked: every key there, every head's examples a list), or a frame."""
    doc = read_versioned(path, "", "examples")
    try:
        if missing := [k for k in ("k", "per_story", "detectors", "heads") if k not in doc]:
            raise KeyError(", ".join(missing))
        rows = examples_rows(doc)
    except (KeyError, TypeError, AttributeError) as e:
        raise StorylensError(f"{path}: not a storylens examples.json ({type(e).__name__}: {e})") from None
    return to_frame(rows, ["label", "layer", "head", "detector", "rank", *EXAMPLE_FIELDS]) if as_pandas else doc


def examples_rows(doc: dict) -> list[dict]:
    """examples.json's examples, one dict per kept example: the head (``label``, ``layer``,
    ``head``), ``detector``, ``rank`` (0: where the head fires most) and the example's fields."""
    rows = []
    for h in doc["heads"]:
        where = {"label": h["label"], "layer": h["layer"], "head": h["head"]}
        for name, kept in h["examples"].items():
            rows += [{**where, "detector": name, "rank": rank, **e} for rank, e in enumerate(kept)]
    return rows


def load_heads(folder: str | Path, *, as_pandas: bool = False) -> Run:
    """Read back the run ``storylens score --out FOLDER`` or ``storylens report --out FOLDER`` wrote
    (or :meth:`HeadScores.to_json` wrote as ``FOLDER/heads.json``). ``as_pandas=True``: the head
    table and the examples as ``pandas.DataFrame`` s (needs pandas: ``storylens[pandas]``)."""
    folder = Path(folder)
    if not (folder / "heads.json").is_file():
        raise StorylensError(f"{folder}: no heads.json (not a folder storylens score or report wrote)")
    if as_pandas:
        need_pandas()
    heads = HeadScores.from_json(folder / "heads.json")
    examples = _examples(folder / "examples.json", as_pandas) if (folder / "examples.json").is_file() else None
    summary = _summary(folder / "summary.json") if (folder / "summary.json").is_file() else None
    return Run(folder, heads.to_pandas() if as_pandas else heads, examples, summary)
