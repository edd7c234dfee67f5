"""What each head writes: a key's value vector through the head's slice of the output projection (its
*image*, Kobayashi et al. 2020), the size of that image, made by the recording pass for the norm-weighted maps."""

from __future__ import annotations

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
