"""Stories encoded once: ids, character offsets, main character, mentions and pronouns, then
padded into batches. Every measure reads the same :class:`EncodedStory` and :class:`StoryBatch`.

A story is fed as ``[marker] + its tokens``, cut to the model's window: the marker is position 0,
so token ``i`` of the story sits at position ``i + 1``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from storylens.core.batching import BATCH_TOKENS, length_batches, pad_batch, valid_mask
from storylens.data.names import MainCharacter, main_character, name_vocabulary, pronoun_positions, pronoun_spans
from storylens.data.sources import chunked

if TYPE_CHECKING:
    from storylens.lm import AttentionLM

Span = tuple[int, int]


@dataclass(frozen=True)
class EncodedStory:
    index: int  # the story's place in the order given
    ids: tuple[int, ...]  # [marker] + story tokens, at most `window` of them
    cut: bool  # the story did not fit the window
    main: MainCharacter | None  # its main character (positions inside the window)
    mention_starts: tuple[int, ...]  # positions of the first token of each main-character mention
    pronouns: tuple[int, ...]  # positions of the last token of each pronoun (he, she, ...)

    @property
    def name_positions(self) -> tuple[int, ...]:
        return () if self.main is None else self.main.positions


def mention_first_tokens(offsets: Sequence[Span], spans, window: int = 256) -> list[int]:
    """Position (marker = 0, so token i is i + 1) of the first token of each mention, < window.

    A token belongs to a mention when their character spans overlap (as in
    :mod:`storylens.data.names`), so the byte-level token that carries the leading space
    (``ĠLily``) counts as the mention's first token. Linear in the window, whatever the story's
    length: only the tokens inside the window are searched, by bisection."""
    offsets = offsets[: max(window - 1, 0)]
    ends = [b for _, b in offsets]
    out = set()
    for s, e in spans:
        i = bisect_right(ends, s)  # the first token ending after the mention starts
        if i < len(offsets) and offsets[i][0] < e:
            out.add(i + 1)
    return sorted(out)


def encode_stories(lm: AttentionLM, texts: Sequence[str], names, *, start: int = 0) -> list[EncodedStory]:
    """Encode ``texts`` once (one ``encode_batch``) into :class:`EncodedStory` records; ``start`` is
    the index of ``texts[0]`` in the whole run."""
    window, marker = lm.window, lm.marker_id
    out = []
    for i, (text, enc) in enumerate(zip(texts, lm.encode_batch(list(texts)))):
        ids = [marker] + enc.ids
        offsets = enc.offsets[:window]  # the window's tokens and one more: nothing past it is used
        main = main_character(text, offsets, names, window)
        starts = mention_first_tokens(offsets, main.spans, window) if main is not None else []
        prons = pronoun_positions(offsets, [s for _, s in pronoun_spans(text)], window)
        out.append(EncodedStory(start + i, tuple(ids[:window]), len(ids) > window, main, tuple(starts), tuple(prons)))
    return out


# ---------------------------------------------------------------- batches


@dataclass(frozen=True)
class StoryBatch:
    """A batch of encoded stories, padded at the end, with the position masks measures need."""

    ids: torch.Tensor  # [batch, tokens] long; padding (the marker id) after each story's end
    lengths: torch.Tensor  # [batch] long: real tokens per story (marker included)
    name_mask: torch.Tensor  # [batch, tokens] bool: the main character's name tokens
    first_mention: torch.Tensor  # [batch] long: first name position; -1 = none in the window
    marker_mask: torch.Tensor  # [batch, tokens] bool: end-of-story marker tokens
    in_first: torch.Tensor  # [batch] bool: story is among the first N (the *_first columns)
    stories: tuple[EncodedStory, ...] = field(default=())  # the records behind the rows, when known
    shapes: BatchShapes | None = None  # the sizes the masks need, counted on the host (None: read from the tensors)


@dataclass(frozen=True)
class BatchShapes:
    """What a batch's key sets measure, counted from its token lists on the host when the batch is made, so
    the masks size their tensors without reading a count back from the device (on a GPU each such read waits
    for everything queued before it)."""

    queries: int  # positions q >= 1 inside the stories, all stories together
    column_keys: int  # the most name and marker tokens any story holds
    duplicates: int  # the most earlier copies of its token any query has
    pairs: tuple[tuple[int, ...], ...]  # per story, [T + 1]: (query, earlier copy) pairs with query < t

    def most_pairs(self, start: int, stop: int) -> int:
        """The most (query, earlier copy) pairs any story has with its query in ``start .. stop - 1``."""
        return max((p[min(stop, len(p) - 1)] - p[min(start, len(p) - 1)] for p in self.pairs), default=0)


def batch_shapes(ids: Sequence[Sequence[int]], names: Sequence[Sequence[int]], marker_id: int) -> BatchShapes:
    """:class:`BatchShapes` of stories ``ids`` whose name tokens are at ``names`` (one pass over each story)."""
    width = max((len(s) for s in ids), default=0)
    columns, most, pairs = 0, 0, []
    for story, name in zip(ids, names):
        seen: dict[int, int] = {}
        cum, total = [0], 0
        for token in story:
            earlier = seen.get(token, 0)
            most, total = max(most, earlier), total + earlier
            seen[token] = earlier + 1
            cum.append(total)
        cum.extend([total] * (width - len(story)))
        pairs.append(tuple(cum))
        markers = {i for i, token in enumerate(story) if token == marker_id}
        columns = max(columns, len(markers | set(name)))
    return BatchShapes(sum(max(len(s) - 1, 0) for s in ids), columns, most, tuple(pairs))


def make_batch(
    ids: Sequence[Sequence[int]],
    mains: Sequence[MainCharacter | None],
    in_first: Sequence[bool],
    marker_id: int,
    device: torch.device | str = "cpu",
    stories: Sequence[EncodedStory] = (),
) -> StoryBatch:
    """Pad ``ids`` at the end with the marker id (:func:`~storylens.core.batching.pad_batch`) and build
    the position masks."""
    grid, lengths = pad_batch(ids, marker_id)
    B, T = grid.shape
    name_mask = torch.zeros(B, T, dtype=torch.bool)
    first = torch.full((B,), -1, dtype=torch.long)
    names: list[list[int]] = [[] for _ in range(B)]
    for b, mc in enumerate(mains):
        if mc is not None and mc.positions and mc.first_mention is not None:
            names[b] = [p for p in mc.positions if p < len(ids[b])]
            name_mask[b, list(mc.positions)] = True
            first[b] = mc.first_mention
    valid = valid_mask(lengths, T)
    return StoryBatch(
        ids=grid.to(device),
        lengths=lengths.to(device),
        name_mask=name_mask.to(device),
        first_mention=first.to(device),
        marker_mask=((grid == marker_id) & valid).to(device),
        in_first=torch.tensor(list(in_first), dtype=torch.bool, device=device),
        stories=tuple(stories),
        shapes=batch_shapes(ids, names, marker_id),
    )


def batch_of(stories: Sequence[EncodedStory], marker_id: int, device, first_limit: int | None = None) -> StoryBatch:
    limit = first_limit if first_limit is not None else float("inf")
    return make_batch(
        [s.ids for s in stories],
        [s.main for s in stories],
        [s.index < limit for s in stories],
        marker_id,
        device,
        stories,
    )


# Stories per forward pass. Peak memory follows the largest batch's maps (batch x heads x window x
# window floats per block, and the allocator's fragments of them), while on a CPU 4 stories a pass
# score within a few percent of 16's speed (the "batch" rows of benchmarks/corpus.json); on a GPU
# pass a larger one.
BATCH_STORIES = 4
CHUNK_STORIES = 512  # stories encoded (and sorted by length into batches) at a time


def is_encoded(stories) -> bool:
    return isinstance(stories, Sequence) and len(stories) > 0 and isinstance(stories[0], EncodedStory)


def iter_encoded(
    lm: AttentionLM, stories: Iterable, names, *, chunk_stories: int = CHUNK_STORIES, start: int = 0
) -> Iterator[list[EncodedStory]]:
    """The stories encoded ``chunk_stories`` at a time (memory does not grow with the corpus; a
    stream is read as it goes); stories already encoded (:class:`EncodedStory`, e.g. shared by
    several steps of a report) are passed on as they are. ``start``: the index of the first."""
    encoded = is_encoded(stories)
    for first, chunk in chunked(stories, chunk_stories, start):
        yield chunk if encoded else encode_stories(lm, chunk, names, start=first)


def iter_batches(
    lm: AttentionLM,
    stories: Sequence[str],
    *,
    batch_size: int = 16,
    batch_tokens: int | None = BATCH_TOKENS,
    names=None,
    first_limit: int | None = None,
    chunk_stories: int = CHUNK_STORIES,
) -> Iterator[StoryBatch]:
    """Every story once, in batches (at most ``batch_size`` stories and ``batch_tokens`` padded
    tokens): encoded a chunk at a time, longest first within a chunk."""

    if names is None and not is_encoded(stories):
        names = name_vocabulary(stories)
    for chunk in iter_encoded(lm, stories, names, chunk_stories=chunk_stories):
        for idx in length_batches([len(s.ids) for s in chunk], batch_size, batch_tokens):
            yield batch_of([chunk[i] for i in idx], lm.marker_id, lm.device, first_limit)
