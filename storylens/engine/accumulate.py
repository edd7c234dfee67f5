"""Running means of per-story values: a sum and a count, nothing else kept."""

from __future__ import annotations

import math

import torch


class MeanAccumulator:
    """Mean over stories of a per-story value of shape ``shape`` (e.g. ``[block, head]``).

    ``add`` takes one batch, ``[batch, *shape]``, and a ``[batch]`` mask of the stories
    that count; the sum is kept in float64. Memory does not grow with the stories seen.

    What a batch adds stays where the batch is (a GPU's float64: no copy to the host, no wait for the device's
    queue, per block and detector) until the sum or the count is read (:attr:`total`, :attr:`count`: once a run,
    or a checkpoint); on a device without float64 it is summed on the CPU as it comes.
    """

    def __init__(self, shape: tuple[int, ...] = ()):
        self._total = torch.zeros(shape, dtype=torch.float64)
        self._count = 0
        self._pending: torch.Tensor | None = None  # on the batches' device: sums not yet added to _total
        self._pending_count: torch.Tensor | int = 0

    def add(self, values: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        values = values.detach()
        if values.device.type == "mps":  # no float64 there: summed on the CPU as before
            values = values.cpu()
            keep = None if keep is None else keep.cpu()
        values = values.to(torch.float64)
        n: torch.Tensor | int
        if keep is None:
            added, n = values.sum(dim=0), values.shape[0]
        else:
            kept = keep.to(values.device).reshape(-1, *([1] * (values.dim() - 1)))
            added, n = torch.where(kept, values, 0.0).sum(dim=0), keep.sum()  # not values[keep]: that waits
        self._pending = added if self._pending is None else self._pending + added
        self._pending_count = self._pending_count + n

    def _flush(self) -> None:
        if self._pending is not None:
            self._total = self._total + self._pending.cpu()  # the one copy to the host (and wait), when read
            self._count += int(self._pending_count)
            self._pending, self._pending_count = None, 0

    @property
    def total(self) -> torch.Tensor:
        self._flush()
        return self._total

    @total.setter
    def total(self, value: torch.Tensor) -> None:
        self._flush()
        self._total = value

    @property
    def count(self) -> int:
        self._flush()
        return self._count

    @count.setter
    def count(self, value: int) -> None:
        self._flush()
        self._count = value

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


def pooled_ratio(
    sum_c: torch.Tensor,
    sum_n: torch.Tensor | float,
    sum_c2: torch.Tensor,
    sum_cn: torch.Tensor,
    sum_n2: torch.Tensor | float,
    stories: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pooled per-token figure and its standard error from per-story sums.

    Story ``s`` contributes ``c_s`` (e.g. the change in its summed loss) over ``n_s`` tokens; the
    figure is ``R = sum c_s / sum n_s`` (per token, pooled as perplexity is), and its standard error
    the ratio estimator's, by the delta method over stories drawn at random:

        se(R)^2 = S / (S - 1) * sum_s (c_s - R n_s)^2 / (sum_s n_s)^2,

    with ``sum_s (c_s - R n_s)^2 = sum c^2 - 2 R sum c n + R^2 sum n^2`` (so only the five sums
    are kept: streamed and mergeable). NaN for the error with fewer than two stories; clamped at 0
    where rounding leaves the sum of squares slightly negative. Float64 throughout."""
    c, cc, cn = (torch.as_tensor(x, dtype=torch.float64) for x in (sum_c, sum_c2, sum_cn))
    n, nn = (torch.as_tensor(x, dtype=torch.float64) for x in (sum_n, sum_n2))
    ratio = c / n
    if stories < 2:
        return ratio, torch.full_like(ratio, float("nan"))
    spread = (cc - 2 * ratio * cn + ratio * ratio * nn).clamp(min=0)
    return ratio, (stories / (stories - 1) * spread).sqrt() / n


def cauchy_slack(count: int, width: int = 1) -> float:
    """The relative rounding a float64 sum of ``count`` terms, each a product of ``width``-long sums, can carry
    (at most ``(count + width) * 2**-53`` per sum, by the standard bound), times 8 for the two sides and margin:
    how far an inequality between such sums may be crossed by rounding alone."""
    return 8 * (count + width + 2) * 2.0**-53


def _check_ratio_sums(c: torch.Tensor, c2: torch.Tensor, cn: torch.Tensor, n: float, n2: float, count: int) -> None:
    """ValueError unless the five sums of a :class:`RatioAccumulator` are what ``count`` stories can give
    (Cauchy-Schwarz over the stories, each ``n_s >= 0``): ``n^2 <= count n2 <= count n^2``,
    ``c^2 <= count c2``, ``cn^2 <= c2 n2``, with rounding's slack (:func:`cauchy_slack`). An edited sum breaks
    one of them unless the others are edited to match."""
    rel = cauchy_slack(count)
    if count == 0:
        if n or n2 or bool(c.abs().sum() + c2.abs().sum() + cn.abs().sum()):
            raise ValueError("sums over 0 stories are not 0")
        return
    if n * n > count * n2 * (1 + rel) or n2 > n * n * (1 + rel):
        raise ValueError(f"token counts n={n:g}, n2={n2:g} cannot come from {count} stories")
    worst = (c * c - count * c2 * (1 + rel)).max()
    if worst > 0:
        raise ValueError(
            f"sums c and c2 cannot come from {count} stories (the square of a sum exceeds count x its squares)"
        )
    if (cn * cn > c2 * n2 * (1 + rel) + 1e-300).any():
        raise ValueError("sums cn, c2 and n2 cannot come from any stories (Cauchy-Schwarz)")


class RatioAccumulator:
    """Streamed sums for :func:`pooled_ratio`: per story a value ``c_s`` of shape ``shape`` over
    ``n_s`` tokens. ``add(c [batch, *shape], n [batch])``; :meth:`merge` adds another's sums in any
    order (float64); :meth:`result` gives ``(ratio, se)``."""

    def __init__(self, shape: tuple[int, ...] = ()):
        z = torch.zeros(shape, dtype=torch.float64)
        self.c, self.c2, self.cn = z.clone(), z.clone(), z.clone()
        self.n, self.n2, self.count = 0.0, 0.0, 0

    def add(self, c: torch.Tensor, n: torch.Tensor) -> None:
        c, n = c.detach().cpu().to(torch.float64), n.detach().cpu().to(torch.float64)
        w = n.reshape(-1, *([1] * (c.dim() - 1)))
        self.c += c.sum(0)
        self.c2 += (c * c).sum(0)
        self.cn += (c * w).sum(0)
        self.n += float(n.sum())
        self.n2 += float((n * n).sum())
        self.count += int(n.shape[0])

    def merge(self, other: RatioAccumulator) -> RatioAccumulator:
        if other.c.shape != self.c.shape:
            raise ValueError(f"merge: shapes {tuple(self.c.shape)} and {tuple(other.c.shape)} differ")
        self.c += other.c
        self.c2 += other.c2
        self.cn += other.cn
        self.n += other.n
        self.n2 += other.n2
        self.count += other.count
        return self

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ratio, se)``; NaN while no token was added."""
        if self.n == 0:
            nan = torch.full_like(self.c, float("nan"))
            return nan, nan.clone()
        return pooled_ratio(self.c, self.n, self.c2, self.cn, self.n2, self.count)

    def state(self) -> dict:
        """The sums as plain data (float64 written exactly by JSON's shortest repr)."""
        return {
            "c": self.c.tolist(),
            "c2": self.c2.tolist(),
            "cn": self.cn.tolist(),
            "n": self.n,
            "n2": self.n2,
            "count": self.count,
        }

    @classmethod
    def from_state(cls, state: dict, shape: tuple[int, ...]) -> RatioAccumulator:
        """The accumulator :meth:`state` wrote; ValueError naming what is wrong."""
        if not isinstance(state, dict) or set(state) != {"c", "c2", "cn", "n", "n2", "count"}:
            raise ValueError("not a ratio accumulator's state")
        acc = cls(shape)
        count = state["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count {count!r} is not a whole number of 0 or more")
        try:
            sums = {k: torch.tensor(state[k], dtype=torch.float64) for k in ("c", "c2", "cn")}
            n, n2 = float(state["n"]), float(state["n2"])
        except (TypeError, ValueError, RuntimeError):
            raise ValueError("sums are not numbers") from None
        for k, v in sums.items():
            if v.shape != acc.c.shape or not torch.isfinite(v).all():
                raise ValueError(f"{k}: shape {tuple(v.shape)} or a value not finite")
        if not (n >= 0 and n2 >= 0 and n == n and n2 == n2) or (sums["c2"] < 0).any():
            raise ValueError("token counts or sums of squares negative or not numbers")
        if math.isinf(n) or math.isinf(n2):
            raise ValueError("token counts not finite")
        _check_ratio_sums(sums["c"], sums["c2"], sums["cn"], n, n2, count)
        acc.c, acc.c2, acc.cn = sums["c"], sums["c2"], sums["cn"]
        acc.n, acc.n2, acc.count = n, n2, count
        return acc
