"""Spearman's rank correlation between two columns of heads, and the heads whose rank moves most."""

from __future__ import annotations

import math
from collections.abc import Sequence


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1 (smallest), ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            out[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return out


def rank_correlation(a: Sequence[float | None], b: Sequence[float | None]) -> float | None:
    """Spearman's rank correlation of two columns over the heads where both exist (None when fewer
    than three, or one column is constant there)."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    ra, rb = ranks([p[0] for p in pairs]), ranks([p[1] for p in pairs])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / math.sqrt(va * vb)


def rank_moves(a: Sequence[float | None], b: Sequence[float | None], labels: Sequence[str], k: int = 3):
    """The ``k`` heads whose rank (1 = strongest) moves most from column ``a`` to column ``b``:
    ``[(label, rank in a, rank in b)]``, largest move first."""
    idx = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x is not None and y is not None]
    if not idx:
        return []
    n = len(idx)
    ra = ranks([-float(a[i]) for i in idx])  # type: ignore[arg-type]
    rb = ranks([-float(b[i]) for i in idx])  # type: ignore[arg-type]
    moved = sorted(range(n), key=lambda t: (-abs(ra[t] - rb[t]), ra[t]))[:k]
    return [(labels[idx[t]], ra[t], rb[t]) for t in moved]
