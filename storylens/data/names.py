"""Names and main characters, and where their tokens sit in the model's input.

The lesson's definition, made exact:

* **Words** are maximal runs of letters (``[^\\W\\d_]+``, Unicode letters; no digits,
  no underscore). An apostrophe ends a word, so ``Lily's`` and ``Lily’s`` give the word
  ``Lily`` (then ``s``): the possessive never belongs to a name.
* A word is **capitalised** when its first letter is upper case, it has at least two
  letters and all the others are lower case (``Lily``, ``Tim``). ``I``, ``OK`` and
  ``TV`` are not capitalised words in this sense, so they are never names.
* A **name** is a capitalised word whose lower-case form is never written as a word
  anywhere in the stories scored (the whole set, e.g. all 200 quiz stories). That
  discards ``She`` (``she`` occurs) and keeps ``Lily`` (``lily`` never occurs). It is
  crude on purpose: words like ``Once`` or ``Wow`` can qualify too.
* The **main character** of a story is its most frequent name (mentions counted in
  the whole story text, before any cut to the window) with at least two mentions.
  Ties go to the name mentioned first in the text.
* A mention is an occurrence of the exact word (same capitalisation).

Token positions count the end-of-story marker the model sees first as position 0, so
the story's i-th token is position ``i + 1``; positions at or past the window are cut.
A token belongs to the name when its character span (from the tokenizer's offsets)
overlaps the name's characters: this catches names split over several tokens, the
byte-level tokens that carry the leading space (``ĠLily``), a name opening the story
with no space, and a token that merges the name with ``'s``; a token holding only
``'s`` or the space does not overlap and is left out.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from storylens.core.errors import StorylensError
from storylens.core.text import checked_stories, not_stories

MIN_MENTIONS = 2  # a main character is a name mentioned at least twice
PRONOUNS = frozenset({"he", "she", "him", "her", "his", "they"})  # the pronoun queries of the pronoun measure

WORD_RE = re.compile(r"[^\W\d_]+")

Span = tuple[int, int]  # [start, end) in characters


def is_capitalised(word: str) -> bool:
    """``Lily`` yes; ``lily``, ``I``, ``OK`` no (see the module docstring)."""
    return len(word) >= 2 and word[0].isupper() and word[1:].islower()


class NameVocabulary:
    """The first pass the name definition needs: the lower-case words written anywhere in the
    stories and the capitalised words. A name is a capitalised word whose lower-case form is never
    written. Two vocabularies :meth:`merge` by set union (in any order, on any machine), so the
    first pass can be split like the scoring itself; :meth:`names` is then the same as one pass."""

    def __init__(self, lower=(), capitalised=()):
        self.lower: set[str] = set(lower)
        self.capitalised: set[str] = set(capitalised)

    def add(self, text: str) -> None:
        for word in WORD_RE.findall(text):
            if word.islower():
                self.lower.add(word)
            elif is_capitalised(word):
                self.capitalised.add(word)

    def merge(self, other: NameVocabulary) -> NameVocabulary:
        self.lower |= other.lower
        self.capitalised |= other.capitalised
        return self

    def names(self) -> frozenset[str]:
        return frozenset(w for w in self.capitalised if w.lower() not in self.lower)


def name_vocabulary(stories: Iterable[str]) -> frozenset[str]:
    """Every capitalised word whose lower-case form is never written in ``stories``."""
    if problem := not_stories(stories):
        raise StorylensError(problem)
    vocab = NameVocabulary()
    for i, text in enumerate(stories, 1):
        if not isinstance(text, str):
            raise StorylensError(f"story {i}: must be text (a str), got {type(text).__name__}")
        vocab.add(text)
    return vocab.names()


def name_mentions(text: str, names: frozenset[str] | set[str]) -> dict[str, list[Span]]:
    """Character spans of every mention of every name, per name, in text order."""
    found: dict[str, list[Span]] = {}
    for m in WORD_RE.finditer(text):
        if m.group() in names:
            found.setdefault(m.group(), []).append(m.span())
    return found


def pick_main_character(mentions: dict[str, list[Span]], min_mentions: int = MIN_MENTIONS) -> str | None:
    """The most-mentioned name with at least ``min_mentions``; ties: earliest first mention."""
    best = None
    for name, spans in mentions.items():
        if len(spans) < min_mentions:
            continue
        key = (-len(spans), spans[0][0])
        if best is None or key < best[0]:
            best = (key, name)
    return None if best is None else best[1]


def token_positions(offsets: Sequence[Span], spans: Iterable[Span], window: int) -> list[int]:
    """Positions (marker = 0, so token i is i + 1) of tokens overlapping any span, < window.
    ``offsets`` are the story's token character spans, as ``tok.encode(text).offsets``.
    Only the window's tokens are looked at; each is checked against the spans by bisection.
    """
    spans = sorted(spans)
    starts = [s for s, _ in spans]
    out = []
    for i, (a, b) in enumerate(offsets[: max(window - 1, 0)]):
        j = bisect_left(starts, b) - 1  # the last span starting before the token ends
        # spans are words: they never overlap, so their ends grow with their starts
        if j >= 0 and spans[j][1] > a:
            out.append(i + 1)
    return out


@dataclass(frozen=True)
class MainCharacter:
    name: str
    mentions: int  # in the whole story text, before the window cut
    spans: tuple[Span, ...]  # character spans of the mentions ('s excluded)
    positions: tuple[int, ...]  # token positions of the name inside the window, marker = 0
    first_mention: int | None  # smallest position; None when the window cut every mention


def main_character(
    text: str, offsets: Sequence[Span], names: frozenset[str] | set[str], window: int = 256
) -> MainCharacter | None:
    """The story's main character and its token positions, or None if it has none."""
    mentions = name_mentions(text, names)
    name = pick_main_character(mentions)
    if name is None:
        return None
    spans = tuple(mentions[name])
    positions = tuple(token_positions(offsets, spans, window))
    return MainCharacter(
        name=name,
        mentions=len(spans),
        spans=spans,
        positions=positions,
        first_mention=positions[0] if positions else None,
    )


def find_main_characters(
    tok, stories: Sequence[str], *, names: frozenset[str] | set[str] | None = None, window: int = 256
) -> list[MainCharacter | None]:
    """One entry per story. ``names`` defaults to :func:`name_vocabulary` of ``stories``."""
    stories = checked_stories(stories)
    if names is None:
        names = name_vocabulary(stories)
    encodings = tok.encode_batch(list(stories))
    return [main_character(t, e.offsets, names, window) for t, e in zip(stories, encodings)]


# Pronouns: where he, she, him, her, his and they are, as token positions (the pronoun measure's queries)


def pronoun_spans(text: str, pronouns: Iterable[str] = PRONOUNS) -> list[tuple[str, Span]]:
    """Every pronoun word of ``text`` as (word as written, character span), in order."""
    wanted = {p.lower() for p in pronouns}
    return [(m.group(), m.span()) for m in WORD_RE.finditer(text) if m.group().lower() in wanted]


def pronoun_positions(offsets: Sequence[Span], spans: Iterable[Span], window: int = 256) -> list[int]:
    """For each span, the position of the last token overlapping it (marker = 0), < window.

    ``offsets``: the story's token character spans, ``tok.encode(text).offsets``.
    A word whose last token falls outside the window is left out. Only the window's tokens (and
    the one after, to know whether a word runs past it) are searched, by bisection.
    """
    offsets = offsets[:window]
    starts = [a for a, _ in offsets]
    out = set()
    for s, e in spans:
        i = bisect_left(starts, e) - 1  # the last token starting before the word ends
        if i >= 0 and offsets[i][1] > s and i + 1 < window:
            out.add(i + 1)
    return sorted(out)


def story_pronoun_positions(tok, text: str, window: int = 256, pronouns: Iterable[str] = PRONOUNS) -> list[int]:
    """Pronoun query positions of one story as :func:`storylens.model.tokenizer.encode_story` feeds it."""
    enc = tok.encode(text)
    return pronoun_positions(enc.offsets, [s for _, s in pronoun_spans(text, pronouns)], window)
