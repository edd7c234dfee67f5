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

    def merge(self, other: MeanAccumulator) -> MeanAccumulator:
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
    def from_state(
        cls, state: dict, shape: tuple[int, ...], *, max_count: int | None = None, bounded: bool = True
    ) -> MeanAccumulator:
        """The accumulator :meth:`state` wrote, every number checked: a whole count from 0 to
        ``max_count``, finite sums of per-story values in [0, 1] (every score storylens keeps is a
        share of attention), so each sum lies in [0, count] up to float64 rounding (a sum of n
        terms is off by at most n^2 u for terms of magnitude up to 1, u = 2^-53: allowed twice).
        ``bounded=False``: per-story values 0 or more with no upper bound (a head's output norm),
        so only finite sums of at least 0 (no story can make a sum negative)."""
        acc = cls(shape)
        if not isinstance(state, dict) or set(state) != {"total", "count"}:
            raise ValueError("not a {total, count} object")
        count = state["count"]
        if (
            isinstance(count, bool)
            or not isinstance(count, int)
            or count < 0
            or (max_count is not None and count > max_count)
        ):
            raise ValueError(f"count {count!r} is not a whole number from 0 to {max_count}")
        try:
            total = torch.tensor(state["total"], dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError("sums are not numbers") from None
        if total.shape != acc.total.shape:
            raise ValueError(f"shape {tuple(total.shape)}, expected {tuple(acc.total.shape)}")
        slack = 2 * count * count * 2.0**-53
        if not bounded:
            bad = ~torch.isfinite(total) | (total < 0)
            if bad.any():
                raise ValueError(f"a sum of {total[bad].flatten()[0].item():g} over {count} stories is not 0 or more")
            acc.total, acc.count = total, count
            return acc
        bad = ~torch.isfinite(total) | (total < -slack) | (total > count + slack)
        if bad.any():
            raise ValueError(f"a sum of {total[bad].flatten()[0].item():g} over {count} stories is outside 0..{count}")
        acc.total, acc.count = total, count
        return acc
