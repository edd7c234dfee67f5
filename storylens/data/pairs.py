"""A pairs file (``storylens patch`` and ``circuit``'s task): one JSON object a line with ``clean``, ``corrupt``,
``answer`` and ``wrong``, read with bounds (each line at most :data:`MAX_PAIR_LINE_BYTES`, the file at most
``$STORYLENS_MAX_CORPUS_MB``) before anything parses or tokenises it; every problem one line naming the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from storylens.core.errors import UsageError
from storylens.core.files import checked_file
from storylens.core.text import unicode_problem
from storylens.data.stories import max_corpus_bytes, too_much_text

KEYS = ("clean", "corrupt", "answer", "wrong")
MAX_PAIR_LINE_BYTES = 1 << 20
"""The longest line of a pairs file read (1 MiB: two prompts of about 100,000 tokens each, past any model's window
here); a longer one is refused before it is parsed or tokenised (a 10 MB line took 1.9 GB to tokenise)."""


def _pair_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a pairs file, numbered from 1, each read with a bound (at most MAX_PAIR_LINE_BYTES, the
    file at most ``$STORYLENS_MAX_CORPUS_MB``) and decoded; a regular file only (a FIFO would block)."""
    name, limit, total = path.name, max_corpus_bytes(), 0
    checked_file(path, None)
    with open(path, "rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(MAX_PAIR_LINE_BYTES + 1), b""), 1):
            if len(raw.rstrip(b"\r\n")) > MAX_PAIR_LINE_BYTES:
                raise UsageError(f"{name}:{n}: longer than {MAX_PAIR_LINE_BYTES:,} bytes (a pair is two prompts)")
            if (total := total + len(raw)) > limit:
                raise too_much_text(name, limit)
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UsageError(f"{name}:{n}: not UTF-8 text") from None


def read_pairs(path: str | Path) -> list[dict]:
    """The JSON objects of a pairs file, each with its ``line``; one-line errors name the line."""
    path = Path(path)
    name = path.name
    rows = []
    for n, raw in _pair_lines(path):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UsageError(f"{name}:{n}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{name}:{n}: expected an object with keys {', '.join(KEYS)}")
        missing = [k for k in KEYS if k not in obj]
        if missing:
            raise UsageError(f"{name}:{n}: missing {', '.join(repr(k) for k in missing)}")
        bad = [k for k in KEYS if not isinstance(obj[k], str) or not obj[k]]
        if bad:
            raise UsageError(f"{name}:{n}: {', '.join(repr(k) for k in bad)} must be non-empty text")
        for k in KEYS:
            if problem := unicode_problem(obj[k]):
                raise UsageError(f"{name}:{n}: {k!r} is {problem}")
        rows.append({"line": n, **{k: obj[k] for k in KEYS}})
    if not rows:
        raise UsageError(f"{name}: no pairs (an empty file)")
    return rows
