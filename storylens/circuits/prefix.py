"""The start a batch of pairs shares: before the first position where any pair's clean and corrupt prompts differ,
every run of the batch (clean, corrupt, each edge-patched circuit, the gradient pass) computes the same thing, since
nothing later reaches an earlier position. That start is run once, its keys and values kept
(:meth:`~storylens.lm.AttentionLM.continuing`), and every run of the batch covers only the tokens after it: the
differences of writers' outputs there are zero, so edge scores and patched runs lose nothing (the lesson's name
pairs share their first 12 of about 25 tokens)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from storylens.effects.patching import Pair, PairBatch
from storylens.lm import AttentionLM

SHARE = True  # False: every run covers the whole batch (what benchmarks and tests compare against)


def _first_difference(p: Pair) -> int:
    return next((i for i, (a, b) in enumerate(zip(p.clean_ids, p.corrupt_ids)) if a != b), len(p.clean_ids))


def start_ordered(pairs: list[Pair]) -> tuple[list[Pair], torch.Tensor]:
    """``pairs`` in an order that batches those alike together: by where clean and corrupt first differ, then by
    length (each batch's shared start the longer, its padding the less), and the positions that put results in
    that order back in the given one. :data:`SHARE` off: as given."""
    order = list(range(len(pairs)))
    if SHARE:
        order.sort(key=lambda i: (_first_difference(pairs[i]), len(pairs[i].clean_ids)))
    back = torch.empty(len(order), dtype=torch.long)
    back[order] = torch.arange(len(order))
    return [pairs[i] for i in order], back


def shared_start(b: PairBatch) -> int:
    """The tokens at the start of every clean and corrupt row of ``b`` that are the same in both, short of each row's
    last position (the metric's, which every run must reach)."""
    differs = (b.clean != b.corrupt).any(0)  # [pos]
    first = int(differs.nonzero()[0, 0]) if bool(differs.any()) else b.clean.shape[1]
    return min(first, int(b.last.min()))


@contextlib.contextmanager
def after_shared_start(lm: AttentionLM, b: PairBatch) -> Iterator[PairBatch]:
    """Inside: ``b`` from the first token after its :func:`shared_start` (positions counted from there), every
    forward of ``lm`` continuing that start; ``b`` itself where there is none, the model keeps no cache, or
    :data:`SHARE` is off."""
    p = shared_start(b) if SHARE else 0
    with lm.continuing(b.clean[:, :p]) as kept:
        if not kept or not p:
            yield b
            return
        yield PairBatch(b.clean[:, p:], b.corrupt[:, p:], b.last - p, b.answer, b.wrong)
