"""The one way storylens batches token sequences: longest first (:func:`length_batches`), padded at
the end (:func:`pad_batch`). With causal attention a padded position never changes an earlier one,
so padding at the end changes no real token's logits or attention."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from storylens.core.errors import StorylensError


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices, longest first (stable), in chunks of ``batch_size``: little padding."""
    if batch_size < 1:
        raise StorylensError(f"batch_size: must be at least 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def pad_batch(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqs`` as one ``[batch, tokens]`` long tensor padded at the end with ``pad_id`` (``tokens``:
    the longest), and their ``[batch]`` lengths; both on ``device`` (default: the CPU)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    grid = torch.full((len(seqs), int(lengths.max()) if len(seqs) else 0), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        grid[row, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return grid.to(device), lengths.to(device)


def valid_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, width]`` bool: True at each row's real tokens (before its padding)."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
