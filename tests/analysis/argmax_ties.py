"""How far a ``prev_argmax`` score may move when the maps move by rounding alone.

Two equal computations of an attention map differ by at most ``tol`` per probability (a bound from
:mod:`storylens.lesson.checks`). A query's most-attended key can then change only where it leads the
runner-up by at most ``2 * tol``; every other query's argmax, and so its 0/1 ``prev_argmax``
value, is the same in both. A head's score is the mean over stories of the per-story share of
such queries, so it may move by at most the mean over stories of the share of near-tied queries,
plus the float32 rounding of the means themselves (:func:`mean_rounding`).
"""

from __future__ import annotations

import numpy as np
import torch

from storylens.lesson.checks import unit_roundoff


def mean_rounding(window: int) -> float:
    """A per-story mean of 0/1 values over at most ``window`` queries, summed and divided in float32:
    within ``(window + 1) * u`` of exact; twice that between two such computations."""
    return 2 * (window + 1) * unit_roundoff(torch.float32)


def near_tie_share(att: torch.Tensor, lengths: torch.Tensor, tol: float) -> torch.Tensor:
    """``[batch, head]``: per story, the share of its scored queries (1 .. length - 1) whose top two
    keys in ``att [batch, head, query, key]`` are within ``2 * tol`` of each other."""
    top = att.topk(2, dim=-1).values  # [B, H, T, 2]
    close = (top[..., 0] - top[..., 1]) <= 2 * tol  # [B, H, T]
    q = torch.arange(att.shape[-2])[None, :]
    scored = (q >= 1) & (q < lengths[:, None])  # [B, T]
    return (close & scored[:, None]).sum(-1).double() / scored.sum(-1).clamp(min=1)[:, None]


def argmax_allowance(model, stories_ids, tol: float) -> np.ndarray:
    """``[block, head]``: how far ``prev_argmax`` over ``stories_ids`` (marker first) may move when the
    maps move by ``tol``, the rounding of the means included (module docstring); each story run alone."""
    total = torch.zeros(model.config.n_layer, model.config.n_head, dtype=torch.float64)
    with torch.no_grad():
        for ids in stories_ids:
            maps = model(torch.tensor([ids]), record_attention=True).patterns
            length = torch.tensor([len(ids)])
            total += torch.stack([near_tie_share(a, length, tol)[0] for a in maps])
    return (total / len(stories_ids)).numpy() + mean_rounding(model.config.block_size)
