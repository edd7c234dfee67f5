"""Running means of per-story values: a sum and a count, nothing else kept."""

from __future__ import annotations

import torch


class MeanAccumulator:
    """Mean over stories of a per-story value of shape ``shape`` (e.g. ``[block, head]``).

    ``add`` takes one batch, ``[batch, *shape]``, and a ``[batch]`` mask of the stories
    that count; the sum is kept in float64. Memory does not grow with the stories seen.
    """

    def __init__(self, shape: tuple[int, ...] = ()):
        self.total = torch.zeros(shape, dtype=torch.float64)
        self.count = 0

    def add(self, values: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        values = values.detach().cpu().to(torch.float64)  # cpu first: some devices lack float64
        if keep is not None:
            values = values[keep.cpu()]
        self.total += values.sum(dim=0)
        self.count += int(values.shape[0])

    def mean(self) -> torch.Tensor:
        """The mean so far; NaN everywhere while nothing has been added."""
        if self.count == 0:
            return torch.full_like(self.total, float("nan"))
        return self.total / self.count

    def merge(self, other: "MeanAccumulator") -> "MeanAccumulator":
        """Add another accumulator's sum and count (the same shape): sums of float64, any order."""
        if other.total.shape != self.total.shape:
            raise ValueError(f"merge: shapes {tuple(self.total.shape)} and {tuple(other.total.shape)} differ")
        self.total += other.total
        self.count += other.count
        return self

    def state(self) -> dict:
        """Sum and count as plain data (float64 sums written exactly by JSON's shortest repr)."""
        return {"total": self.total.tolist(), "count": self.count}

    @classmethod
    def from_state(cls, state: dict, shape: tuple[int, ...]) -> "MeanAccumulator":
        acc = cls(shape)
        total = torch.tensor(state["total"], dtype=torch.float64)
        if total.shape != acc.total.shape:
            raise ValueError(f"state: shape {tuple(total.shape)}, expected {tuple(acc.total.shape)}")
        acc.total, acc.count = total, int(state["count"])
        return acc
