"""Regenerate the docs' table of numerical checks from a `storylens check --json` run.

    storylens check --json check.json && python scripts/readme_check_table.py check.json

Replaces the lines between ``<!-- check:start -->`` and ``<!-- check:end -->`` on the page that holds them (docs/lesson.md; ``scripts.readme_tables.page_with``).
"""

import json
import sys
from pathlib import Path


def table(data: dict) -> str:
    rows = [
        f"Measured by `storylens check` on {data['cpu']} (torch {data['torch']}), {data['stories']}:",
        "",
        "| check | dtype | measured | rounding bound | lesson | beside the lesson's figure | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in data["checks"]:
        lesson = "" if c["lesson"] is None else f"{c['lesson']:.0e}"
        note = c.get("lesson_note", "")  # storylens.lesson.checks.lesson_note
        rows.append(
            f"| {c['name']} | {c['dtype']} | {c['measured']:.2e} | {c['bound']:.2e} | {lesson} | {note} | {c['detail']} |"
        )
    return "\n".join(rows)


def main() -> None:
    data = json.loads(Path(sys.argv[1]).read_text())
    from scripts.readme_tables import update  # here: readme_tables imports this module's table

    update("check", table(data))


if __name__ == "__main__":
    main()
