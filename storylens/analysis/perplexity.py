"""Perplexity over stories: exp(mean next-token loss), every story fed as ``[marker] + story`` (cut to
the window), every predicted token weighted equally. Works on any :class:`~storylens.lm.AttentionLM`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.nn import functional as F

from storylens.analysis.encode import length_batches
from storylens.core.errors import StorylensError
from storylens.lm import wrap


@torch.inference_mode()
def perplexity(model, stories: Sequence[str], *, batch_size: int = 16, tokenizer=None) -> float:
    lm = wrap(model, tokenizer)
    encoded = [lm.encode(s)[: lm.window] for s in stories]
    total, count = 0.0, 0
    was_training = lm.module.training
    lm.module.eval()
    try:
        for idx in length_batches([len(e) for e in encoded], batch_size):
            chunk = [encoded[i] for i in idx]
            T = max(len(e) for e in chunk)
            x = torch.full((len(chunk), T - 1), lm.marker_id, dtype=torch.long)
            y = torch.full((len(chunk), T - 1), -1, dtype=torch.long)
            for j, e in enumerate(chunk):
                x[j, : len(e) - 1] = torch.tensor(e[:-1])
                y[j, : len(e) - 1] = torch.tensor(e[1:])
            if T < 2:
                continue
            logits = lm.forward(x.to(lm.device))
            y = y.to(logits.device)
            total += float(
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=-1, reduction="sum"
                )
            )
            count += int((y >= 0).sum())
    finally:
        lm.module.train(was_training)
    if count == 0:
        raise StorylensError("stories: no token to predict")
    return math.exp(total / count)
