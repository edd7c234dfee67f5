"""The detectors' arithmetic: pure functions of one block's attention ``[batch, head, query, key]`` (and, for
the norm-weighted columns, the keys' output norms) giving a number per query ``[batch, head, query]``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from storylens.engine.masks import PREV_SPAN, norms_for_keys, row_earlier_max


def diagonal(pattern: torch.Tensor, k: int, start: int = 0) -> torch.Tensor:
    """``out[..., r] = pattern[..., r, q - k]`` for the query ``q = start + r`` of row ``r`` (0 for
    q < k); ``start``: the first query a chunk of rows holds (0: the whole map)."""
    n, lead = pattern.shape[-2], max(0, k - start)
    return F.pad(pattern.diagonal(offset=start - k, dim1=-2, dim2=-1), (lead, 0))[..., :n]


def prev_token(pattern: torch.Tensor, start: int = 0) -> torch.Tensor:
    return diagonal(pattern, 1, start)


def prev_span(pattern: torch.Tensor, span: int = PREV_SPAN, start: int = 0) -> torch.Tensor:
    """Attention on the ``span`` positions before each query, together."""
    return span_sum(lambda k: diagonal(pattern, k, start), span)


def span_sum(diagonal_at: Callable[[int], torch.Tensor], span: int = PREV_SPAN) -> torch.Tensor:
    """``diagonal_at(1) + diagonal_at(2) + .. + diagonal_at(span)``, in that order: the one sum every
    form of :func:`prev_span` takes (raw, scaled, from :class:`~storylens.looking.reads.Reads`), so all give the same bits."""
    return sum((diagonal_at(k) for k in range(2, span + 1)), diagonal_at(1))


def prev_is_argmax(pattern: torch.Tensor, start: int = 0, earlier: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., query]`` float: 1 where key ``q - 1`` is the query's most-attended key, ties going
    to the earliest key (exactly ``pattern.argmax(-1) == q - 1``; 0 for query 0).

    Computed with one ``amax`` instead of ``argmax`` (which tracks indices and is four times slower
    here): key q - 1 wins when its weight is at least query q's own (a later key, which it beats
    on a tie) and above every key before it. Keys after q hold exactly 0 and never win (every
    weight the softmax gives is above 0). To take the maximum over keys 0 .. q-2 without a copy
    of the map, the two newest diagonals are set to 0 for the ``amax`` and written back after:
    ``pattern`` leaves this function bit for bit as it came in. ``start``: the first query of a
    chunk of rows (see :func:`diagonal`). ``earlier``: :func:`row_earlier_max` of ``pattern``, where
    already taken (:meth:`~storylens.engine.masks.Masks.earlier_max`).
    """
    n, lead = pattern.shape[-2], max(0, 1 - start)  # lead: query 0 has no previous key
    prev = pattern.diagonal(offset=start - 1, dim1=-2, dim2=-1)  # views: [..., n - lead]
    own = pattern.diagonal(offset=start, dim1=-2, dim2=-1)
    earlier = row_earlier_max(pattern, start) if earlier is None else earlier  # [..., query]: keys 0 .. q-2
    wins = (prev >= own[..., lead:n]) & (prev > earlier[..., lead:])
    return F.pad(wins.to(pattern.dtype), (lead, 0))[..., :n]


def key_columns_mass(pattern: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``pattern [B, H, q, k] @ columns [B, 1, k, n]``: attention on each of ``n`` key sets."""
    return pattern @ columns


def scaled(pattern: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """The norm-scaled map ``pattern * norms[key]`` ``[B, H, q, k]`` (what :attr:`~storylens.looking.detectors.Detector.scaled`
    computes on without forming it; :func:`storylens.looking.faithful.norm_scaled`'s products)."""
    return pattern * norms_for_keys(pattern, norms)[:, :, None, :]


def key_diagonal(norms: torch.Tensor, k: int, start: int, n: int) -> torch.Tensor:
    """``out[..., r] = norms[..., q - k]`` for the query ``q = start + r`` of row ``r`` (0 for q < k):
    the key norm :func:`diagonal` ``k`` reads at each row, ``[B, H, n]``."""
    lead = min(n, max(0, k - start))
    return F.pad(norms[..., start + lead - k : start + n - k], (lead, 0))


def scaled_diagonal(pattern: torch.Tensor, norms: torch.Tensor, k: int, start: int = 0) -> torch.Tensor:
    """:func:`diagonal` of the scaled map (:func:`scaled`), bit for bit, reading ``n`` entries."""
    n = pattern.shape[-2]
    return diagonal(pattern, k, start) * key_diagonal(norms_for_keys(pattern, norms), k, start, n)


def scaled_prev_span(pattern: torch.Tensor, norms: torch.Tensor, span: int = PREV_SPAN, start: int = 0) -> torch.Tensor:
    """:func:`prev_span` of the scaled map, bit for bit (the same sums in the same order)."""
    return span_sum(lambda k: scaled_diagonal(pattern, norms, k, start), span)


def scaled_prev_is_argmax(
    pattern: torch.Tensor, norms: torch.Tensor, start: int = 0, earlier: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`prev_is_argmax` of the scaled map (:func:`scaled`), decided without forming it.

    Key ``q - 1`` wins when ``s_prev >= s_own`` and ``s_prev`` is above every ``s_j = a_j w_j``,
    ``j <= q - 2``. With ``E`` the largest raw weight there (one ``amax`` over the map, no copy) and
    ``lo <= w_j <= hi`` the smallest and largest key norm there (running minimum and maximum), the
    rounded products obey ``E lo <= max_j s_j <= E hi`` (rounding is monotonic), so ``s_prev > E hi``
    wins and ``s_prev <= E lo`` loses for certain; only the rows in between are scaled and compared
    in full. The same decision, bit for bit, as on the formed map. ``earlier``: as
    :func:`prev_is_argmax`'s (the raw map's, shared)."""
    n = pattern.shape[-2]
    w = norms_for_keys(pattern, norms)  # [B, H, keys]
    earlier = row_earlier_max(pattern, start) if earlier is None else earlier  # [..., n]: raw, keys 0 .. q-2
    prev = diagonal(pattern, 1, start) * key_diagonal(w, 1, start, n)  # [..., n]: s_{q-1}
    own = pattern.diagonal(offset=start, dim1=-2, dim2=-1)[..., :n] * w[..., start : start + n]  # s_q
    return scaled_wins(pattern, w, start, earlier, prev, own)


def scaled_wins(
    pattern: torch.Tensor,
    w: torch.Tensor,
    start: int,
    earlier: torch.Tensor,
    prev: torch.Tensor,
    own: torch.Tensor,
    known: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`scaled_prev_is_argmax` given ``w`` (the key norms in the map's dtype), the raw map's
    ``earlier`` maximum and each row's scaled weights on keys ``q - 1`` (``prev``, 0 for query 0) and
    ``q`` (``own``), ``[B, H, n]`` each; ``known``: where given, the largest of some scaled weights
    of each row on keys ``j <= q - 2`` (0 where none), a lower bound of their maximum as ``E lo`` is."""
    n, lead = pattern.shape[-2], max(0, 1 - start)
    hi = key_diagonal(w.cummax(-1).values, 2, start, n)  # [..., n]: over keys 0 .. q-2 (0 for q < 2)
    lo = key_diagonal(w.cummin(-1).values, 2, start, n)
    wins = prev > earlier * hi
    below = earlier * lo if known is None else torch.maximum(earlier * lo, known)
    unsure = ~wins & ~(prev <= below)
    if bool(unsure.any()):  # those rows scaled and compared in full
        b, h, r = unsure.nonzero(as_tuple=True)
        rows = _rows_at(pattern, b, h, r) * _rows_at(w, b, h)  # [m, keys]
        q = start + r  # each row's query (a key of its map: q < keys)
        rows.scatter_(-1, torch.stack([q, (q - 1).clamp(min=0)], -1), 0)  # as prev_is_argmax zeroes them
        wins[b, h, r] = prev[b, h, r] > rows.amax(-1)
    wins &= prev >= own
    wins[..., :lead] = False
    return wins.to(pattern.dtype)


def _rows_at(x: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for indices into every axis but the last (``[m, last]``): one ``index_select`` of
    flat rows where ``x`` is contiguous (several times faster on a CPU than advanced indexing)."""
    if not x.is_contiguous():
        return x[index]
    flat = index[0]
    for size, i in zip(x.shape[1:-1], index[1:]):
        flat = flat * size + i
    return x.view(-1, x.shape[-1]).index_select(0, flat)


def keys_mass(pattern: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Attention on a per-query key set ``keys [B, q, k]`` (weights or 0/1): ``[B, H, q]``."""
    return torch.einsum("bhqk,bqk->bhq", pattern, keys.to(pattern.dtype))


def pairs_mass(
    pattern: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    start: int = 0,
    norms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention on a key set given as pairs (:meth:`~storylens.engine.masks.Masks.key_pairs`: ``queries``, ``keys``
    ``[B, P]``, a query past the chunk's rows marking no pair), for a chunk of rows whose first
    query is ``start``: ``[B, H, q]``, equal to :func:`keys_mass` on the same key set. One
    gather of the pairs' weights from the map seen flat (a query's few keys, not every query padded
    to the most any has), then each query's summed."""
    B, H, Q, K = pattern.shape
    row = (queries - start).clamp(max=Q)  # Q: no pair (a slot of its own, dropped)
    flat = torch.where(row < Q, row * K + keys, 0)  # [B, P] into each story's [q * k]
    picked = pattern.reshape(B, H, Q * K).gather(-1, flat[:, None].expand(B, H, flat.shape[1]))  # [B, H, P]
    if norms is not None:  # on the scaled map (:func:`scaled`), bit for bit: each pair's weight times its key's norm
        picked = picked * norms_for_keys(pattern, norms).gather(-1, keys[:, None].expand(B, H, keys.shape[1]))
    out = torch.zeros(B, H, Q + 1, dtype=pattern.dtype, device=pattern.device)
    return out.scatter_add_(-1, row[:, None].expand(B, H, row.shape[1]), picked)[..., :Q]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x [batch, head, query]`` over the queries in ``mask [batch, query]``: ``[batch, head]``."""
    m = mask.to(x.dtype)[:, None, :]
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1)
