"""What a head moves, not only where it looks: norm-weighted attention (Kobayashi et al. 2020,
"Attention is not only a weight"), each head's output size, and how far raw attention and the two
agree. Pure functions of one block's tensors; :class:`~storylens.analysis.scores.HeadScoreAccumulator`
streams them in the same recording pass as the raw scores.

For head ``h`` of a block, query ``i`` and key ``j``: ``alpha_ij`` is the attention probability and
``f_j = v_j W_O^h`` is key ``j``'s value vector carried through the head's own slice of the output
projection (no bias; with grouped key/value heads, the value of the group head ``h`` reads).

``w_ij = alpha_ij |f_j| / sum_k alpha_ik |f_k|``
    the *norm-weighted* map (a row still sums to 1). Every detector is also computed on it: the
    ``norm_<detector>`` columns, with the same queries and means as the raw column.
``output_norm``
    the mean over queries (``q >= 1``, as the marker and previous-token scores count them) of
    ``|sum_j alpha_ij f_j|``: the size of what the head writes into the residual stream.
``output_share``
    a head's ``output_norm`` over the sum of its block's heads' ``output_norm``.
What a head moves that depends on the story (sinks, dormant heads): :mod:`storylens.analysis.sinks`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from storylens.core.errors import StorylensError


def ov_factor(w_o: torch.Tensor) -> torch.Tensor:
    """``[head, d, k]`` (``k = min(d, d_model)``): a factor ``F_h`` of each head's output weights
    :meth:`~storylens.lm.AttentionLM.head_output_weights` ``[head, d, d_model]`` with
    ``|x W_O^h| = |x F_h|`` for every ``x``, so that a vector's size through the head costs ``d * k``
    multiplications, not ``d * d_model``. From the QR factorisation ``W_O^h^T = Q R`` (``Q``'s
    columns orthonormal, so ``|x R^T Q^T| = |x R^T|``): ``F_h = R^T``, exact whatever the head's rank
    (a Cholesky factor of ``W_O^h W_O^h^T`` is cheaper to form but, for a head that writes in few
    directions, can come out of rounding with pivots of noise). In float32 at least (float64 stays float64).

    The same bits whatever the number of torch threads: LAPACK's blocked QR splits its work by
    thread and so rounds differently at 1 and 2 threads (every norm-weighted column and ``output_norm``
    then differed by up to 2e-5 between one process at 2 threads and a Ray actor at 1). The factor is
    formed in float64 on one thread (a few milliseconds a layer, once a pass) and rounded to the
    working dtype, so a process and every actor start from one factor."""
    dtype = torch.promote_types(w_o.dtype, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = torch.linalg.qr(w_o.to(torch.float64).transpose(-1, -2), mode="r").R
    finally:
        torch.set_num_threads(threads)
    return r.transpose(-1, -2).to(dtype)


def head_images(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``x[b, t, g] F_h`` for ``x [batch, tokens, group, d]`` and ``factor = ov_factor(W_O)``
    ``[head, d, k]``, query head ``h`` reading group ``h // (head // group)`` (as transformers'
    ``repeat_kv``; ``group = head`` for head outputs): ``[batch, head, tokens, k]``, in ``factor``'s
    dtype (float32 at least: a half-precision square overflows or keeps three digits). ``F_h = R^T``
    with ``W_O^h^T = Q R``, so ``x W_O^h = (x F_h) Q^T``: each vector's image in an orthonormal frame
    of the head's output space, with every length, distance and mean of the ``x W_O^h`` themselves.
    One matrix product per group for all of its heads; no copy of a group per head."""
    y = _group_images(x, factor)  # [G, B, T, r, k]
    G, B, T, r, k = y.shape
    return y.permute(1, 0, 3, 2, 4).reshape(B, G * r, T, k)


def _group_images(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """:func:`head_images` as the product leaves them, ``[group, batch, tokens, r, k]`` (head
    ``h = g * r + i`` at ``[g, ..., i, :]``), before the copy into ``[batch, head, tokens, k]``."""
    B, T, G, d = x.shape
    H, k = factor.shape[0], factor.shape[-1]
    if H % G:
        raise StorylensError(f"{H} query heads cannot share {G} key/value heads evenly")
    r = H // G
    xt = x.to(factor.dtype).permute(2, 0, 1, 3).reshape(G, B * T, d)  # [G, BT, d]
    per_group = factor.view(G, r, d, k).permute(0, 2, 1, 3).reshape(G, d, r * k)  # [G, d, r * k]
    return torch.bmm(xt, per_group).view(G, B, T, r, k)  # x F_h for each head h of the group


def head_norms(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``|x[b, t, g] W_O^h|`` ``[batch, head, tokens]``: the lengths of :func:`head_images`, taken
    before their copy into head order (each length the same sum over a contiguous row of ``k``;
    only the ``[.., tokens]`` lengths are moved)."""
    y = _group_images(x, factor)  # [G, B, T, r, k]
    G, B, T, r, _ = y.shape
    return torch.linalg.vector_norm(y, dim=-1).permute(1, 0, 3, 2).reshape(B, G * r, T)


def key_norms(v: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``|f_j|`` per query head: ``[batch, head, key]`` from ``hook_v``'s ``[batch, key, kv_head, d]``."""
    return head_norms(v, factor)


def norm_scaled(
    pattern: torch.Tensor, norms: torch.Tensor, out: torch.Tensor | None = None, *, row_sums: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(a_ij |f_j| [batch, head, query, key], the row sums [batch, head, query])``: the
    norm-weighted map before each row is divided by its sum (:func:`norm_weighted`), for detectors
    linear in a row, whose values are divided instead (one pass over the map fewer). ``out``: a
    tensor of ``pattern``'s shape and dtype to write the scaled map into (reused scratch memory);
    ``row_sums=False``: the sums are not taken (None; they came from elsewhere)."""
    weights = norms[:, :, None, :].to(pattern.dtype)
    scaled = pattern * weights if out is None else torch.mul(pattern, weights, out=out)
    return scaled, scaled.sum(-1) if row_sums else None


def row_divide(values: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``values / total`` where ``total > 0``; 0 where a row moved nothing (see :func:`norm_weighted`)."""
    return values / torch.where(total > 0, total, torch.ones((), dtype=total.dtype))


def norm_weighted(pattern: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``w [batch, head, query, key]`` from ``pattern`` (same shape) and ``norms [batch, head, key]``.
    A row whose keys all carry zero vectors stays all zero (nothing is moved, so nothing is shared out)."""
    weighted = pattern * norms[:, :, None, :].to(pattern.dtype)
    total = weighted.sum(-1, keepdim=True)
    return weighted / torch.where(total > 0, total, torch.ones((), dtype=total.dtype))


def shares(output_norm: torch.Tensor) -> torch.Tensor:
    """``[layer, head]``: each head's share of its block's summed head-output norms."""
    return output_norm / output_norm.sum(-1, keepdim=True)


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
