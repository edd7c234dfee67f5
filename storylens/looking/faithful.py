"""What a head moves, not only where it looks: norm-weighted attention (Kobayashi et al. 2020,
"Attention is not only a weight") and each head's share of its block's output. Pure functions of one
block's tensors (what each key's value writes, and its size: :mod:`storylens.engine.images`; how far raw
attention and the two agree: :mod:`storylens.engine.ranks`); :class:`~storylens.table.accumulator.HeadScoreAccumulator`
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
What a head moves that depends on the story (sinks, dormant heads): :mod:`storylens.looking.sinks`.
"""

from __future__ import annotations

import torch


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
