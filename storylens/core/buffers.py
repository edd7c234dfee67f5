"""Scratch memory reused across chunks of work (:class:`Workspace`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class Workspace:
    """Flat buffers reused from one chunk of work to the next: a tensor written with ``out=`` into
    memory taken once, instead of a fresh allocation each time, which on a CPU is a page-faulted,
    zero-filled block every time it is larger than the allocator keeps. At most one buffer per
    name, dtype and device, as large as the largest asked for; freed with the workspace. For
    inference (an ``out=`` result records no gradient)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, room: int = 0
    ) -> torch.Tensor:
        """A contiguous ``shape`` tensor over buffer ``name``'s memory (its contents are stale).
        ``room``: where the buffer must grow, make it at least this many elements (the largest a
        run of growing chunks will ask for, so that it grows once)."""
        n = math.prod(shape)
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(max(n, room), dtype=dtype, device=device)
        return buf[:n].view(*shape)
