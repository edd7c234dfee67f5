"""The one recording driver: run the stories through the model once, in batches, and hand every
block's attention map to every measure the moment it exists.

A *measure* is any object with three methods (an accumulator):

``begin(batch)``
    a new :class:`~storylens.analysis.encode.StoryBatch` is about to run;
``block(layer, pattern)``
    block ``layer``'s ``[batch, head, query, key]`` map (read it; it is freed with its block);
``end()``
    the batch is done.

So ``storylens report --beyond`` records the quiz once and feeds the head scores, the position
control and the pronoun measure from the same maps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..errors import StorylensError
from .encode import CHUNK_STORIES, batch_of, is_encoded, iter_encoded, length_batches


class Measure(Protocol):
    def begin(self, batch) -> None: ...

    def block(self, layer: int, pattern: torch.Tensor) -> None: ...

    def end(self) -> None: ...


@dataclass(frozen=True)
class RecordStats:
    n_stories: int
    n_cut: int  # stories cut to the window
    n_main_character: int  # stories with a main character


def record(lm, stories: Sequence[str], measures: Sequence[Measure], *, batch_size: int = 16, names=None,
           first_limit: int | None = None, progress: bool = True, chunk_stories: int = CHUNK_STORIES) -> RecordStats:
    """Run ``stories`` (texts, or :class:`~storylens.analysis.encode.EncodedStory` records already
    encoded) through ``lm`` once, feeding every measure (see the module docstring).

    ``names``: the name vocabulary (default: that of ``stories`` themselves, a first pass over the
    texts, as the lesson defines names). ``first_limit``: batches mark the stories among the first
    that many (for the lesson's first-100 columns)."""
    from tqdm.auto import tqdm

    from .names import name_vocabulary

    if not isinstance(stories, Sequence) or isinstance(stories, str):
        stories = list(stories)
    if len(stories) == 0:
        raise StorylensError("stories: nothing to score (empty list)")
    if batch_size < 1:
        raise StorylensError(f"batch_size: must be at least 1, got {batch_size}")
    if names is None and not is_encoded(stories):
        names = name_vocabulary(stories)

    def feed(layer):
        def fn(pattern):
            for m in measures:
                m.block(layer, pattern)
        return fn

    n_cut = n_main = 0
    module = lm.module
    was_training = module.training
    module.eval()
    try:
        with torch.inference_mode(), lm.hooks([(f"blocks.{i}.attn.hook_pattern", feed(i)) for i in range(lm.n_layer)]), \
                tqdm(total=len(stories), unit="story", desc="recording attention",
                     disable=None if progress else True) as bar:  # None: terminals only
            for chunk in iter_encoded(lm, stories, names, chunk_stories=chunk_stories):
                n_cut += sum(s.cut for s in chunk)
                n_main += sum(s.main is not None for s in chunk)
                for idx in length_batches([len(s.ids) for s in chunk], batch_size):
                    batch = batch_of([chunk[i] for i in idx], lm.marker_id, lm.device, first_limit)
                    for m in measures:
                        m.begin(batch)
                    lm.forward(batch.ids, patterns=True, logits=False)
                    for m in measures:
                        m.end()
                    bar.update(len(idx))
    finally:
        module.train(was_training)
    return RecordStats(len(stories), n_cut, n_main)
