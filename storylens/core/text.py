"""Text given by a user (a story, a pair's side) checked before a tokenizer sees it: one line naming what is
wrong, never a tokenizer's traceback."""

from __future__ import annotations

import re

from storylens.core.errors import StorylensError

_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate: a str Python holds, no UTF-8 encodes


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone surrogate and where), or None."""
    m = _SURROGATE.search(text)
    return (
        None if m is None else f"not valid Unicode (a lone surrogate, U+{ord(m.group()):04X}, at character {m.start()})"
    )


def not_stories(stories: object, what: str = "stories") -> str | None:
    """Why ``stories`` is not a collection of stories (None, one string, bytes, a dict or set, not iterable), in the
    CLI's words; None where it is one."""
    if isinstance(stories, str):
        return f"{what}: a list of stories, not one string"
    if (
        stories is None
        or isinstance(stories, (bytes, bytearray, dict, set, frozenset))
        or not hasattr(stories, "__iter__")
    ):
        return f"{what}: a list of stories (each a str), got {type(stories).__name__}"
    return None


def checked_stories(stories: object, what: str = "stories") -> list[str]:
    """``stories`` as a list of str (:func:`checked_texts`), refused in one line, as the CLI refuses a corpus: not a
    collection of stories, none at all, or every one empty ("no stories")."""
    if problem := not_stories(stories, what):
        raise StorylensError(problem)
    out = checked_texts(stories)
    if not out:
        raise StorylensError(f"{what}: nothing to score (empty list)")
    if not any(s.strip() for s in out):
        raise StorylensError(f"{what}: no stories (all {len(out)} are empty)")
    return out


def checked_texts(texts, what: str = "story") -> list[str]:
    """``texts`` as a list of str, each valid Unicode; else one :class:`StorylensError` line naming the first bad one
    (``what`` 1-based: "story 3")."""
    out = list(texts)
    for i, t in enumerate(out, 1):
        if not isinstance(t, str):
            raise StorylensError(f"{what} {i}: must be text (a str), got {type(t).__name__}")
        problem = unicode_problem(t)
        if problem:
            raise StorylensError(f"{what} {i}: {problem}")
    return out
