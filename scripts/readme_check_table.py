"""Regenerate the README's table of numerical checks from a `storylens check --json` run.

    storylens check --json check.json && python scripts/readme_check_table.py check.json

Replaces the lines between ``<!-- check:start -->`` and ``<!-- check:end -->`` in README.md.
"""

import json
import sys
from pathlib import Path

START, END = "<!-- check:start -->", "<!-- check:end -->"


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
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    readme.write_text(text[:a] + "\n" + table(data) + "\n" + text[b:])


if __name__ == "__main__":
    main()
