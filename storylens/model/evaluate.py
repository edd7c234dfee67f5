"""The one perplexity storylens computes: exp(mean next-token loss) over stories, each fed as
``[marker] + story`` (cut to the window), every predicted token weighted equally. Training's quiz
perplexity (:mod:`storylens.training.train`) and :func:`storylens.lm.perplexity` both call
:func:`next_token_perplexity`, the first with the GPT, the second with any model's forward pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F

from storylens.core.batching import length_batches, pad_batch
from storylens.core.errors import StorylensError

IGNORE = -1  # the target of a padded position: no loss
LOGITS_BYTES = 256 << 20  # a batch's logits, their float32 copy and log-softmax, at most (with the vocabulary known)


@torch.inference_mode()
def next_token_perplexity(
    forward: Callable[[torch.Tensor], torch.Tensor | None],
    stories_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    batch_size: int = 16,
    device: torch.device | str | None = None,
    vocab: int | None = None,
) -> float:
    """``forward(ids [batch, tokens]) -> logits [batch, tokens, vocab]`` run over ``stories_ids``
    (each already ``[marker] + tokens``, within the window), longest first, ``batch_size`` at a
    time, padded at the end with ``pad_id``; given the ``vocab`` size, batches hold at most as many tokens as
    keep the logits, their float32 copy and the loss's log-softmax within :data:`LOGITS_BYTES` (a 49k-token
    vocabulary's logits are 200 KB a token: 16 stories of 1,024 tokens held 3 GB twice). Run the model in
    evaluation mode (:func:`storylens.core.modes.eval_mode`)."""
    total, count = 0.0, 0
    max_tokens = None if vocab is None else max(1, LOGITS_BYTES // (3 * 4 * vocab))
    for idx in length_batches([len(e) for e in stories_ids], batch_size, max_tokens):
        chunk = [stories_ids[i] for i in idx]
        if max(len(e) for e in chunk) < 2:
            continue  # nothing to predict
        x, _ = pad_batch([e[:-1] for e in chunk], pad_id, device)
        logits = forward(x)
        if logits is None:
            raise StorylensError("forward: returned no logits")
        y, _ = pad_batch([e[1:] for e in chunk], IGNORE, logits.device)
        total += float(
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=IGNORE, reduction="sum"
            )
        )
        count += int((y >= 0).sum())
    if count == 0:
        raise StorylensError("stories: no token to predict")
    if not math.isfinite(total):  # never a perplexity of nan
        raise StorylensError("perplexity: the model's loss is NaN or infinite (a number overflows inside it)")
    return math.exp(total / count)
