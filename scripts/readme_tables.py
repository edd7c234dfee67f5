"""Regenerate the README's figures from a report run (never typed in):

    storylens report --out report && storylens check --json check.json
    python scripts/readme_tables.py report/summary.json check.json

Replaces the text between <!-- lesson-table:start/end --> (from summary.json) and, if a check JSON
is given, <!-- check:start/end -->. tests/test_report.py fails when the README's lesson table and a
fresh report disagree.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_check_table import table as check_table  # noqa: E402
from storylens.report import LESSON_TABLE, lesson_table  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def replace_between(text: str, marker: str, body: str) -> str:
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body + "\n" + text[b:]


def main() -> None:
    text = README.read_text()
    text = replace_between(text, LESSON_TABLE, lesson_table(json.loads(Path(sys.argv[1]).read_text())))
    if len(sys.argv) > 2:
        text = replace_between(text, "check", check_table(json.loads(Path(sys.argv[2]).read_text())))
    README.write_text(text)


if __name__ == "__main__":
    main()
