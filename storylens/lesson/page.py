"""The report's page: ``report.html`` is ``templates/report.html.j2`` (and ``beyond.html.j2`` with
``--beyond``) rendered by Jinja2 with autoescaping, from the typed summary, the head scores, the
figures and the widget."""

from __future__ import annotations

from collections.abc import Sequence

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from storylens.core.heads import parse_head_label
from storylens.lesson.drawing import BARS_SHOWN, GRID_DPI, GRID_LABEL_PT, LESSON_GRID_HEADS
from storylens.lesson.figures import LESSON_FIGURES
from storylens.lesson.summary import NameHeads, ReportSummary
from storylens.lesson.tables import (
    agreement_rows,
    audit_rows,
    beyond_rows,
    f3,
    head_rows,
    leak_rows,
    num,
    numerics_rows,
    truth_rows,
)
from storylens.looking.detectors import FLAG, LESSON, MORE, OVERVIEW, SINKS
from storylens.table.scores import HeadScores
from storylens.viz import HEATMAP_CSS, head_heatmap_html
from storylens.viz.widget import page_script

CHECK_STORIES = 4  # the report's numerical checks run on the first 4 quiz stories ...
CHECK_TOKENS = 32  # ... and 32 generated tokens (storylens check runs all 200 stories and 200 tokens)

# the report's sections (--sections), in the page's order, and what each holds
SECTIONS = {
    "overview": "every head at a glance: a block x head grid per column of heads.csv",
    "widget": "every head on one quiz story, in the attention widget",
    "lesson": "the lesson: the toy, the causal mask, the numerical checks, the leakage check (Momo), the "
    "name-tracking head, its limits, previous-token and marker heads, the number to reproduce",
    "detectors": "the detectors past the lesson's (TransformerLens's patterns, induction on random tokens, yours)",
    "sinks": "sinks and dormant heads",
    "truth": "does attention tell the truth here: each detector's strongest heads switched off",
    "causal": "attribution patching audited by exact ablation (with --causal)",
    "heads": "every head's row",
}
# another model's default: what a practitioner reads first; storylens's own models get every section
PRACTITIONER = tuple(k for k in SECTIONS if k != "lesson")

_ENV = Environment(
    loader=PackageLoader("storylens.lesson", "templates"),
    autoescape=True,  # every value is escaped; trusted HTML fragments come in as Markup
    undefined=StrictUndefined,
    keep_trailing_newline=True,
)
_ENV.filters["num"] = num


def _overview(scores: HeadScores, marker: str) -> list[dict]:
    """The overview's grids: every detector raw, then norm-weighted, then the output share (the
    columns this run has values for), each a block x head table."""
    cols = scores.shown(OVERVIEW)
    have = [c for c in cols if any(v is not None and v == v for v in scores.column(c))]
    dormant = [h.label for h in scores.heads if h.dormant]
    return [{"col": c, "title": scores.title(c, marker), "heat": _heat(scores, c, marker, dormant)} for c in have]


def _heat(scores: HeadScores, col: str, marker: str, dormant: Sequence[str] = ()) -> dict:
    """One score as a coloured block x head table (the best head boxed, the dormant ones dashed): HTML,
    not an image. Each table is coloured over its own range, and its caption says so."""

    title = scores.title(col, marker)
    values = [v for row in scores.grid(col) for v in row if v is not None and v == v]
    note = (
        f"Colours: this table's own range, {min(values):.3f} (black) to {max(values):.3f} (light yellow); "
        "compare tables by their numbers, not their colours."
        if values
        else "No values."
    )
    if dormant:
        note += f" Dashed red: the {len(dormant)} dormant head(s) ({FLAG.meaning})."
    se = f"{col}_se"
    has_se = any(c.name == se for c in scores.columns) and any(v is not None for v in scores.column(se))
    errors = scores.grid(se) if has_se else None
    if errors is not None:
        note += (
            f" In parentheses: within two standard errors of zero ({se} in heads.csv, over the stories scored), "
            "so no sign is claimed."
        )
    table = head_heatmap_html(
        scores.grid(col),
        title=title,
        highlight=scores.best(col).label,
        marked=dormant,
        mark_name="dormant",
        errors=errors,
    )
    return {"table": Markup(table), "note": note}


def _page(
    s: ReportSummary, scores: HeadScores, figs: dict[str, str], svgs: dict[str, str], widget_html: str, toy_html: str
) -> dict:
    """What the template reads: the summary, the lesson's figures, and the page's tables and fragments."""

    lesson = s.model.lesson_comparison  # the lesson's figures are Tiny Storyteller's: only beside its kind
    sections = s.sections if s.sections is not None else list(SECTIONS)  # a summary from before --sections
    top = s.name_heads.top[0].head if s.name_heads is not None else scores.best("name_mass").label
    example = LESSON_FIGURES.top_head if lesson else top  # a head this model has
    ex_block, ex_head = parse_head_label(example)  # 0-based
    counter = next((c for c in s.numerics or [] if c.name == "key/value computations" and c.dtype == "float32"), None)
    return {
        "s": s,
        "L": LESSON_FIGURES,
        "lesson": lesson,
        "sections": sections,
        "section_names": ", ".join(SECTIONS),
        "n_heads": s.model.n_heads,
        "name": s.model.display_name,
        "example": example,
        "ex_block": ex_block,
        "ex_head": ex_head,
        "heatmap_css": Markup(HEATMAP_CSS),
        "toy_html": Markup(toy_html),
        "widget_html": Markup(widget_html),
        "figs": {k: Markup(v) for k, v in figs.items()},
        "svgs": svgs,
        "lesson_grid": s.model.n_heads <= LESSON_GRID_HEADS,
        "bars_shown": BARS_SHOWN,
        "overview": _overview(scores, s.marker.called),
        "page_js": Markup(page_script()),
        "explore": True,
        "label_px": GRID_LABEL_PT * GRID_DPI / 72,
        "check_stories": CHECK_STORIES,
        "check_tokens": CHECK_TOKENS,
        "counter": counter,
        "numerics_rows": numerics_rows(s) if s.numerics is not None else [],
        "leak_rows": leak_rows(s) if s.leakage is not None else [],
        "name_rows": [] if s.name_heads is None else _name_rows(s.name_heads),
        "heat": {c: _heat(scores, c, s.marker.called) for c in (*scores.shown(LESSON), *scores.shown(MORE))},
        "more_columns": scores.shown(MORE),
        "sinks": _sinks(scores, s.marker.called),
        "all_rows": head_rows(scores),
        "beyond": beyond_rows(s.beyond),
        "truth_rows": truth_rows(s.faithfulness),
        "audit_rows": audit_rows(s.audit),
        "agreement_rows": agreement_rows(s.faithfulness),
    }


def _name_rows(nh: NameHeads) -> list[list[str]]:
    return [[h.head, f3(h.name_mass), f3(nh.baseline), f"{h.ratio:.1f}x"] for h in nh.top]


def _sinks(scores: HeadScores, marker: str) -> dict | None:
    """The report's grids of sinks and dormant heads (the columns shown at SINKS that this run has,
    dormant heads dashed) and their counts; None where the run has none of them."""
    dormant = [h.label for h in scores.heads if h.dormant]
    cols = [c for c in scores.shown(SINKS) if any(v is not None and v == v for v in scores.column(c))]
    if not cols:
        return None
    rate = scores.column("sink_rate") if "sink_rate" in cols else []
    return {
        "grids": [_heat(scores, c, marker, dormant) for c in cols],
        "dormant": dormant,
        "mostly_sinks": sum(1 for v in rate if v is not None and v > 0.5),
        "flag": FLAG.meaning,
    }


def report_html(
    s: ReportSummary, scores: HeadScores, figs: dict[str, str], svgs: dict[str, str], widget_html: str, toy_html: str
) -> str:
    """report.html: templates/report.html.j2 (and beyond.html.j2 with ``--beyond``), autoescaped."""
    return _ENV.get_template("report.html.j2").render(_page(s, scores, figs, svgs, widget_html, toy_html))
