"""mkdocs hook: the pages' generated parts, read from the code's own declarations, never retyped.

``<!-- columns -->`` becomes the table of every heads.csv column, from
``table_columns(BUILTIN_DETECTORS)`` in ``storylens/looking/detectors.py`` (name, title, meaning);
``<!-- api -->`` becomes one mkdocstrings block per name ``storylens`` exports (``storylens.__all__``).
A page that holds a marker the hook does not fill fails the build (``mkdocs build --strict``).
"""

import re

import storylens
from storylens.looking.detectors import BUILTIN_DETECTORS, table_columns

MARKER = re.compile(r"<!-- (columns|api) -->")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("{marker}", "the opening token")


def columns_table() -> str:
    """Every column of heads.csv/json after label, block, head, in the table's order."""
    rows = [
        "| column | title | meaning |",
        "|---|---|---|",
        "| `label` | Head | the head, L{block}H{head}, counted from 1 |",
        "| `block` | Block | the block, counted from 1 |",
        "| `head` | Head | the head within its block, counted from 1 |",
    ]
    rows += [f"| `{c.name}` | {_cell(c.title)} | {_cell(c.meaning)} |" for c in table_columns(BUILTIN_DETECTORS)]
    return "\n".join(rows)


def api_blocks() -> str:
    """One mkdocstrings block per exported name, at the module that defines it."""
    return "\n\n".join(f"::: {storylens._WHERE[name]}.{name}" for name in sorted(storylens.__all__))


def on_page_markdown(markdown: str, page, config, files) -> str:
    fill = {"columns": columns_table, "api": api_blocks}
    return MARKER.sub(lambda m: fill[m.group(1)](), markdown)
