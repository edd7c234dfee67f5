"""Perplexity over stories: exp(mean next-token loss), every story fed as ``[marker] + story`` (cut to
the window), every predicted token weighted equally. Works on any :class:`~storylens.lm.AttentionLM`;
the computation is :func:`storylens.model.evaluate.next_token_perplexity`, the one training reports."""

from __future__ import annotations

from collections.abc import Sequence

from storylens.core.modes import eval_mode
from storylens.core.text import checked_stories
from storylens.lm import ModelLike, wrap
from storylens.model.evaluate import next_token_perplexity


def perplexity(model: ModelLike, stories: Sequence[str], *, batch_size: int = 16, tokenizer=None) -> float:
    lm = wrap(model, tokenizer)
    encoded = [lm.encode(s)[: lm.window] for s in checked_stories(stories)]
    with eval_mode(lm.module):
        return next_token_perplexity(
            lm.forward, encoded, pad_id=lm.marker_id, batch_size=batch_size, device=lm.device, vocab=lm.vocab_size
        )
