"""Regenerate the docs' figures (docs/lesson.md) from a report run (never typed in):

    storylens report --beyond --out report && storylens check --json check.json
    python scripts/readme_tables.py report/summary.json check.json

Replaces the text between <!-- lesson-table:start/end --> (from summary.json), <!-- beyond:start/end -->
(when the report ran --beyond), <!-- truth:start/end --> (the faithfulness table) and, if a check JSON is given, <!-- check:start/end -->. Each table lives on one page (``page_with``). tests/test_report.py fails when the lesson table and a
fresh report disagree.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_check_table import table as check_table
from storylens.lesson.beyond import BeyondSummary
from storylens.lesson.summary import load
from storylens.lesson.tables import LESSON_TABLE, lesson_table
from storylens.table.truth import Truth

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def replace_between(text: str, marker: str, body: str) -> str:
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body + "\n" + text[b:]


def page_with(marker: str) -> Path:
    """The one page (README.md or docs/*.md) that holds ``<!-- marker:start -->``: the tables moved to
    the docs site, and each generated table has exactly one home."""
    start = f"<!-- {marker}:start -->"
    pages = [p for p in (README, *sorted((ROOT / "docs").glob("*.md"))) if start in p.read_text(encoding="utf-8")]
    if len(pages) != 1:
        raise LookupError(f"{start} is on {len(pages)} pages, not one: {[str(p.relative_to(ROOT)) for p in pages]}")
    return pages[0]


def shown_between(marker: str) -> str:
    """What the page holding ``marker`` shows between its start and end lines, stripped."""
    text = page_with(marker).read_text(encoding="utf-8")
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    return text[text.index(start) + len(start) : text.index(end)].strip()


def update(marker: str, body: str) -> Path:
    """Replace the body between ``marker``'s lines on the page that holds it; returns that page."""
    page = page_with(marker)
    page.write_text(replace_between(page.read_text(encoding="utf-8"), marker, body), encoding="utf-8")
    return page


def beyond_paragraph(b: BeyondSummary) -> str:
    """The lesson page's "past the lesson" paragraph, from a ``report --beyond`` summary."""
    ab, pc, pr = b.ablation, b.position_control, b.pronouns
    rows = {r.head: r for r in ab.rows}
    top, worst = ab.top_name_mass_head, ab.top_name_loss_head
    ctrl = {r.head: r for r in pc.ranking_by_excess}[top]
    text = (
        f"**Past the lesson** (`storylens report --beyond`, or `storylens ablate`): zero-ablating {top} (the top "
        f"name-mass head) raises the loss on predicting the main character's name by "
        f"{rows[top].zero_name_increase:.2f} nats"
    )
    if ab.same_head:
        text += " and no other head's removal hurts the name more"
    else:
        text += (
            f", but the head whose removal hurts the name most is **{worst}** "
            f"(+{rows[worst].zero_name_increase:.2f} nats on the name, "
            f"+{rows[worst].zero_other_increase:.2f} elsewhere)"
        )
    lead = pc.ranking_by_excess[0].head
    text += (
        f". After a matched-distance position control {top} puts {ctrl.name_mass:.3f} on the name vs "
        f"{ctrl.control:.3f} on non-name tokens at the same distances"
        + (" (the largest excess of any head)" if lead == top else f" ({lead} has the largest excess)")
    )
    p0 = pr.ranking[0]
    more = p0.pronoun_mass > p0.other_mass
    text += (
        f". From pronouns, {p0.head} puts the most attention on the name ({p0.pronoun_mass:.3f}; from "
        f"other words it puts {p0.other_mass:.3f} there): pronouns {'do' if more else 'do not'} lean on "
        "the name more than other words do. Details, tables and the side-by-side generation are in the "
        "report's section 8."
    )
    return text


def truth_table(f: Truth) -> str:
    """The lesson page's "what heads move" table, from the report's faithfulness section."""
    rho = {a.detector: a.rho for a in f.agreements}
    lines = [
        "| detector | head | raw | norm-weighted | output share | loss + switched off (zero / mean) | rank correlation |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in f.rows:
        corr = "" if rho.get(r.detector) is None else f"{rho[r.detector]:.2f}"
        norm = "" if r.norm is None else f"{r.norm:.3f}"
        share = "" if r.share is None else f"{r.share:.1%}"
        off = (
            "not measured"
            if r.zero_increase is None or r.mean_increase is None
            else f"{r.zero_increase:+.3f} / {r.mean_increase:+.3f} on {r.where}"
        )
        lines.append(f"| {r.detector} | {r.head} | {r.raw:.3f} | {norm} | {share} | {off} | {corr} |")
    dormant = ", ".join(f.dormant) or "none"
    lines.append("")
    lines.append(
        (
            f"Ablations on {f.stories_chosen}."
            if f.stories_chosen
            else f"Ablations on the first {f.n_stories} quiz stories."
        )
        + f" Dormant heads (switching one to its mean moves nothing): {dormant}."
    )
    return "\n".join(lines)


def main() -> None:
    summary = load(sys.argv[1])
    update(LESSON_TABLE, lesson_table(summary))
    if summary.beyond is not None:
        update("beyond", beyond_paragraph(summary.beyond))
    if summary.faithfulness is not None:
        update("truth", truth_table(summary.faithfulness))
    if len(sys.argv) > 2:
        update("check", check_table(json.loads(Path(sys.argv[2]).read_text())))


if __name__ == "__main__":
    main()
