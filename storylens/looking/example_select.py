"""How the top examples are chosen, as tensor operations: a batch's story order, the queries a block
offers and takes, each story's cap, the k best, and the weights rounded in place. Pure functions and plain
holders, used by :class:`storylens.looking.examples.TopExamples`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from storylens.engine.encode import StoryBatch
from storylens.looking.example_store import (
    KEY_AFTER,
    KEY_BEFORE,
    WEIGHT_DECIMALS,
)

KEY_WIDTH = KEY_BEFORE + KEY_AFTER  # the key's window: key - 3 .. key + 3


NARROW = (torch.float32, torch.float16, torch.bfloat16)  # weights rounded in tensor ops (see rounded())


SPLIT = 2**32  # story * SPLIT + query: one integer in (story, query) order (a query is below 2^32)


@dataclass(frozen=True)
class BatchView:
    batch: StoryBatch
    Q: int  # query rows
    start: int  # the first of them
    device: torch.device
    perm: torch.Tensor | None  # the rows in story order (None: already)
    inside: torch.Tensor  # [B, Q] real positions, rows in story order
    story_of: torch.Tensor  # [1, B * Q] story index of each flat position (story order)
    query_of: torch.Tensor  # [1, B * Q] query position of each flat position
    order_of: torch.Tensor  # [B, Q] story * SPLIT + query position of each row and query (batch order)
    flat_order: torch.Tensor  # [1, B * Q] story * SPLIT + query position of each flat position (story order)


@dataclass(frozen=True)
class Taken:
    """One block's queries taken into its top ``k`` rows (:meth:`~storylens.looking.examples.TopExamples.add_stacked`), waiting for
    :meth:`~storylens.looking.examples.TopExamples.flush`: the slots' rows ``rows [R]``, which of the ``c`` places per row are real
    ``[R, c]`` and their flat indices ``at [N]``, and per taken query its row of the map ``[N, K]`` (read
    when the block was fed), value (float64), flat index in story order, row in the chunk and in the batch."""

    READ: ClassVar[tuple[str, ...]] = ("rowmaps", "value", "flat", "qi", "bi")  # what TopExamples._windows reads

    layer: int
    rows: torch.Tensor
    real: torch.Tensor
    at: torch.Tensor
    view: BatchView
    rowmaps: torch.Tensor
    value: torch.Tensor
    flat: torch.Tensor
    qi: torch.Tensor
    bi: torch.Tensor

    @property
    def c(self) -> int:
        """Places per row: ``min(k, B * Q)``."""
        return self.real.shape[1]

    def alike(self, other: Taken) -> bool:
        """Taken from the same batch's same rows, the same slot count, keys and dtype: selected together."""
        a, b = self.rowmaps, other.rowmaps
        return self.view is other.view and self.c == other.c and a.shape[-1] == b.shape[-1] and a.dtype == b.dtype


@dataclass(frozen=True)
class Offered:
    """One block's queries that can enter its top ``k`` rows (:meth:`~storylens.looking.examples.TopExamples.add_stacked`), waiting
    for :meth:`~storylens.looking.examples.TopExamples.flush` to select among them with every other block's: ``at [n]`` their flat
    indices in the block's values ``[B, H, D, Q]`` (detector ``det[d]``), ``value [n]`` and each one's
    row of the map ``rowmaps [n, K]``, read when the block was fed."""

    layer: int
    names: tuple[str, ...]
    det: torch.Tensor
    view: BatchView
    at: torch.Tensor
    value: torch.Tensor
    rowmaps: torch.Tensor

    def alike(self, other: Offered) -> bool:
        """The same batch view, detectors, key count and dtypes: selected among together."""
        a, b = self.rowmaps, other.rowmaps
        same = a.shape[-1] == b.shape[-1] and a.dtype == b.dtype and self.value.dtype == other.value.dtype
        return self.view is other.view and self.names == other.names and same


def alike_groups(items: Sequence) -> list[list]:
    """``items`` (each with ``alike(other)``) in groups of alike ones, in the order they first came."""
    groups: list[list] = []
    for item in items:
        group = next((g for g in groups if g[0].alike(item)), None)
        if group is None:
            groups.append([item])
        else:
            group.append(item)
    return groups


def ranks_of(key: torch.Tensor) -> torch.Tensor:
    """Each entry's place among the entries of its run of equal ``key`` (sorted ``[n]``), from 0."""
    return torch.arange(key.numel(), device=key.device) - torch.searchsorted(key, key)


def sorted_by(*keys: torch.Tensor) -> torch.Tensor:
    """The permutation sorting ``[n]`` entries by ``keys[0]``, then ``keys[1]``, ...: stable sorts, the
    last key first."""
    order = keys[-1].argsort(stable=True)
    for key in reversed(keys[:-1]):
        order = order.gather(0, key.gather(0, order).argsort(stable=True))
    return order


def at_most(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each float64 as the largest ``dtype`` value not above it (exact when it is one): a worst
    value kept from a float64 run still admits every query that beats it."""
    near = exact.to(dtype)
    return torch.where(near.to(torch.float64) > exact, torch.nextafter(near, torch.full_like(near, -math.inf)), near)


def worst_kept(
    floats: torch.Tensor, ints: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The worst kept example of each of the slots' ``rows [r]``: its value as ``dtype`` (:func:`at_most`;
    -inf: room left) and its ``story * SPLIT + query`` (negative for an empty slot: no query is before it)."""
    last = ints[rows, -1]
    return at_most(floats[rows, -1, 0], dtype), last[:, 0] * SPLIT + last[:, 1]


def story_worst_kept(
    floats: torch.Tensor,
    ints: torch.Tensor,
    rows: torch.Tensor,
    stories: torch.Tensor,
    per_story: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the slots' ``rows [r]`` and each story of ``stories [B]`` (story indices): the worst of that
    story's ``per_story`` best kept examples, as :func:`worst_kept` gives a row's worst (``[r, B]`` each; -inf
    and -1 where the row keeps fewer of the story). A query of the story that does not beat it never enters
    the row: its story's best ``per_story`` are kept already (a row's slots are best first), and a row keeps
    no more of one story. Where one story runs over several chunks (a long story), this is what keeps
    its later chunks from being selected among in full."""
    story, value = ints[rows, :, 0], floats[rows, :, 0]  # [r, k]
    mine = (story[:, :, None] == stories) & value.isfinite()[:, :, None]  # [r, k, B]
    nth = mine & (mine.cumsum(1) == per_story)  # the story's per_story-th kept, in the row's order
    at = nth.to(torch.uint8).argmax(1)  # [r, B]
    has = nth.any(1)
    low = torch.tensor(-math.inf, dtype=dtype, device=floats.device)
    later = story.gather(1, at) * SPLIT + ints[rows, :, 1].gather(1, at)
    return torch.where(has, at_most(value.gather(1, at), dtype), low), torch.where(has, later, -1)


def beating(
    values: torch.Tensor,
    counted: torch.Tensor,
    floats: torch.Tensor,
    ints: torch.Tensor,
    rows: torch.Tensor,
    order: torch.Tensor,
    per_story: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which queries of ``values [B, H, D, Q]`` can enter their rows (the slots' ``rows [D * H]``,
    detector-major): counted (``counted [B, D, Q]``) and beating the row's worst kept (:func:`worst_kept`,
    in the order of ``order [B, Q]``, each query's ``story * SPLIT + query``) and, with ``per_story``, the
    worst of its story's kept (:func:`story_worst_kept`). Returns ``beats [B, H, D, Q]`` and the rows'
    worst kept, ``[H, D]`` each."""
    B, H, D, _ = values.shape
    worst, later = (x.view(D, H).t() for x in worst_kept(floats, ints, rows, values.dtype))  # [H, D] each
    after = order[:, None, None, :]  # [B, 1, 1, Q]
    beats = (values > worst[None, :, :, None]) | (
        (values == worst[None, :, :, None]) & (after < later[None, :, :, None])
    )
    if per_story is not None:
        got = story_worst_kept(floats, ints, rows, order[:, 0] // SPLIT, per_story, values.dtype)
        low, last = (x.view(D, H, B).permute(2, 1, 0)[..., None] for x in got)  # [B, H, D, 1] each
        beats &= (values > low) | ((values == low) & (after < last))
    return beats & counted[:, None], worst, later


def window_weights(rowmaps: torch.Tensor, around: torch.Tensor, before: int, width: int) -> torch.Tensor:
    """``[N, width]``: each row's attention on the ``width`` keys from ``max(0, around - before)`` on
    (``rowmaps [N, key]``, ``around [N]``: the query, or its most-attended key), the last key
    repeated past the map's end (never kept: an Example keeps the keys up to its query)."""
    start = (around - before).clamp(min=0)
    keys = (start[:, None] + torch.arange(width, device=rowmaps.device)).clamp(max=rowmaps.shape[-1] - 1)
    return rowmaps.gather(-1, keys)


def rounded_now(weights: torch.Tensor) -> torch.Tensor:
    """float64 weights that :func:`rounded` would give, bit for bit, for float32 or narrower weights;
    others widened as they are (rounded by Python when their Example is made)."""
    wide = weights.to(torch.float64)
    if weights.dtype in NARROW:
        scale = 10.0**WEIGHT_DECIMALS
        return torch.round(wide * scale) / scale
    return wide


def rounded(weights: torch.Tensor) -> list[list[float]]:
    """``[[round(w, WEIGHT_DECIMALS) for w in row] for row in weights.tolist()]``, bit for bit, in tensor
    ops where the weights are float32 or narrower: such a weight times 10^4 (a 24-bit significand times
    625 * 2^4, 34 bits) is exact in float64, ``torch.round`` then rounds it half to even as Python's
    ``round`` rounds the exact value, and the division is IEEE-rounded to the double nearest to the
    decimal result, which is what ``round`` returns. Wider weights take Python's ``round``."""
    if weights.dtype in NARROW:
        return rounded_now(weights).tolist()
    return [[round(float(w), WEIGHT_DECIMALS) for w in row] for row in weights.tolist()]


def story_capped(eligible: torch.Tensor, v: torch.Tensor, B: int, per_story: int) -> torch.Tensor:
    """``eligible [R, B * Q]`` narrowed to each row's best ``per_story`` queries of each story (a
    batch row), ties to the earliest query: the same rule as the top ``k``, story by story."""
    R, Q = v.shape[0], v.shape[1] // B
    e = eligible.view(R, B, Q)
    vs = torch.where(e, v.view(R, B, Q), torch.tensor(-math.inf, dtype=v.dtype, device=v.device))
    kth = vs.topk(min(per_story, Q), dim=-1).values[..., -1:]  # [R, B, 1]
    above = e & (vs > kth)
    tied = e & (vs == kth)
    room = per_story - above.sum(-1, keepdim=True)
    return (above | (tied & (tied.cumsum(-1) <= room))).view(R, B * Q)


def first_k(eligible: torch.Tensor, v: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the first ``k`` of the eligible queries under the order: every value above the k-th
    largest, then as many of the values equal to it as fit, earliest (story, query) first."""
    masked = torch.where(eligible, v, torch.tensor(-math.inf, dtype=v.dtype, device=v.device))
    kth = masked.topk(min(k, v.shape[1]), dim=-1).values[:, -1:]  # [R, 1]; -inf: fewer than k eligible
    above = eligible & (v > kth)
    tied = eligible & (v == kth)
    room = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def taken_rows(take: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``take [R, n]`` (at most ``k`` per row) as flat indices ``[R, c]``, ``c = min(k, n)``, in
    (story, query) order, and which of them are real (a row taking fewer is padded): no sync."""
    R, n = take.shape
    if take.device.type == "cpu":  # one pass over take: each taken query after its row's earlier ones
        ri, at = take.nonzero(as_tuple=True)  # row-major
        slot = torch.arange(ri.numel()) - torch.searchsorted(ri, ri)  # its place in its row
        fi = torch.full((R, min(k, n)), n - 1, dtype=torch.long)
        real = torch.zeros(R, min(k, n), dtype=torch.bool)
        fi[ri, slot], real[ri, slot] = at, True
        return fi, real
    flat = torch.where(take, torch.arange(n, device=take.device), n)
    fi = flat.topk(min(k, n), dim=-1, largest=False).values  # [R, c], sorted: the taken first
    return fi.clamp(max=n - 1), fi < n


def _groups(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``key [R, M]`` stably sorted per row: the order, and where each group of equal keys starts in it."""
    idx = key.argsort(dim=-1, stable=True)  # equal keys keep their order: a group's first is its earliest
    k = key.gather(-1, idx)
    start = torch.ones_like(k, dtype=torch.bool)
    start[:, 1:] = k[:, 1:] != k[:, :-1]
    return idx, start


def _first_of_group(key: torch.Tensor) -> torch.Tensor:
    """``[R, M]`` bool: True where no earlier slot of the row has the same key."""
    idx, start = _groups(key)
    return torch.empty_like(start).scatter_(-1, idx, start)


def _kept_before_in_group(key: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[R, M]``: how many earlier slots of the row with the same key are kept."""
    idx, start = _groups(key)
    kept = keep.gather(-1, idx).long()
    before = kept.cumsum(-1) - kept  # kept slots earlier in the sorted row
    first = torch.where(start, torch.arange(key.shape[1], device=key.device), 0).cummax(-1).values  # group start
    return torch.empty_like(before).scatter_(-1, idx, before - before.gather(-1, first))


def select_top(
    floats: torch.Tensor, ints: torch.Tensor, k: int, per_story: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top ``k`` slots of ``floats [R, M, F]`` / ``ints [R, M, I]`` (M >= k) as :func:`~storylens.looking.example_store.best_examples`
    picks them among the Examples they stand for: sorted by value descending, story, query, then
    slot (stable: what was kept before what is offered); a ``(story, query)`` seen before skipped;
    a story's slots past ``per_story`` skipped; the first ``k`` left, best first, then empty slots."""
    R, M, F = floats.shape
    dev = floats.device
    value, sq = floats[..., 0], ints[..., 0] * SPLIT + ints[..., 1]  # [R, M]
    real = value.isfinite()
    by = sq.argsort(dim=-1, stable=True)
    down = torch.where(real, -value, math.inf).gather(-1, by).argsort(dim=-1, stable=True)
    order = by.gather(-1, down)  # [R, M]: the slots best first
    sq, real, story = sq.gather(-1, order), real.gather(-1, order), ints[..., 0].gather(-1, order)
    # The real slots come first in this order (the empty ones sort last), so a real slot is seen before when an
    # earlier slot has its (story, query): it is not the first of its group. Groups by a stable sort: O(M log M)
    # per row, where the pairwise [R, M, M] comparison this replaced took 30 s and gigabytes at k in the thousands.
    keep = real & _first_of_group(sq)
    if per_story is not None:  # how many of its story sort before it (those skipped change nothing)
        keep &= _kept_before_in_group(story, keep) < per_story
    keep &= keep.cumsum(-1) <= k
    at = torch.where(keep, torch.arange(M, device=dev), M).sort(-1).values[:, :k]  # [R, k]; M: empty
    slot = order.gather(-1, at.clamp(max=M - 1))
    out_f = floats.gather(1, slot[..., None].expand(R, k, F))
    out_i = ints.gather(1, slot[..., None].expand(R, k, ints.shape[-1]))
    out_f[..., 0] = torch.where(at < M, out_f[..., 0], -math.inf)
    return out_f, out_i
