"""The one way storylens batches token sequences: longest first (:func:`length_batches`), padded at
the end (:func:`pad_batch`). With causal attention a padded position never changes an earlier one,
so padding at the end changes no real token's logits or attention."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from storylens.core.errors import StorylensError

BATCH_TOKENS = 4096  # a recording batch's padded tokens at most (stories x its longest story)


def length_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indices, longest first (stable), in batches of at most ``batch_size`` stories and, with
    ``max_tokens``, at most that many padded tokens (stories x the batch's longest, its first; a
    story longer than that goes alone): little padding, and a long story never drags a full
    batch of short ones to its length."""
    if batch_size < 1:
        raise StorylensError(f"batch_size: must be at least 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise StorylensError(f"max_tokens: must be at least 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if (
            last is None
            or len(last) == batch_size
            or (max_tokens is not None and (len(last) + 1) * max(lengths[last[0]], 1) > max_tokens)
        ):
            batches.append([i])
        else:
            last.append(i)
    return batches


def pad_batch(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqs`` as one ``[batch, tokens]`` long tensor padded at the end with ``pad_id`` (``tokens``:
    the longest), and their ``[batch]`` lengths; both on ``device`` (default: the CPU)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    grid = torch.full((len(seqs), max((len(s) for s in seqs), default=0)), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        grid[row, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return grid.to(device), lengths.to(device)


def valid_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, width]`` bool: True at each row's real tokens (before its padding)."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
