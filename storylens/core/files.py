"""Files a user hands storylens, opened only once they are what a file of their kind can be: a regular file
(a FIFO or a device where a checkpoint or a config should be would block the read forever, or never end) of at
most the size such a file has. Every reader of a user's file goes through here before the expensive step, so a
10 GB "config" or a FIFO "checkpoint" is one StorylensError line, not a hang or every byte of memory.
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

from storylens.core.errors import StorylensError

MAX_SMALL_BYTES = 64 << 20
"""A config, a manifest, a summary, an index of shards: 64 MiB (the largest such file storylens writes is a few MB)."""
MAX_RESULT_BYTES = 1 << 30
"""A result read back or a checkpoint's JSON: 1 GiB (a 30 x 9 Llama's circuit.json is about 25 MB)."""


def checked_file(path: Path, limit: int | None = MAX_SMALL_BYTES, what: str = "") -> int:
    """The size of ``path``, a regular file of at most ``limit`` bytes (None: any size); otherwise one
    StorylensError line naming it (``what``: added to it, e.g. "delete it to start again"). A missing file raises
    FileNotFoundError as ``open`` would, so callers keep their own words for it."""
    tail = f"; {what}" if what else ""
    info = Path(path).stat()
    if not stat.S_ISREG(info.st_mode):
        raise StorylensError(f"{path}: not a regular file{tail}")
    if limit is not None and info.st_size > limit:
        raise StorylensError(
            f"{path}: {info.st_size:,} bytes, more than the {limit:,} a file of its kind can have{tail}"
        )
    return info.st_size


def read_text(path: Path, limit: int = MAX_SMALL_BYTES, what: str = "") -> str:
    """``path``'s UTF-8 text once :func:`checked_file` passes (not UTF-8: one StorylensError line)."""
    checked_file(path, limit, what)
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise StorylensError(f"{path}: not UTF-8 text{f'; {what}' if what else ''}") from None


def json_digest(obj: object) -> str:
    """A SHA-256 of ``obj`` as compact JSON: a checkpoint carries the digest of what it holds, so a state edited
    by hand (within every bound its stories allow) is still known for what it is. JSON round-trips Python's
    floats exactly, so the same state read back gives the same digest."""
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode("utf-8")).hexdigest()


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number (storylens writes null where a figure is not known)")


def parse_json(text: str) -> Any:
    """JSON as storylens writes it: NaN and Infinity (which Python's parser accepts) are ValueError, and
    nesting past what the parser can follow is ValueError, not RecursionError."""
    try:
        return json.loads(text, parse_constant=_not_a_number)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def read_json(path: Path, limit: int = MAX_SMALL_BYTES, what: str = "") -> Any:
    """``path``'s JSON (:func:`parse_json`) once :func:`checked_file` passes; not JSON: one StorylensError line."""
    text = read_text(path, limit, what)
    try:
        return parse_json(text)
    except ValueError as e:
        raise StorylensError(f"{path}: not JSON ({e}){f'; {what}' if what else ''}") from None
