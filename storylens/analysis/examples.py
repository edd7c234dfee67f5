"""Where a head fires: for every head and every detector, the ``k`` queries with the highest
per-query value over every story recorded, kept as the recording streams (memory stays flat:
only ``k`` entries per head and detector ever exist).

:class:`TopExamples` is fed, block by block, the per-query values a detector already computed
(``values [batch, head, query]``, the counted queries ``[batch, query]``) together with the
block's attention map, so no detector is computed twice. For every kept query it records the
story (its index in source order), the query position (0 = the opening marker), the value, the
most-attended key (``argmax`` over keys, ties to the earliest key) and its weight, and the
token ids around the query and around that key, and the query's attention weights over both
windows up to itself (4 decimals: what a page shades the tokens by), so a view always holds the
most-attended key with its weight, however far before the query it lies. Ids only: text is decoded
when the examples are written (:meth:`TopExamples.to_json`).

**Order.** Value descending, then story index ascending, then query position ascending; a
``(story, query)`` pair appears at most once. It is a total order, so the top ``k`` of a set
does not depend on how the set was split: one process, a run resumed from a checkpointed
:meth:`~TopExamples.state`, and any number of workers :meth:`~TopExamples.merge`-d in any order
give identical lists, ties included (a 0/1 detector gives thousands of queries with value 1;
the earliest stories and positions win, never whatever ``torch.topk`` happens to return).

**Spread.** ``per_story`` (default None: no limit) keeps at most that many queries of any one story
per head and detector: the top ``k`` of the queries left after each story's best ``per_story``
(same order). It is mergeable too: a query in the capped top ``k`` of a union is in the capped top
``k`` of its own part, since the part's better queries are fewer story by story.
``storylens score`` and ``report`` keep :data:`PER_STORY` per story, so a head's examples come from
at least ``k / PER_STORY`` stories wherever it fires in that many.

**Lazily made.** While blocks are fed, each block's kept queries are tensors ("slots": the value,
story, query, key, weights and token ids), and the top ``k`` of the kept and the newly offered is
chosen by tensor ops in the order above (ties, ``(story, query)`` once, ``per_story`` as
:func:`_best` decides); the :class:`Example` objects are made once, when read (:meth:`~TopExamples.entries`,
:meth:`~TopExamples.state`, :meth:`~TopExamples.merge`, :meth:`~TopExamples.as_json`, pickling), not
for every block of every batch. A block's newly taken queries wait (their rows of the map read when
it is fed) and enter its slots at :meth:`~TopExamples.flush`, once per batch for every block (the
scores' accumulator flushes at the end of each batch; every read flushes first). On a CPU a block
does not even select when it is fed: it keeps the queries that beat their row's worst kept example
(few, once the kept are good ones) with their rows of the map, and the flush selects among every
block's at once (the same rules, so the same examples); a block with more than
:data:`OFFERED_BYTES` of such rows (the first batches) selects when fed.

**Values** are kept as Python floats equal to the tensor's values (half precision is widened
exactly first); a value that is not a finite number (NaN, infinity) never qualifies.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from storylens.analysis.encode import StoryBatch
from storylens.core.errors import StorylensError
from storylens.core.heads import head_label
from storylens.core.publish import write_text_atomic
from storylens.core.schema import versioned

KEY_BEFORE = 3  # key_tokens: the key's window is key - 3 .. key + 3
KEY_AFTER = 4
QUERY_AFTER = 3  # tokens: the query's window is query - context .. query + 2
WEIGHT_DECIMALS = 4  # (at most 12: rounded() needs 5^d under 2^29) weights: the query's attention over its window, rounded (enough to shade by)
PER_STORY = 2  # score and report: at most this many examples of one story per head and detector
EXAMPLE_FIELDS = (
    "story",
    "query",
    "value",
    "key",
    "key_weight",
    "tokens",
    "query_at",
    "key_tokens",
    "key_at",
    "weights",
    "key_weights",
)
_STATE_KEYS = {"k", "context", "per_story", "shape", "detectors", "examples"}


@dataclass(frozen=True)
class Example:
    """One kept query of one head for one detector. Positions count the opening marker as 0.

    ``tokens`` are the story's ids from ``max(0, query - context)`` to ``min(length, query + 3)``
    (exclusive), the query at ``tokens[query_at]``; ``key_tokens`` the ids from ``max(0, key - 3)``
    to ``min(length, key + 4)``, the key at ``key_tokens[key_at]``. ``weights[i]`` is the attention
    the query gives ``tokens[i]``, for ``i`` up to and including ``query_at`` (the keys it can see),
    rounded to :data:`WEIGHT_DECIMALS` decimals; ``key_weights[i]`` the same for ``key_tokens[i]``,
    for the key window's positions up to the query (``key_weights[key_at] == round(key_weight)``)."""

    story: int  # the story's index in source order
    query: int  # query position
    value: float  # the detector's value at this query
    key: int  # the most-attended key position (ties: the earliest)
    key_weight: float  # the attention weight on that key
    tokens: tuple[int, ...]
    query_at: int
    key_tokens: tuple[int, ...]
    key_at: int
    weights: tuple[float, ...]
    key_weights: tuple[float, ...]

    @property
    def order(self) -> tuple[float, int, int]:
        """The sort key: best first is smallest."""
        return (-self.value, self.story, self.query)

    def to_state(self) -> dict:
        return {
            "story": self.story,
            "query": self.query,
            "value": self.value,
            "key": self.key,
            "key_weight": self.key_weight,
            "tokens": list(self.tokens),
            "query_at": self.query_at,
            "key_tokens": list(self.key_tokens),
            "key_at": self.key_at,
            "weights": list(self.weights),
            "key_weights": list(self.key_weights),
        }


def _best(examples, k: int, per_story: int | None = None) -> list:
    """The top ``k`` of ``examples`` under the order, each ``(story, query)`` once (its best), at
    most ``per_story`` of one story (None: any number)."""
    out: list[Example] = []
    seen: set[tuple[int, int]] = set()
    taken: dict[int, int] = {}
    for e in sorted(examples, key=lambda e: e.order):
        if (e.story, e.query) in seen or (per_story is not None and taken.get(e.story, 0) >= per_story):
            continue
        seen.add((e.story, e.query))
        taken[e.story] = taken.get(e.story, 0) + 1
        out.append(e)
        if len(out) == k:
            break
    return out


# ---------------------------------------------------------------- examples as tensors while feeding
#
# While blocks are fed, a block's kept examples are slots, two tensors per block, rows r = d * H + h
# (detector d, head h), k slots per row, best first (an empty slot: value -inf, after the others):
#   floats [R, k, 2 + (context + 1) + KEY_WIDTH], float64: the value, the most-attended key's weight,
#       the query's weights on keys max(0, query - context) .. and on keys max(0, key - 3) .. (the
#       widths every example could need; an Example keeps those up to the query);
#   ints [R, k, 4 + TOKEN_WIDTH(context) + KEY_WIDTH], long: story, query, key, raw (1: the weights
#       are a float64 map's, rounded by Python's round when the Example is made), then the token ids
#       at query - context .. query + 2 and at key - 3 .. key + 3, -1 outside the story.
# The top k is selected among slots by tensor ops in the order :func:`_best` sorts by; the Examples
# are made once, when they are read (TopExamples._settle).

KEY_WIDTH = KEY_BEFORE + KEY_AFTER  # the key's window: key - 3 .. key + 3
_NARROW = (torch.float32, torch.float16, torch.bfloat16)  # weights rounded in tensor ops (see rounded())
_SPLIT = 2**32  # story * _SPLIT + query: one integer in (story, query) order (a query is below 2^32)
ROWS_FIRST = True  # on a CPU, select only in the rows where some query can enter (TopExamples.add_stacked)
# on a CPU, a block whose queries that can enter have map rows of at most this many bytes in all keeps those
# rows and selects at the flush, with every other such block (TopExamples.add_stacked); more: selected at once
OFFERED_BYTES = 2 * 2**20


@dataclass(frozen=True)
class _BatchView:
    batch: StoryBatch
    Q: int  # query rows
    start: int  # the first of them
    device: torch.device
    perm: torch.Tensor | None  # the rows in story order (None: already)
    inside: torch.Tensor  # [B, Q] real positions, rows in story order
    story_of: torch.Tensor  # [1, B * Q] story index of each flat position (story order)
    query_of: torch.Tensor  # [1, B * Q] query position of each flat position
    order_of: torch.Tensor  # [B, Q] story * _SPLIT + query position of each row and query (batch order)
    flat_order: torch.Tensor  # [1, B * Q] story * _SPLIT + query position of each flat position (story order)


@dataclass(frozen=True)
class _Taken:
    """One block's queries taken into its top ``k`` rows (:meth:`TopExamples.add_stacked`), waiting for
    :meth:`TopExamples.flush`: the slots' rows ``rows [R]``, which of the ``c`` places per row are real
    ``[R, c]`` and their flat indices ``at [N]``, and per taken query its row of the map ``[N, K]`` (read
    when the block was fed), value (float64), flat index in story order, row in the chunk and in the batch."""

    READ: ClassVar[tuple[str, ...]] = ("rowmaps", "value", "flat", "qi", "bi")  # what TopExamples._windows reads

    layer: int
    rows: torch.Tensor
    real: torch.Tensor
    at: torch.Tensor
    view: _BatchView
    rowmaps: torch.Tensor
    value: torch.Tensor
    flat: torch.Tensor
    qi: torch.Tensor
    bi: torch.Tensor

    @property
    def c(self) -> int:
        """Places per row: ``min(k, B * Q)``."""
        return self.real.shape[1]

    def alike(self, other: _Taken) -> bool:
        """Taken from the same batch's same rows, the same slot count, keys and dtype: selected together."""
        a, b = self.rowmaps, other.rowmaps
        return self.view is other.view and self.c == other.c and a.shape[-1] == b.shape[-1] and a.dtype == b.dtype


@dataclass(frozen=True)
class _Offered:
    """One block's queries that can enter its top ``k`` rows (:meth:`TopExamples.add_stacked`), waiting
    for :meth:`TopExamples.flush` to select among them with every other block's: ``at [n]`` their flat
    indices in the block's values ``[B, H, D, Q]`` (detector ``det[d]``), ``value [n]`` and each one's
    row of the map ``rowmaps [n, K]``, read when the block was fed."""

    layer: int
    names: tuple[str, ...]
    det: torch.Tensor
    view: _BatchView
    at: torch.Tensor
    value: torch.Tensor
    rowmaps: torch.Tensor

    def alike(self, other: _Offered) -> bool:
        """The same batch view, detectors, key count and dtypes: selected among together."""
        a, b = self.rowmaps, other.rowmaps
        same = a.shape[-1] == b.shape[-1] and a.dtype == b.dtype and self.value.dtype == other.value.dtype
        return self.view is other.view and self.names == other.names and same


def _alike_groups(items: Sequence) -> list[list]:
    """``items`` (each with ``alike(other)``) in groups of alike ones, in the order they first came."""
    groups: list[list] = []
    for item in items:
        group = next((g for g in groups if g[0].alike(item)), None)
        if group is None:
            groups.append([item])
        else:
            group.append(item)
    return groups


def _ranks(key: torch.Tensor) -> torch.Tensor:
    """Each entry's place among the entries of its run of equal ``key`` (sorted ``[n]``), from 0."""
    return torch.arange(key.numel(), device=key.device) - torch.searchsorted(key, key)


def _sorted_by(*keys: torch.Tensor) -> torch.Tensor:
    """The permutation sorting ``[n]`` entries by ``keys[0]``, then ``keys[1]``, ...: stable sorts, the
    last key first."""
    order = keys[-1].argsort(stable=True)
    for key in reversed(keys[:-1]):
        order = order.gather(0, key.gather(0, order).argsort(stable=True))
    return order


def _at_most(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each float64 as the largest ``dtype`` value not above it (exact when it is one): a worst
    value kept from a float64 run still admits every query that beats it."""
    near = exact.to(dtype)
    return torch.where(near.to(torch.float64) > exact, torch.nextafter(near, torch.full_like(near, -math.inf)), near)


def _worst(
    floats: torch.Tensor, ints: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The worst kept example of each of the slots' ``rows [r]``: its value as ``dtype`` (:func:`_at_most`;
    -inf: room left) and its ``story * _SPLIT + query`` (negative for an empty slot: no query is before it)."""
    last = ints[rows, -1]
    return _at_most(floats[rows, -1, 0], dtype), last[:, 0] * _SPLIT + last[:, 1]


def _near(rowmaps: torch.Tensor, around: torch.Tensor, before: int, width: int) -> torch.Tensor:
    """``[N, width]``: each row's attention on the ``width`` keys from ``max(0, around - before)`` on
    (``rowmaps [N, key]``, ``around [N]``: the query, or its most-attended key), the last key
    repeated past the map's end (never kept: an Example keeps the keys up to its query)."""
    start = (around - before).clamp(min=0)
    keys = (start[:, None] + torch.arange(width, device=rowmaps.device)).clamp(max=rowmaps.shape[-1] - 1)
    return rowmaps.gather(-1, keys)


def _rounded_now(weights: torch.Tensor) -> torch.Tensor:
    """float64 weights that :func:`rounded` would give, bit for bit, for float32 or narrower weights;
    others widened as they are (rounded by Python when their Example is made)."""
    wide = weights.to(torch.float64)
    if weights.dtype in _NARROW:
        scale = 10.0**WEIGHT_DECIMALS
        return torch.round(wide * scale) / scale
    return wide


def rounded(weights: torch.Tensor) -> list[list[float]]:
    """``[[round(w, WEIGHT_DECIMALS) for w in row] for row in weights.tolist()]``, bit for bit, in tensor
    ops where the weights are float32 or narrower: such a weight times 10^4 (a 24-bit significand times
    625 * 2^4, 34 bits) is exact in float64, ``torch.round`` then rounds it half to even as Python's
    ``round`` rounds the exact value, and the division is IEEE-rounded to the double nearest to the
    decimal result, which is what ``round`` returns. Wider weights take Python's ``round``."""
    if weights.dtype in _NARROW:
        return _rounded_now(weights).tolist()
    return [[round(float(w), WEIGHT_DECIMALS) for w in row] for row in weights.tolist()]


def _per_story(eligible: torch.Tensor, v: torch.Tensor, B: int, per_story: int) -> torch.Tensor:
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


def _first_k(eligible: torch.Tensor, v: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the first ``k`` of the eligible queries under the order: every value above the k-th
    largest, then as many of the values equal to it as fit, earliest (story, query) first."""
    masked = torch.where(eligible, v, torch.tensor(-math.inf, dtype=v.dtype, device=v.device))
    kth = masked.topk(min(k, v.shape[1]), dim=-1).values[:, -1:]  # [R, 1]; -inf: fewer than k eligible
    above = eligible & (v > kth)
    tied = eligible & (v == kth)
    room = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def _taken(take: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _select(
    floats: torch.Tensor, ints: torch.Tensor, k: int, per_story: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top ``k`` slots of ``floats [R, M, F]`` / ``ints [R, M, I]`` (M >= k) as :func:`_best`
    picks them among the Examples they stand for: sorted by value descending, story, query, then
    slot (stable: what was kept before what is offered); a ``(story, query)`` seen before skipped;
    a story's slots past ``per_story`` skipped; the first ``k`` left, best first, then empty slots."""
    R, M, F = floats.shape
    dev = floats.device
    value, sq = floats[..., 0], ints[..., 0] * _SPLIT + ints[..., 1]  # [R, M]
    real = value.isfinite()
    by = sq.argsort(dim=-1, stable=True)
    down = torch.where(real, -value, math.inf).gather(-1, by).argsort(dim=-1, stable=True)
    order = by.gather(-1, down)  # [R, M]: the slots best first
    sq, real, story = sq.gather(-1, order), real.gather(-1, order), ints[..., 0].gather(-1, order)
    before = torch.ones(M, M, dtype=torch.bool, device=dev).tril(-1)  # [i, j]: j sorts before i
    twice = ((sq[:, :, None] == sq[:, None, :]) & real[:, None, :] & before).any(-1)  # [R, M]
    keep = real & ~twice
    if per_story is not None:  # how many of its story sort before it (those skipped change nothing)
        ahead = ((story[:, :, None] == story[:, None, :]) & keep[:, None, :] & before).sum(-1)
        keep &= ahead < per_story
    keep &= keep.cumsum(-1) <= k
    at = torch.where(keep, torch.arange(M, device=dev), M).sort(-1).values[:, :k]  # [R, k]; M: empty
    slot = order.gather(-1, at.clamp(max=M - 1))
    out_f = floats.gather(1, slot[..., None].expand(R, k, F))
    out_i = ints.gather(1, slot[..., None].expand(R, k, ints.shape[-1]))
    out_f[..., 0] = torch.where(at < M, out_f[..., 0], -math.inf)
    return out_f, out_i


def _key_seen(query: int, key: int, key_at: int, key_tokens: Sequence[int]) -> int:
    """How many of the key window's tokens the query sees: those up to the query itself."""
    return min(len(key_tokens), query - (key - key_at) + 1)


class TopExamples:
    """For every head (layer, head) and every detector name, the k queries with the highest
    per-query value over everything added: story index (source order), query position, the value,
    the most-attended key position, token ids around the query and around that key, and the
    query's rounded attention over its window.

    Feed it with :meth:`add` (one call per block and detector), combine with :meth:`merge`,
    checkpoint with :meth:`state` / :meth:`load_state`, read with :meth:`entries`, write with
    :meth:`to_json`. See the module docstring for the order."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        detectors: Sequence[str],
        k: int = 8,
        context: int = 8,
        per_story: int | None = None,
    ):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise StorylensError(f"examples: k must be a whole number of at least 1, got {k!r}")
        if per_story is not None and (isinstance(per_story, bool) or not isinstance(per_story, int) or per_story < 1):
            raise StorylensError(f"examples: per_story must be a whole number of at least 1 or None, got {per_story!r}")
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise StorylensError(f"examples: context must be a whole number of at least 0, got {context!r}")
        if n_layer < 1 or n_head < 1:
            raise StorylensError(f"examples: need at least one head, got {n_layer} layers of {n_head} heads")
        names = [str(d) for d in detectors]
        if len(set(names)) != len(names):
            raise StorylensError(f"examples: detector names must differ ({', '.join(names)})")
        self.n_layer, self.n_head, self.k, self.context, self.per_story = n_layer, n_head, k, context, per_story
        self.detectors = tuple(names)
        self._kept: dict[str, list[list[list[Example]]]] = {name: self._empty() for name in self.detectors}
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per block fed: its examples as tensors
        self._stale: set[int] = set()  # the blocks whose _kept lists are behind their slots
        self._view: _BatchView | None = None  # the current batch's story order
        self._pending: list[_Taken] = []  # queries taken from blocks fed since the last flush(), not yet selected
        self._offered: list[_Offered] = []  # queries that can enter, of blocks fed since then (_offer)

    def __getstate__(self) -> dict:  # pickled or copied: the examples, not tensors of the last batch
        self._settle()
        return {**self.__dict__, "_view": None, "_slots": {}, "_stale": set(), "_pending": [], "_offered": []}

    def _empty(self) -> list[list[list[Example]]]:
        return [[[] for _ in range(self.n_head)] for _ in range(self.n_layer)]

    # ---------------------------------------------------------------- feeding

    def _batch_view(self, batch: StoryBatch, Q: int, device: torch.device, start: int = 0) -> _BatchView:
        """What every call on ``batch`` (its query rows ``start .. start + Q - 1``) shares, made once
        per batch and chunk of rows (the last one is kept)."""
        last = self._view
        if last is not None and last.batch is batch and (last.Q, last.start) == (Q, start) and last.device == device:
            return last
        stories = getattr(batch, "stories", ())
        B = batch.ids.shape[0]
        if len(stories) != B:
            raise ValueError(
                f"examples: the batch names {len(stories)} stories for {B} rows; "
                "make it with storylens.analysis.encode.batch_of (the story indices are needed)"
            )
        story_index = [int(s.index) for s in stories]
        lengths = [int(n) for n in batch.lengths.tolist()]
        order = sorted(range(B), key=lambda b: story_index[b])
        perm = None if order == list(range(B)) else torch.tensor(order, dtype=torch.long, device=device)
        s_sorted = torch.tensor([story_index[b] for b in order], dtype=torch.long, device=device)
        n_sorted = torch.tensor([lengths[b] for b in order], dtype=torch.long, device=device)
        pos = torch.arange(start, start + Q, device=device)
        inside = pos[None, :] < n_sorted[:, None]  # [B, Q]: never a padding query
        story_of = s_sorted[:, None].expand(B, Q).reshape(1, B * Q)
        query_of = pos[None, :].expand(B, Q).reshape(1, B * Q)
        index = torch.tensor(story_index, dtype=torch.long, device=device)
        order_of = index[:, None] * _SPLIT + pos[None, :]
        flat_order = story_of * _SPLIT + query_of
        self._view = _BatchView(batch, Q, start, device, perm, inside, story_of, query_of, order_of, flat_order)
        return self._view

    def add(
        self,
        layer: int,
        name: str,
        values: torch.Tensor,
        counted: torch.Tensor,
        pattern: torch.Tensor,
        batch: StoryBatch,
    ) -> None:
        """Offer one block's per-query values of detector ``name``: ``values [B, H, Q]``, ``counted
        [B, Q]`` (only counted queries qualify), ``pattern [B, H, Q, K]`` (for the most-attended
        key), ``batch`` a :class:`~storylens.analysis.encode.StoryBatch` with its ``stories``."""
        self.add_block(layer, [(name, values, counted)], pattern, batch)

    def add_block(
        self,
        layer: int,
        offers: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
        pattern: torch.Tensor,
        batch: StoryBatch,
        start: int = 0,
    ) -> None:
        """:meth:`add` for several detectors of one block at once, ``offers = [(name, values, counted),
        ...]``: one selection over every (detector, head) row, so a block costs a few tensor calls
        whatever the number of detectors, and no Python object per example (they are made when
        read). ``start``: the values, counts and pattern hold query rows ``start ..`` of the block (a
        chunk of a map), not all of them; chunks may come in any order."""
        if not offers:
            return
        B, H, Q = self._check_offers(layer, offers, pattern)
        if B == 0 or Q == 0:
            return
        values = torch.stack([values.detach() for _, values, _ in offers], 2)  # [B, H, D, Q]
        counted = torch.stack([c.detach().to(device=values.device, dtype=torch.bool) for _, _, c in offers], 1)
        self.add_stacked(layer, [name for name, _, _ in offers], values, counted, pattern, batch, start)

    def add_stacked(
        self,
        layer: int,
        names: Sequence[str],
        values: torch.Tensor,
        counted: torch.Tensor,
        pattern: torch.Tensor,
        batch: StoryBatch,
        start: int = 0,
    ) -> None:
        """:meth:`add_block` with the detectors' values stacked, ``values [B, H, D, Q]`` and ``counted
        [B, D, Q]`` bool (detector ``names[d]`` at ``d``; shapes as :meth:`add_block` checks them).

        Most rows (detector, head) of a block take nothing once the kept examples are good ones: a
        query enters only if its value reaches the row's worst kept. So on a CPU one pass over the values
        finds the queries that reach it: they and their rows of the map are kept for :meth:`flush` to
        select among, with every other block's (:meth:`_offer`), or, where their rows are many, the rows
        they are in are selected among now (elsewhere every row, with no sync): the same examples as
        selecting in every row."""
        B, H, D, Q = values.shape
        if B == 0 or Q == 0:
            return
        if any(t.layer == layer for t in self._pending) or any(o.layer == layer for o in self._offered):
            self.flush()  # a block's second chunk: its first selected before
        if not values.is_floating_point() or values.dtype in (torch.float16, torch.bfloat16):
            values = values.to(torch.float32)  # exact: every half value is a float32
        view = self._batch_view(batch, Q, values.device, start)
        dev = view.device
        floats, ints = self._block_slots(layer, dev)
        det = torch.tensor([self.detectors.index(name) for name in names], dtype=torch.long, device=dev)
        if (
            dev.type == "cpu" and ROWS_FIRST
        ):  # the rows where some counted query beats the worst kept one (as _eligible)
            offered = (det[:, None] * H + torch.arange(H, device=dev)).reshape(-1)  # [D * H] rows, detector-major
            worst, later = (x.view(D, H).t() for x in _worst(floats, ints, offered, values.dtype))  # [H, D] each
            w, lt = worst[None, :, :, None], later[None, :, :, None]  # [1, H, D, 1]
            beats = (values > w) | ((values == w) & (view.order_of[:, None, None, :] < lt))
            beats &= counted[:, None]
            if self._offer(layer, names, det, beats, values, pattern, view):
                return
            hit = beats.view(torch.uint8).amax(-1).amax(0) > 0  # [H, D]: any (a max of bytes: several times faster)
            if not bool(hit.any()):
                return
            heads, at = hit.nonzero(as_tuple=True)  # [r] each: the row's head and offered detector
            rows = det[at] * H + heads  # [r]: the rows selected among
            kept = worst[heads, at], later[heads, at]
        else:
            heads = torch.arange(H, device=dev).repeat(D)
            at = torch.arange(D, device=dev).repeat_interleave(H)
            rows = det[at] * H + heads
            kept = _worst(floats, ints, rows, values.dtype)
        v, eligible = self._eligible(values, counted, heads, at, *kept, view)
        # at most per_story of each of the B stories is already at most k: nothing more to cut
        capped = self.per_story is not None and self.per_story * B <= self.k
        take = eligible if capped else _first_k(eligible, v, self.k)
        if dev.type == "cpu" and not bool(take.any()):  # nothing enters (skipped where it would sync)
            return
        self._pending.append(self._taken_rows(layer, rows, take, v, pattern, view, heads))

    def _offer(
        self,
        layer: int,
        names: Sequence[str],
        det: torch.Tensor,
        beats: torch.Tensor,
        values: torch.Tensor,
        pattern: torch.Tensor,
        view: _BatchView,
    ) -> bool:
        """Keep the queries that can enter (``beats [B, H, D, Q]``: counted and beating their row's worst
        kept) with their rows of ``pattern``, for :meth:`flush` to select among with every other block's;
        False (nothing kept) where their rows would take more than :data:`OFFERED_BYTES`."""
        B, H, D, Q = beats.shape
        K = pattern.shape[-1]
        at = beats.reshape(-1).nonzero()[:, 0]  # [n]
        n = at.numel()
        if n == 0:
            return True
        if n * K * pattern.element_size() > OFFERED_BYTES:
            return False
        if pattern.is_contiguous():  # (one index_select of flat rows: several times faster than indexing)
            rowmaps = pattern.detach().view(B * H * Q, K).index_select(0, at // (D * Q) * Q + at % Q)
        else:
            rowmaps = pattern.detach()[at // (H * D * Q), at // (D * Q) % H, at % Q]
        value = values.reshape(-1)[at]
        self._offered.append(_Offered(layer, tuple(names), det, view, at, value, rowmaps))
        return True

    def _take_offered(self, group: list[_Offered]) -> list[_Taken]:
        """The queries each block of ``group`` takes into its top ``k`` rows, of those it offered
        (:meth:`_offer`), selected for every block at once: as :meth:`_eligible`, :func:`_per_story`,
        :func:`_first_k` and :func:`_taken` select among a block's values (the same queries)."""
        view, det = group[0].view, group[0].det
        B, Q = view.inside.shape
        H, D, rows_per_block = self.n_head, det.numel(), len(self.detectors) * self.n_head
        at = torch.cat([o.at for o in group])
        layer = torch.repeat_interleave(
            torch.tensor([o.layer for o in group]), torch.tensor([o.at.numel() for o in group])
        )
        v = torch.cat([o.value for o in group])
        bi, h, d, q = at // (H * D * Q), at // (D * Q) % H, at // Q % D, at % Q
        bs = bi if view.perm is None else torch.empty_like(view.perm).index_put_((view.perm,), torch.arange(B))[bi]
        flat = bs * Q + q  # in story order, so in (story, query) order
        g = layer * rows_per_block + det[d] * H + h  # the row among every block's
        chosen = (v.isfinite() & view.inside.view(-1)[flat]).nonzero()[:, 0]  # eligible (they beat the worst kept)
        if self.per_story is not None:  # each row's best per_story of each story: by value, then query
            gb = g[chosen] * B + bs[chosen]
            order = _sorted_by(gb, -v[chosen], q[chosen])
            chosen = chosen[order][_ranks(gb[order]) < self.per_story]
        if self.per_story is None or self.per_story * B > self.k:  # each row's first k (else already at most k)
            order = _sorted_by(g[chosen], -v[chosen], flat[chosen])
            chosen = chosen[order][_ranks(g[chosen][order]) < self.k]
        chosen = chosen[(g[chosen] * (B * Q) + flat[chosen]).argsort()]  # by row, then (story, query)
        if chosen.numel() == 0:
            return []
        g, flat = g[chosen], flat[chosen]
        rows, row_of = torch.unique_consecutive(g, return_inverse=True)  # [U] rows, [N] each query's
        c = min(self.k, B * Q)
        place = _ranks(g)  # [N]: its place in its row
        real = torch.zeros(rows.numel(), c, dtype=torch.bool)
        real[row_of, place] = True
        first_row = torch.searchsorted(rows, torch.arange(self.n_layer + 1) * rows_per_block).tolist()
        first = torch.searchsorted(g, torch.arange(self.n_layer + 1) * rows_per_block).tolist()
        rowmaps = torch.cat([o.rowmaps for o in group])[chosen]
        value, qi, bi = v[chosen].to(torch.float64), q[chosen], bi[chosen]
        taken = []
        for lay in range(self.n_layer):
            a, b, ra, rb = first[lay], first[lay + 1], first_row[lay], first_row[lay + 1]
            if a == b:
                continue
            here = slice(a, b)
            spot = (row_of[here] - ra) * c + place[here]
            local = rows[ra:rb] - lay * rows_per_block
            taken.append(
                _Taken(lay, local, real[ra:rb], spot, view, rowmaps[here], value[here], flat[here], qi[here], bi[here])
            )
        return taken

    def flush(self) -> None:
        """Select the queries taken from the blocks fed since the last flush into their blocks' slots:
        each block's taken queries were read off its map when it was fed (the rows of the map they
        need), and the slots and top ``k`` of every such block are made here in one pass for all of
        them, not block by block (the same slots: a block's rows are its own; a block fed twice before
        a flush is flushed at its second chunk, so its worst kept is always up to date). The queries
        blocks offered (:meth:`_offer`) are selected among first, for every block at once."""
        offered, self._offered = self._offered, []
        for same in _alike_groups(offered):  # offered from the same chunk of rows of the same batch
            self._pending += self._take_offered(same)
        pending, self._pending = self._pending, []
        for group in _alike_groups(pending):  # taken from the same chunk of rows of the same batch
            self._select_taken(group)

    def _select_taken(self, group: list[_Taken]) -> None:
        """:meth:`flush` for blocks whose taken queries share a batch view, key count and slot count."""
        view, c, dev = group[0].view, group[0].c, group[0].rows.device
        offsets = [0]
        for t in group:
            offsets.append(offsets[-1] + t.rows.shape[0])
        at = torch.cat([t.at + offsets[i] * c for i, t in enumerate(group)])  # [N]: flat slots of every block
        rowmaps, value, flat, qi, bi = (torch.cat([getattr(t, f) for t in group]) for f in _Taken.READ)
        got_f, got_i = self._windows(rowmaps, value, flat, qi, bi, view)
        R = offsets[-1]
        floats = torch.full((R * c, got_f.shape[-1]), -math.inf, dtype=torch.float64, device=dev)
        ints = torch.full((R * c, got_i.shape[-1]), -1, dtype=torch.long, device=dev)
        floats[at], ints[at] = got_f, got_i
        floats[:, 0].masked_fill_(~torch.cat([t.real.reshape(-1) for t in group]), -math.inf)  # padding: empty
        slots = [self._block_slots(t.layer, dev) for t in group]
        row_f = torch.cat([f[t.rows] for t, (f, _) in zip(group, slots)])
        row_i = torch.cat([i[t.rows] for t, (_, i) in zip(group, slots)])
        kept_f, kept_i = _select(
            torch.cat([row_f, floats.view(R, c, -1)], 1), torch.cat([row_i, ints.view(R, c, -1)], 1),
            self.k, self.per_story,
        )  # fmt: skip
        for t, (f, i), a, b in zip(group, slots, offsets, offsets[1:]):
            # new tensors, not written in place: slots made inside a recording's inference mode are fed outside it
            self._slots[t.layer] = f.index_copy(0, t.rows, kept_f[a:b]), i.index_copy(0, t.rows, kept_i[a:b])
            self._stale.add(t.layer)

    def _check_offers(
        self, layer: int, offers: Sequence[tuple[str, torch.Tensor, torch.Tensor]], pattern: torch.Tensor
    ) -> tuple[int, int, int]:
        """``(B, H, Q)`` of the offers, every shape checked against them and this instance."""
        if not 0 <= layer < self.n_layer:
            raise ValueError(f"examples: no layer {layer} (0 .. {self.n_layer - 1})")
        first = offers[0][1]
        if first.dim() != 3 or first.shape[1] != self.n_head:
            raise ValueError(f"examples: values of shape {tuple(first.shape)}; expected [batch, {self.n_head}, query]")
        B, H, Q = first.shape
        for name, values, counted in offers:
            if name not in self._kept:
                raise ValueError(f"examples: no detector {name!r} (this one keeps {', '.join(self.detectors)})")
            if tuple(values.shape) != (B, H, Q):
                raise ValueError(f"examples: values of shape {tuple(values.shape)}; expected {(B, H, Q)}")
            if tuple(counted.shape) != (B, Q):
                raise ValueError(f"examples: counted of shape {tuple(counted.shape)}; expected {(B, Q)}")
        if len({name for name, _, _ in offers}) != len(offers):
            raise ValueError(f"examples: a detector offered twice ({', '.join(name for name, _, _ in offers)})")
        if pattern.dim() != 4 or tuple(pattern.shape[:3]) != (B, H, Q):
            raise ValueError(f"examples: pattern of shape {tuple(pattern.shape)}; expected [{B}, {H}, {Q}, key]")
        return B, H, Q

    def _eligible(
        self,
        values: torch.Tensor,
        counted: torch.Tensor,
        heads: torch.Tensor,
        at: torch.Tensor,
        worst: torch.Tensor,
        later: torch.Tensor,
        view: _BatchView,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected rows' values ``[r, B * Q]`` (row ``i``: head ``heads[i]`` of offered detector
        ``at[i]``, of ``values [B, H, D, Q]``; stories in story order, so a flat index ``b * Q + q``
        runs in (story, query) order) and which of them may enter its top ``k``: a row that keeps k
        examples takes only queries that beat its worst one (``worst``, ``later``: :func:`_worst` of
        the rows; an empty slot: any)."""
        B, H, D, Q = values.shape
        r = heads.shape[0]
        v = values[:, heads, at].transpose(0, 1)  # [r, B, Q]
        c = counted[:, at].transpose(0, 1)  # [r, B, Q]
        if view.perm is not None:
            v, c = v.index_select(1, view.perm), c.index_select(1, view.perm)
        v = v.reshape(r, B * Q)
        c = (c & view.inside).reshape(r, B * Q)
        wv = worst[:, None]
        earlier = view.flat_order < later[:, None]  # [r, B * Q]: before the worst kept in (story, query) order
        eligible = c & v.isfinite() & ((v > wv) | ((v == wv) & earlier))
        if self.per_story is not None and self.per_story < Q:
            eligible = _per_story(eligible, v, B, self.per_story)
        return v, eligible

    def _taken_rows(
        self,
        layer: int,
        rows: torch.Tensor,
        take: torch.Tensor,
        v: torch.Tensor,
        pattern: torch.Tensor,
        view: _BatchView,
        heads: torch.Tensor,
    ) -> _Taken:
        """The taken queries of block ``layer`` (``take [R, B * Q]``, at most k a row; ``rows [R]`` the
        slots' rows, ``heads [R]`` each row's head) with what their slots need of the map, read now:
        each query's row of ``pattern [B, H, Q, K]`` (its most-attended key and the weights around)."""
        fi, real = _taken(take, self.k)  # [R, c]
        R, c = fi.shape
        dev = fi.device
        B, H, Q, K = pattern.shape
        # on the CPU only the taken queries' rows are read; elsewhere every slot's (no sync)
        at = real.reshape(-1).nonzero()[:, 0] if dev.type == "cpu" else torch.arange(R * c, device=dev)  # [N]
        row, flat = at // c, fi.reshape(-1)[at]
        hi = heads[row]
        bs, qi = flat // Q, flat % Q  # bs: the row in story order; qi: the row in the chunk
        bi = view.perm[bs] if view.perm is not None else bs  # the row in the batch
        if pattern.is_contiguous():
            rowmaps = pattern.detach().view(B * H * Q, K).index_select(0, ((bi * H + hi) * Q + qi).to(pattern.device))
        else:
            rowmaps = pattern.detach()[bi, hi, qi]
        value = v[row, flat].to(torch.float64)
        return _Taken(layer, rows, real, at, view, rowmaps.to(dev), value, flat, qi, bi)

    def _windows(
        self,
        rowmaps: torch.Tensor,
        value: torch.Tensor,
        flat: torch.Tensor,
        qi: torch.Tensor,
        bi: torch.Tensor,
        view: _BatchView,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's floats ``[N, F]`` and ints ``[N, I]`` for each query taken (its row of the map
        ``rowmaps [N, K]``, its value, flat index ``b * Q + q`` in story order, row in the chunk and
        row in the batch): the value, the most-attended key (the earliest key holding the row's
        maximum), its weight, the weights and token ids around the query and around that key."""
        dev, K = rowmaps.device, rowmaps.shape[-1]
        keys = torch.arange(K, device=dev)
        key = torch.where(rowmaps == rowmaps.amax(-1, keepdim=True), keys, K).amin(-1).clamp(max=K - 1)  # [N]
        query = qi + view.start  # the query's position
        near = torch.cat(
            [_near(rowmaps, query, self.context, self.context + 1), _near(rowmaps, key, KEY_BEFORE, KEY_WIDTH)], -1
        )
        floats = torch.cat([value[:, None], rowmaps.gather(-1, key[:, None]).to(torch.float64), _rounded_now(near)], -1)
        ids, T = view.batch.ids.to(dev), view.batch.ids.shape[1]
        length = view.batch.lengths.to(dev)[bi][:, None]  # [N, 1]

        def ids_at(first: torch.Tensor, width: int) -> torch.Tensor:  # [N, width]: -1 outside the story
            pos = first[:, None] + torch.arange(width, device=dev)
            return torch.where((pos >= 0) & (pos < length), ids[bi[:, None], pos.clamp(0, T - 1)], -1)

        raw = torch.full_like(key, int(rowmaps.dtype not in _NARROW))
        heads = torch.stack([view.story_of[0, flat], query, key, raw], -1)  # [N, 4]
        tokens = [ids_at(query - self.context, self.context + QUERY_AFTER), ids_at(key - KEY_BEFORE, KEY_WIDTH)]
        return floats, torch.cat([heads, *tokens], -1)

    # ---------------------------------------------------------------- slots and Examples

    def _widths(self) -> tuple[int, int]:
        """The floats' and ints' widths of a slot."""
        return 2 + self.context + 1 + KEY_WIDTH, 4 + self.context + QUERY_AFTER + KEY_WIDTH

    def _block_slots(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``layer``'s slots on ``device``, made from its Examples where it has none yet (a
        fresh instance, or after :meth:`load_state` or :meth:`merge`)."""
        if layer in self._slots:
            floats, ints = self._slots[layer]
            if floats.device != device:
                self._slots[layer] = floats, ints = floats.to(device), ints.to(device)
            return floats, ints
        n_float, n_int = self._widths()
        R, k = len(self.detectors) * self.n_head, self.k
        floats = torch.zeros(R, k, n_float, dtype=torch.float64)  # empty slots (no Python list per slot)
        floats[..., 0] = -math.inf
        ints = torch.full((R, k, n_int), -1, dtype=torch.long)
        for d, name in enumerate(self.detectors):
            for h, row in enumerate(self._kept[name][layer]):
                if row:
                    fl, il = zip(*(self._slot_of(e) for e in row))
                    floats[d * self.n_head + h, : len(row)] = torch.tensor(fl, dtype=torch.float64)
                    ints[d * self.n_head + h, : len(row)] = torch.tensor(il, dtype=torch.long)
        self._slots[layer] = floats.to(device), ints.to(device)
        return self._slots[layer]

    def _slot_of(self, e: Example) -> tuple[list[float], list[int]]:
        """One Example as a slot's floats and ints (its weights already rounded: raw 0)."""
        floats = [e.value, e.key_weight, *e.weights, *[0.0] * (self.context + 1 - len(e.weights)), *e.key_weights]
        tokens = [-1] * (self.context - e.query_at) + list(e.tokens)
        key_tokens = [-1] * (KEY_BEFORE - e.key_at) + list(e.key_tokens)
        tokens += [-1] * (self.context + QUERY_AFTER - len(tokens))
        ints = [e.story, e.query, e.key, 0, *tokens, *key_tokens, *[-1] * (KEY_WIDTH - len(key_tokens))]
        return floats + [0.0] * (self._widths()[0] - len(floats)), ints

    def _settle(self) -> None:
        """Make the Examples of every block fed since they were last made: one copy of its slots."""
        self.flush()
        C = self.context
        for layer in sorted(self._stale):
            floats, ints = self._slots[layer]
            count = floats[..., 0].isfinite().sum(-1).tolist()  # per row: its slots in use come first
            fl, il = floats.cpu().tolist(), ints.cpu().tolist()
            for r, n in enumerate(count):
                row = []
                for f, i in zip(fl[r][:n], il[r][:n]):
                    story, query, key, raw = i[:4]
                    query_at, key_at = query - max(0, query - C), key - max(0, key - KEY_BEFORE)
                    tokens = tuple(t for t in i[4 : 4 + C + QUERY_AFTER] if t >= 0)
                    key_tokens = tuple(t for t in i[4 + C + QUERY_AFTER :] if t >= 0)
                    weights, key_weights = (
                        f[2 : 3 + C][: query_at + 1],
                        f[3 + C :][: _key_seen(query, key, key_at, key_tokens)],
                    )
                    if raw:
                        weights = [round(w, WEIGHT_DECIMALS) for w in weights]
                        key_weights = [round(w, WEIGHT_DECIMALS) for w in key_weights]
                    row.append(
                        Example(
                            story,
                            query,
                            f[0],
                            key,
                            f[1],
                            tokens,
                            query_at,
                            key_tokens,
                            key_at,
                            tuple(weights),
                            tuple(key_weights),
                        )
                    )
                self._kept[self.detectors[r // self.n_head]][layer][r % self.n_head] = row
        self._stale.clear()

    # ---------------------------------------------------------------- combining and checkpoints

    def _same_kind(self, other: TopExamples, what: str) -> None:
        mine = (self.n_layer, self.n_head, self.detectors, self.k, self.context, self.per_story)
        theirs = (other.n_layer, other.n_head, other.detectors, other.k, other.context, other.per_story)
        if mine != theirs:
            raise ValueError(
                f"{what}: other heads, detectors, k, context or per_story ({theirs[0]}x{theirs[1]} heads, "
                f"{', '.join(theirs[2])}, k={theirs[3]}, context={theirs[4]}, per_story={theirs[5]}) than this "
                f"one's ({mine[0]}x{mine[1]} heads, {', '.join(mine[2])}, k={mine[3]}, context={mine[4]}, "
                f"per_story={mine[5]})"
            )

    def merge(self, other: TopExamples) -> TopExamples:
        """Keep the top k of the union of both (``other`` is left as it is); returns ``self``."""
        self._same_kind(other, "merge")
        self._settle()
        other._settle()
        self._slots = {}  # the lists change: slots are made again from them when fed
        for name in self.detectors:
            for mine, theirs in zip(self._kept[name], other._kept[name]):
                for h in range(self.n_head):
                    if theirs[h]:
                        mine[h] = _best(mine[h] + theirs[h], self.k, self.per_story)
        return self

    def state(self) -> dict:
        """Everything kept, as plain data (ints, floats, strings, lists, dicts): a checkpoint, or
        what a worker sends to be merged. ``examples[detector][layer][head]`` lists the examples
        best first."""
        self._settle()
        return {
            "k": self.k,
            "context": self.context,
            "per_story": self.per_story,
            "shape": [self.n_layer, self.n_head],
            "detectors": list(self.detectors),
            "examples": {
                name: [[[e.to_state() for e in head] for head in layer] for layer in self._kept[name]]
                for name in self.detectors
            },
        }

    @classmethod
    def from_state(cls, state: dict) -> TopExamples:
        """A new instance holding ``state`` (its sizes, detectors, k and context read from it)."""
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            raise ValueError(_not_a_state(state))
        try:
            n_layer, n_head = state["shape"]
            made = cls(n_layer, n_head, state["detectors"], state["k"], state["context"], state["per_story"])
        except (TypeError, ValueError, StorylensError) as e:
            raise ValueError(f"examples state: bad shape, detectors, k or context ({e})") from None
        return made.load_state(state)

    def load_state(self, state: dict) -> TopExamples:
        """Take the examples of :meth:`state` (the same heads, detectors, k and context), every
        field checked; a state that is not what :meth:`state` writes raises ValueError saying which
        part is wrong, and changes nothing. Returns ``self``."""
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            raise ValueError(_not_a_state(state))
        given = (state["shape"], state["detectors"], state["k"], state["context"], state["per_story"])
        mine = ([self.n_layer, self.n_head], list(self.detectors), self.k, self.context, self.per_story)
        if given != mine or any(isinstance(x, bool) for x in (*given[0], given[2], given[3], given[4])):
            raise ValueError(
                f"examples state: shape {given[0]!r}, detectors {given[1]!r}, k {given[2]!r}, context {given[3]!r}, "
                f"per_story {given[4]!r}; expected {mine[0]}, {mine[1]}, {mine[2]}, {mine[3]}, {mine[4]}"
            )
        examples = state["examples"]
        if not isinstance(examples, dict) or set(examples) != set(self.detectors):
            got = ", ".join(map(str, examples)) if isinstance(examples, dict) else type(examples).__name__
            raise ValueError(
                f"examples state: examples are for {got or 'nothing'}; expected {', '.join(self.detectors)}"
            )
        loaded = {}
        for name in self.detectors:
            layers = examples[name]
            where = f"examples state: examples.{name}"
            if not isinstance(layers, list) or len(layers) != self.n_layer:
                raise ValueError(f"{where}: expected a list of {self.n_layer} layers")
            out = self._empty()
            for li, heads in enumerate(layers):
                if not isinstance(heads, list) or len(heads) != self.n_head:
                    raise ValueError(f"{where}[{li}]: expected a list of {self.n_head} heads")
                for hi, items in enumerate(heads):
                    out[li][hi] = self._check_list(items, f"{where}[{li}][{hi}]")
            loaded[name] = out
        self._kept, self._slots, self._stale, self._pending, self._offered = loaded, {}, set(), [], []
        return self

    def _check_list(self, items, where: str) -> list[Example]:
        if not isinstance(items, list) or len(items) > self.k:
            raise ValueError(f"{where}: expected a list of at most k={self.k} examples")
        out = [self._check_example(x, f"{where}[{i}]") for i, x in enumerate(items)]
        if out != _best(out, self.k, self.per_story):
            raise ValueError(
                f"{where}: the examples are not best first, or a (story, query) repeats, or a story passes per_story"
            )
        return out

    def _check_example(self, x, where: str) -> Example:
        if not isinstance(x, dict) or set(x) != set(EXAMPLE_FIELDS):
            raise ValueError(f"{where}: expected an example with fields {', '.join(EXAMPLE_FIELDS)}")

        def whole(field: str, low: int = 0) -> int:
            v = x[field]
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{where}.{field}: expected a whole number >= {low}, got {v!r}")
            return v

        def number(field: str) -> float:
            v = x[field]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}.{field}: expected a finite number, got {v!r}")
            return float(v)

        def weights(field: str, n: int) -> tuple[float, ...]:
            v = x[field]
            if (
                not isinstance(v, list)
                or len(v) != n
                or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1 for w in v)
            ):
                raise ValueError(f"{where}.{field}: expected {n} weights between 0 and 1, one per key seen")
            return tuple(float(w) for w in v)

        def ids(field: str) -> tuple[int, ...]:
            v = x[field]
            if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v):
                raise ValueError(f"{where}.{field}: expected a list of token ids")
            return tuple(v)

        story, query, key, query_at, key_at = (whole(f) for f in ("story", "query", "key", "query_at", "key_at"))
        tokens, key_tokens = ids("tokens"), ids("key_tokens")
        if query_at != query - max(0, query - self.context) or query_at >= len(tokens):
            raise ValueError(f"{where}.query_at: {query_at} does not place query {query} in its tokens")
        if key_at != key - max(0, key - KEY_BEFORE) or key_at >= len(key_tokens) or key > query:
            raise ValueError(f"{where}.key_at: {key_at} does not place key {key} in its key_tokens")
        value, key_weight = number("value"), number("key_weight")
        seen = weights("weights", query_at + 1)
        near_key = weights("key_weights", _key_seen(query, key, key_at, key_tokens))
        return Example(story, query, value, key, key_weight, tokens, query_at, key_tokens, key_at, seen, near_key)

    # ---------------------------------------------------------------- reading

    def entries(self, layer: int, head: int, name: str) -> list[Example]:
        """The kept examples of head ``(layer, head)`` (0-based) for detector ``name``, best first."""
        if name not in self._kept:
            raise KeyError(f"{name!r}: no such detector ({', '.join(self.detectors)})")
        if not (0 <= layer < self.n_layer and 0 <= head < self.n_head):
            raise KeyError(f"head ({layer}, {head}): no such head ({self.n_layer} layers of {self.n_head})")
        self._settle()
        return list(self._kept[name][layer][head])

    def as_json(self, decode: Callable[[int], str], label: Callable[[int, int], str] = head_label) -> dict:
        """What :meth:`to_json` writes: ``schema_version`` (:mod:`storylens.core.schema`), ``k``, ``per_story`` (None: no limit), the detectors, and every head, layer-major (``layer`` and ``head`` counted from 1,
        like its label), its examples per detector with the token ids decoded one by one
        (``decode(id) -> str``)."""
        self._settle()
        texts: dict[int, str] = {}

        def text(ids: Sequence[int]) -> list[str]:
            out = []
            for t in ids:
                if t not in texts:
                    texts[t] = str(decode(t))
                out.append(texts[t])
            return out

        heads = []
        for layer in range(self.n_layer):
            for head in range(self.n_head):
                per = {}
                for name in self.detectors:
                    per[name] = [
                        {**e.to_state(), "tokens": text(e.tokens), "key_tokens": text(e.key_tokens)}
                        for e in self._kept[name][layer][head]
                    ]
                heads.append({"label": label(layer, head), "layer": layer + 1, "head": head + 1, "examples": per})
        return versioned({"k": self.k, "per_story": self.per_story, "detectors": list(self.detectors), "heads": heads})

    def to_pandas(self, decode: Callable[[int], str] | None = None, label: Callable[[int, int], str] = head_label):
        """Every kept example as one row of a ``pandas.DataFrame``: the head (``label``, ``layer`` and
        ``head`` from 1), the ``detector``, its ``rank`` (0: where the head fires most), then the
        :class:`Example`'s fields (``tokens`` and ``key_tokens`` as text where ``decode(id) -> str`` is
        given, else ids). Needs pandas (``storylens[pandas]``)."""
        from storylens.core.frames import to_frame

        def text(ids: Sequence[int]) -> list:
            return [decode(t) for t in ids] if decode is not None else list(ids)

        self._settle()
        rows = []
        for layer in range(self.n_layer):
            for head in range(self.n_head):
                for name in self.detectors:
                    for rank, e in enumerate(self._kept[name][layer][head]):
                        where = {"label": label(layer, head), "layer": layer + 1, "head": head + 1}
                        state = {**e.to_state(), "tokens": text(e.tokens), "key_tokens": text(e.key_tokens)}
                        rows.append({**where, "detector": name, "rank": rank, **state})
        return to_frame(rows, ["label", "layer", "head", "detector", "rank", *EXAMPLE_FIELDS])

    def to_json(
        self,
        path: str | os.PathLike,
        decode: Callable[[int], str],
        label: Callable[[int, int], str] = head_label,
    ) -> Path:
        """Write :meth:`as_json` to ``path`` atomically (a folder: ``path/examples.json``); returns
        the file written. ``label(layer, head)`` names each head (default ``L{layer+1}H{head+1}``)."""
        target = Path(path)
        if target.is_dir() and not target.is_symlink():
            target = target / "examples.json"
        text = json.dumps(self.as_json(decode, label), ensure_ascii=False, allow_nan=False, indent=1)
        return write_text_atomic(target, text + "\n")


def _not_a_state(state) -> str:
    got = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
    return f"examples state: not a TopExamples state (got {got or 'an empty dict'}; expected {', '.join(sorted(_STATE_KEYS))})"
