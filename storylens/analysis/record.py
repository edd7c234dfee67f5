"""The one recording driver: run the stories through the model once, in batches, and hand every
block's pattern (its attention probabilities) to every measure the moment it exists.

A *measure* is any object with three methods (an accumulator):

``begin(batch)``
    a new :class:`~storylens.analysis.encode.StoryBatch` is about to run;
``block(layer, pattern)``
    block ``layer``'s pattern ``[batch, head, query, key]`` (read it; it is freed with its block);
``end()``
    the batch is done.

A measure with ``faithful = True`` and two more methods, ``value_norms(layer, norms)`` and
``output_norms(layer, norms)``, is handed,
from the same pass, ``|f_j|`` for every key before the block's pattern (``norms [batch, head, key]``,
each value vector through its head's slice of the output projection, from ``hook_v``) and the size
of what each head writes at every query after it (``[batch, head, query]``, from ``hook_z``): see
:mod:`storylens.analysis.faithful`.

A measure with a ``block_rows(layer, rows, start)`` method (and no false ``rows`` attribute) can
also be fed a block's map a chunk of query rows at a time, ``[batch, head, n, keys]`` holding
queries ``start .. start + n - 1`` over the keys they see, in order, covering every query once.
When every measure can, and the model forms its maps in storylens's own attention
(:func:`storylens.lm.attention.streaming`), no block's whole map ever exists: memory stays within
a fixed budget whatever the story's length, and no map-sized buffer is allocated. The chunk a
measure is handed is written, in inference mode, into memory reused for the next chunk: read it,
and copy what you keep. Such a measure may also have ``key_columns(layer)``, key weights
``[batch, head, key, c]`` (or None) for the attention to carry through its product with the values:
it is then fed ``block_rows(layer, rows, start, masses)``, ``masses [batch, head, n, c]`` being the
chunk's rows times those columns.

So ``storylens report --beyond`` records the quiz once and feeds the head scores, the position
control and the pronoun measure from the same patterns.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from storylens.analysis.encode import CHUNK_STORIES, batch_of, is_encoded, iter_encoded, length_batches
from storylens.analysis.faithful import head_norms, key_norms, ov_factor
from storylens.analysis.names import name_vocabulary
from storylens.core.batching import BATCH_TOKENS
from storylens.core.errors import StorylensError
from storylens.core.modes import eval_mode
from storylens.lm import Hook


class Measure(Protocol):
    def begin(self, batch) -> None: ...

    def block(self, layer: int, pattern: torch.Tensor) -> None: ...

    def end(self) -> object: ...  # what it returns is not read


@dataclass(frozen=True)
class RecordStats:
    n_stories: int
    n_cut: int  # stories cut to the window
    n_main_character: int  # stories with a main character

    def __add__(self, other: RecordStats) -> RecordStats:
        return RecordStats(
            self.n_stories + other.n_stories, self.n_cut + other.n_cut, self.n_main_character + other.n_main_character
        )


def _takes_rows(measure) -> bool:
    return callable(getattr(measure, "block_rows", None)) and bool(getattr(measure, "rows", True))


def record(
    lm,
    stories: Iterable,
    measures: Sequence[Measure],
    *,
    batch_size: int = 16,
    batch_tokens: int | None = BATCH_TOKENS,
    names=None,
    first_limit: int | None = None,
    progress: bool = True,
    chunk_stories: int = CHUNK_STORIES,
    start: int = 0,
    total: int | None = None,
    on_chunk: Callable[[RecordStats], None] | None = None,
) -> RecordStats:
    """Run ``stories`` (texts, or :class:`~storylens.analysis.encode.EncodedStory` records already
    encoded) through ``lm`` once, feeding every measure (see the module docstring), in batches
    of at most ``batch_size`` stories and ``batch_tokens`` padded tokens (None: no token limit).

    ``names``: the name vocabulary (default: that of ``stories`` themselves, a first pass over the
    texts, as the lesson defines names; a one-pass stream must bring its own). ``first_limit``:
    batches mark the stories among the first that many (for the lesson's first-100 columns).
    Stories are encoded and batched ``chunk_stories`` at a time, chunk by chunk in order, so the
    same stories always make the same batches; ``start`` is the index of the first story (a run
    resumed after ``start`` stories), ``total`` the count for the progress bar, and
    ``on_chunk(stats so far)`` is called after every chunk (where a long run checkpoints)."""
    from tqdm.auto import tqdm

    if isinstance(stories, str):
        raise StorylensError("stories: a list of stories, not one string")
    if isinstance(stories, Sequence) and len(stories) == 0:
        raise StorylensError("stories: nothing to score (empty list)")
    if batch_size < 1:
        raise StorylensError(f"batch_size: must be at least 1, got {batch_size}")
    if names is None and not is_encoded(stories):
        if not isinstance(stories, Sequence):
            raise StorylensError("stories: a stream is read once; pass names (a first pass over it)")
        names = name_vocabulary(stories)

    def feed(pattern: torch.Tensor, hook: Hook) -> None:
        for m in measures:
            m.block(hook.layer, pattern)

    asking = [m for m in measures if callable(getattr(m, "key_columns", None))]
    widths: dict[int, list[tuple[Any, int]]] = {}  # per block: (measure, how many columns it asked for)

    def columns(layer: int) -> torch.Tensor | None:
        asked = [(m, cast(Any, m).key_columns(layer)) for m in asking]
        asked = [(m, c) for m, c in asked if c is not None]
        widths[layer] = [(m, c.shape[-1]) for m, c in asked]
        return None if not asked else asked[0][1] if len(asked) == 1 else torch.cat([c for _, c in asked], -1)

    def feed_rows(layer: int, rows: torch.Tensor, start: int, masses: torch.Tensor | None = None) -> None:
        given: dict[int, torch.Tensor] = {}
        if masses is not None:
            at = 0
            for m, width in widths.get(layer, []):
                given[id(m)] = masses[..., at : at + width]
                at += width
        for m in measures:
            if id(m) in given:
                cast(Any, m).block_rows(layer, rows, start, given[id(m)])
            else:
                cast(Any, m).block_rows(layer, rows, start)

    hooks: list[tuple[str, Callable[[torch.Tensor, Hook], None]]] = []
    streamed = lm.streaming(feed_rows, columns if asking else None) if all(_takes_rows(m) for m in measures) else None
    if streamed is None:
        hooks = [(f"blocks.{i}.attn.hook_pattern", feed) for i in range(lm.n_layer)]
    movers: list[Any] = [m for m in measures if getattr(m, "faithful", False)]
    why_not = lm.moving_unsupported() if movers else None
    if why_not is not None:  # raw scores still; the norm-weighted columns stay empty
        print(f"storylens: note: {why_not}; the norm-weighted columns and output norms are left empty", file=sys.stderr)
        movers = []
    if movers:
        with torch.inference_mode():
            factors = [ov_factor(lm.head_output_weights(i).detach()) for i in range(lm.n_layer)]

        def values(v: torch.Tensor, hook: Hook) -> None:
            norms = key_norms(v, factors[hook.layer])
            for m in movers:
                m.value_norms(hook.layer, norms)

        def outputs(z: torch.Tensor, hook: Hook) -> None:
            norms = head_norms(z, factors[hook.layer])
            for m in movers:
                m.output_norms(hook.layer, norms)

        hooks += [(f"blocks.{i}.attn.hook_v", values) for i in range(lm.n_layer)]
        hooks += [(f"blocks.{i}.attn.hook_z", outputs) for i in range(lm.n_layer)]

    n = n_cut = n_main = 0
    if total is None and isinstance(stories, Sequence):
        total = start + len(stories)
    with (
        eval_mode(lm.module),
        torch.inference_mode(),
        lm.hooks(hooks),
        streamed if streamed is not None else nullcontext(),
        tqdm(
            total=total, initial=start, unit="story", desc="recording attention", disable=None if progress else True
        ) as bar,
    ):  # None: terminals only
        for chunk in iter_encoded(lm, stories, names, chunk_stories=chunk_stories, start=start):
            n += len(chunk)
            n_cut += sum(s.cut for s in chunk)
            n_main += sum(s.main is not None for s in chunk)
            for idx in length_batches([len(s.ids) for s in chunk], batch_size, batch_tokens):
                batch = batch_of([chunk[i] for i in idx], lm.marker_id, lm.device, first_limit)
                for m in measures:
                    m.begin(batch)
                lm.forward(batch.ids, record_attention=True, logits=False)
                for m in measures:
                    m.end()
                bar.update(len(idx))
            if on_chunk is not None:
                on_chunk(RecordStats(n, n_cut, n_main))
    if n == 0:
        raise StorylensError("stories: nothing to score (no story)")
    return RecordStats(n, n_cut, n_main)
