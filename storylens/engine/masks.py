"""What a detector reads besides the attention: one batch's query masks and key sets (:class:`Masks`), made once
per batch and cut to the rows and keys of each chunk the recording hands over."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import cached_property
from typing import Any, TypeVar

import torch
from torch.nn import functional as F

from storylens.core.errors import StorylensError
from storylens.engine.encode import StoryBatch

T_ = TypeVar("T_")


PREV_SPAN = 4  # prev4: attention on the last four positions together


class _KeySets:
    """A batch's masks and key sets, made once (each the first time it is read) and shared by every
    :class:`Masks` view of the batch: whole, a chunk of rows, or either with formed column masses."""

    def __init__(self, batch: StoryBatch, dtype: torch.dtype):
        self.batch, self.dtype = batch, dtype
        T = batch.ids.shape[1]
        pos = torch.arange(T, device=batch.ids.device)[None, :]
        self.inside = pos < batch.lengths[:, None]  # [B, T] real tokens
        self.queries = self.inside & (pos >= 1)  # q >= 1: query 0 is the marker
        first = batch.first_mention[:, None]
        self.name_queries = self.inside & (first >= 0) & (pos > first) & ~batch.name_mask
        self.key_columns = torch.stack([batch.name_mask, batch.marker_mask], -1)[:, None].to(dtype)  # [B, 1, T, 2]
        self.cache: dict[str, Any] = {}  # Masks.cached: what detectors make once per batch
        # the whole batch's view (set by Masks), held weakly: a strong reference back to it would make a cycle, and
        # a cycle's tensors (this batch's key sets) wait for the cyclic collector, which big tensors do not prompt
        self.whole: weakref.ref[Masks]

    @cached_property
    def story_columns(self) -> torch.Tensor:
        """``[B, T, 2]``: the name and marker key columns, 0 past each story's end."""
        return self.key_columns[:, 0] * self.inside[..., None].to(self.dtype)

    @cached_property
    def column_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The name and marker columns as indices: ``[B, m]`` key positions (inside each story) and
        their ``[B, m, 2]`` 0/1 weights (name, marker), ``m`` the most such keys any story has. A
        story's name and marker tokens are few, so gathering them reads a sliver of each row."""
        cols = self.story_columns  # [B, T, 2]
        keys = cols.sum(-1) > 0
        shapes = self.batch.shapes
        m = max(shapes.column_keys if shapes is not None else int(keys.sum(-1).max()), 1)
        pos = torch.arange(keys.shape[-1], device=keys.device)
        ranked = torch.where(keys, pos, -1).topk(m, dim=-1).values  # [B, m]: key positions, -1 = none
        index = ranked.clamp(min=0)
        weight = cols.gather(1, index[..., None].expand(-1, -1, 2)) * (ranked >= 0)[..., None].to(self.dtype)
        return index, weight

    @cached_property
    def duplicate_keys(self) -> torch.Tensor:
        """``[B, q, k]``: earlier positions holding the query's token."""
        ids = self.batch.ids
        T = ids.shape[1]
        earlier = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril(-1)
        inside = self.inside[:, :, None] & self.inside[:, None, :]
        return (ids[:, :, None] == ids[:, None, :]) & earlier & inside

    @cached_property
    def induction_keys(self) -> torch.Tensor:
        """``[B, q, k]``: positions right after an earlier occurrence of the query's token."""
        dup = self.duplicate_keys  # dup[q, j]: j < q holds ids[q]
        return F.pad(dup, (1, 0))[..., : dup.shape[-1]]  # key k = j + 1 (<= q)

    @cached_property
    def sparse(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Both token key sets as indices (see :meth:`Masks.sparse_keys`), from one sort of the tokens."""
        shapes = self.batch.shapes
        index, valid = duplicate_index(self.batch.ids, self.inside, None if shapes is None else shapes.duplicates)
        weight = valid[:, None].to(self.dtype)
        after = torch.where(valid, index + 1, 0)  # the position just after each earlier occurrence
        return {"duplicate_keys": (index[:, None], weight), "induction_keys": (after[:, None], weight)}

    def key_pairs(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`Masks.key_pairs` (the whole batch's, made once)."""
        key = f"pairs:{name}"
        if key not in self.cache:
            index, valid = self.sparse[name]  # [B, 1, q, m]
            index, valid = index[:, 0], valid[:, 0] > 0
            B, T, m = index.shape
            count = valid.sum((1, 2))  # [B]
            shapes = self.batch.shapes
            P = max(shapes.most_pairs(0, T) if shapes is not None else int(count.max()) if B else 0, 1)
            missing = (~valid).view(B, T * m).to(torch.int8)
            rank = torch.argsort(missing, dim=-1, stable=True)[:, :P]  # real pairs first, in order
            real = torch.arange(P, device=index.device)[None, :] < count[:, None]
            queries = torch.where(real, rank // m, T)
            keys = torch.where(real, index.view(B, T * m).gather(1, rank), 0)
            self.cache[key] = (queries, keys)
        return self.cache[key]


class Masks:
    """What a detector reads besides the attention: one batch's masks and key sets, cut to the query
    rows ``start .. stop - 1`` and the keys ``0 .. keys - 1`` of the map handed with them (the whole
    batch: ``Masks(batch, dtype)``; a chunk of rows: :meth:`rows`). Every view of a batch shares its
    key sets, each made once, the first time any view reads it (no map-sized table is made for a
    chunk); query-indexed masks are sliced from the batch's, so a chunk's values are the full map's.

    ``batch``: a :class:`storylens.engine.encode.StoryBatch` (ids, lengths, name and marker
    masks, first mentions)."""

    def __init__(self, batch: StoryBatch, dtype: torch.dtype):
        T = batch.ids.shape[1]
        self._set(_KeySets(batch, dtype), 0, T, T, None)
        self._sets.whole = weakref.ref(self)

    def _set(self, sets: _KeySets, start: int, stop: int, keys: int, mass) -> None:
        self._sets, self.batch, self.dtype = sets, sets.batch, sets.dtype
        self.start, self.stop, self.keys = start, stop, keys
        self._mass: tuple[torch.Tensor, torch.Tensor] | None = mass  # (the map, its column masses)
        self._pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._earlier: list[tuple[weakref.ref, torch.Tensor]] = []  # (the map, row_earlier_max of it): one

    def _view(self, start: int, stop: int, keys: int, mass=None) -> Masks:
        view = Masks.__new__(Masks)
        view._set(self._sets, start, stop, keys, mass)
        return view

    @property
    def whole(self) -> bool:
        """Whether these are the whole batch's masks (every query row, every key)."""
        T = self._sets.inside.shape[1]
        return (self.start, self.stop, self.keys) == (0, T, T)

    @property
    def full(self) -> Masks:
        """The whole batch's masks (every view of the batch shares one while it is held)."""
        whole = self._sets.whole()
        if whole is None:  # no longer held by anyone: a new whole view of the same key sets
            T = self._sets.inside.shape[1]
            whole = self._view(0, T, T)
            self._sets.whole = weakref.ref(whole)
        return whole

    def rows(self, start: int, stop: int, keys: int) -> Masks:
        """The masks of query rows ``start .. stop - 1`` over keys ``0 .. keys - 1``: what a
        detector reads with a chunk of a map (``[batch, head, stop - start, keys]``)."""
        view = self._view(start, stop, keys)
        return self.full if view.whole else view

    def with_mass(self, pattern: torch.Tensor, mass: torch.Tensor) -> Masks:
        """These masks, with ``column_mass(pattern)`` already formed (``[B, H, q, 2]``: name and
        marker, e.g. in the attention's product with the values: :mod:`storylens.engine.record`).
        The same rows: the key pairs these masks cut for them are shared."""
        view = self._view(self.start, self.stop, self.keys, (pattern, mass))
        view._pairs, view._earlier = self._pairs, self._earlier
        return view

    def cached(self, key: str, make: Callable[[], T_]) -> T_:
        """``make()``, made once per batch (every view of it shares the result): how a detector keeps
        what it derives from the batch alone (a user pattern's key weights)."""
        cache = self._sets.cache
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def cut(self, keys: torch.Tensor) -> torch.Tensor:
        """A batch-wide ``[B, q, k]`` key set cut to these rows and keys."""
        return keys if self.whole else keys[:, self.start : self.stop, : self.keys]

    @cached_property
    def inside(self) -> torch.Tensor:  # [B, q]
        return self._sets.inside if self.whole else self._sets.inside[:, self.start : self.stop]

    @cached_property
    def queries(self) -> torch.Tensor:  # [B, q]
        return self._sets.queries if self.whole else self._sets.queries[:, self.start : self.stop]

    @cached_property
    def name_queries(self) -> torch.Tensor:  # [B, q]
        return self._sets.name_queries if self.whole else self._sets.name_queries[:, self.start : self.stop]

    @cached_property
    def key_columns(self) -> torch.Tensor:
        """``[B, 1, keys, 2]``: the name and marker tokens as key columns."""
        return self._sets.key_columns if self.whole else self._sets.key_columns[:, :, : self.keys]

    @property
    def story_columns(self) -> torch.Tensor:
        """``[B, T, 2]``: the name and marker key columns, 0 past each story's end (the whole batch's)."""
        return self._sets.story_columns

    @property
    def column_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """See :attr:`_KeySets.column_keys` (the whole batch's)."""
        return self._sets.column_keys

    @property
    def duplicate_keys(self) -> torch.Tensor:
        """``[B, q, k]``: earlier positions holding the query's token."""
        return self.cut(self._sets.duplicate_keys)

    @property
    def induction_keys(self) -> torch.Tensor:
        """``[B, q, k]``: positions right after an earlier occurrence of the query's token."""
        return self.cut(self._sets.induction_keys)

    def column_mass(self, pattern: torch.Tensor) -> torch.Tensor:
        """``[B, H, q, 2]``: attention on the name tokens and on the markers, one product for both
        (kept for the map being scored: the name and marker detectors share it), or the masses
        formed elsewhere (:meth:`with_mass`)."""
        last = self._mass
        if last is None or last[0] is not pattern:
            last = self._mass = (pattern, columns_mass(pattern, *self._sets.column_keys))
        return last[1]

    def earlier_max(self, pattern: torch.Tensor) -> torch.Tensor:
        """``[B, H, q]``: each row's largest weight on keys other than ``q - 1`` and ``q``
        (:func:`~storylens.looking.patterns.prev_is_argmax`), taken once per map: the raw and the norm-weighted previous-token
        argmax read it (views made by :meth:`with_mass` share it; the map is held weakly)."""
        held = self._earlier
        if not held or held[0][0]() is not pattern:
            held[:] = [(weakref.ref(pattern), row_earlier_max(pattern, self.start))]
        return held[0][1]

    def scaled_column_mass(self, pattern: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """:meth:`column_mass` of the norm-scaled map ``pattern * norms[key]`` (``norms [B, H, keys]``)
        without forming it (the same products, so the same bits), or the masses formed elsewhere
        (:meth:`with_mass` given ``norms`` in place of the map)."""
        last = self._mass
        if last is None or last[0] is not norms:
            last = self._mass = (norms, columns_mass(pattern, *self._sets.column_keys, norms=norms))
        return last[1]

    def sparse_keys(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The key set ``name`` ("duplicate_keys" or "induction_keys") as indices: ``[B, 1, q, m]``
        key positions, latest first, and a ``[B, 1, q, m]`` 0/1 weight, ``m`` the most keys any
        query has. A query's duplicates are few, so gathering them reads a sliver of each map (not
        all of it); they are found by sorting the tokens, so no ``[q, k]`` table is ever made."""
        if name not in ("duplicate_keys", "induction_keys"):
            raise ValueError(f"sparse_keys: no key set {name!r}")
        index, weight = self._sets.sparse[name]
        if self.whole:
            return index, weight
        return index[:, :, self.start : self.stop], weight[:, :, self.start : self.stop]

    def key_pairs(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The key set ``name`` (as :meth:`sparse_keys`) as ``(query, key)`` pairs, each story's in
        rising query order: ``[B, P]`` query positions (``stop`` past a story's last pair in these
        rows) and ``[B, P]`` key positions (0 there), ``P`` the most pairs any story has here. Only
        the pairs there are, not every query padded to the most keys any query has (most have few)."""
        queries, keys = self._sets.key_pairs(name)
        if self.whole:
            return queries, keys
        if name not in self._pairs:
            lo = torch.searchsorted(queries, torch.full_like(queries[:, :1], self.start))  # [B, 1]
            hi = torch.searchsorted(queries, torch.full_like(queries[:, :1], self.stop))
            shapes = self.batch.shapes
            most = shapes.most_pairs(self.start, self.stop) if shapes is not None else int((hi - lo).max())
            P = max(most, 1)
            at = lo + torch.arange(P, device=queries.device)[None, :]  # [B, P]
            real = at < hi
            at = at.clamp(max=queries.shape[1] - 1)
            self._pairs[name] = (
                torch.where(real, queries.gather(1, at), self.stop),
                torch.where(real, keys.gather(1, at), 0),
            )
        return self._pairs[name]

    def read_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where :class:`~storylens.looking.reads.Reads` reads these rows' map ``[B, H, n, keys]`` seen flat: ``[n * READ_KEYS]``
        flat indices (row ``r`` at keys ``q - k`` for ``k = 0 .. PREV_SPAN``, then 0, ``q = start + r``),
        ``[n * READ_KEYS]`` the keys themselves and ``[n, READ_KEYS]`` which exist (``q - k >= 0``); made
        once per batch and rows."""
        key = f"reads:{self.start}:{self.stop}:{self.keys}"
        if key not in self._sets.cache:
            dev = self._sets.inside.device
            q = torch.arange(self.start, self.stop, device=dev)[:, None]  # [n, 1]
            back = torch.arange(READ_KEYS, device=dev)
            keys = torch.where(back < READ_KEYS - 1, q - back, 0)  # [n, READ_KEYS]
            valid = keys >= 0
            keys = keys.clamp(min=0)
            flat = (q - self.start) * self.keys + keys
            self._sets.cache[key] = (flat.reshape(-1), keys.reshape(-1), valid)
        return self._sets.cache[key]

    def read_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both key sets' pairs in these rows (:meth:`key_pairs`, duplicate-token then induction), as
        :class:`~storylens.looking.reads.Reads` gathers and sums them: ``[B, 1, P]`` each pair's slot in a per-row ``[2 * (n + 1)]``
        sum (duplicate-token's at ``row``, induction's at ``n + 1 + row``, a missing pair at ``n`` past
        its set's rows), its flat index into the ``[n * keys]`` rows and its key; made once per batch and rows."""
        key = f"read pairs:{self.start}:{self.stop}:{self.keys}"
        if key not in self._sets.cache:
            n = self.stop - self.start
            slots, flats, keys = [], [], []
            for i, name in enumerate(("duplicate_keys", "induction_keys")):
                queries, at = self.key_pairs(name)
                row = (queries - self.start).clamp(max=n)
                slots.append(row + i * (n + 1))
                flats.append(torch.where(row < n, row * self.keys + at, 0))
                keys.append(at)
            self._sets.cache[key] = tuple(torch.cat(x, 1)[:, None] for x in (slots, flats, keys))
        return self._sets.cache[key]

    def pattern_keys(self, fn: Callable[[torch.Tensor], torch.Tensor], name: str = "pattern") -> torch.Tensor:
        """A user pattern's key weights, ``[B, q, k]`` (these rows and keys), kept inside each story
        and causal. Anything but finite weights from 0 to 1 of the right shape is refused in one line
        naming the detector (a weight is how much a key counts: 1 fully, 0 not at all)."""
        return self.cut(_pattern_weights(self._sets, fn, name))


def _pattern_weights(sets: _KeySets, fn: Callable[[torch.Tensor], torch.Tensor], name: str) -> torch.Tensor:
    """:meth:`Masks.pattern_keys` over the whole batch."""
    ids = sets.batch.ids
    B, T = ids.shape
    where = f"detector {name}: pattern(ids)"
    try:
        raw = fn(ids.clone())
    except Exception as e:  # the user's code: any error becomes one line
        raise StorylensError(f"{where} raised {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    except SystemExit as e:
        raise StorylensError(f"{where} called sys.exit({e.code!r})") from None
    if isinstance(raw, (str, bytes)) or not hasattr(raw, "shape"):
        raise StorylensError(
            f"{where} returned {type(raw).__name__}; expected a [batch, query, key] tensor of shape {(B, T, T)}"
        )
    try:
        w = torch.as_tensor(raw).to(device=ids.device, dtype=sets.dtype)
    except (TypeError, ValueError, RuntimeError) as e:
        raise StorylensError(
            f"{where} returned weights that are not numbers ({' '.join(str(e).split())[:120]})"
        ) from None
    if tuple(w.shape) != (B, T, T):
        raise StorylensError(
            f"{where} returned weights of shape {tuple(w.shape)}; expected {(B, T, T)} ([batch, query, key])"
        )
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    w = torch.where(causal & sets.inside[:, :, None] & sets.inside[:, None, :], w, torch.zeros((), dtype=w.dtype))
    if not torch.isfinite(w).all():
        raise StorylensError(f"{where} returned NaN or infinite weights; a weight is a number from 0 to 1")
    if (w < 0).any() or (w > 1).any():
        raise StorylensError(
            f"{where} returned weights from {w.min().item():g} to {w.max().item():g}; "
            "a weight is a number from 0 to 1 (how much that key counts)"
        )
    return w


def duplicate_index(
    ids: torch.Tensor, inside: torch.Tensor, most: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's earlier positions holding its token (inside its story), latest first:
    ``[B, q, m]`` positions and ``[B, q, m]`` bool (which are real), ``m`` the most any query has
    (at least 1; ``most``: that count, known on the host, else read from the ranks). The tokens are
    sorted (positions rising within a token), so a query's earlier duplicates are the ones before it
    in its run: ``B x q x m`` memory, never ``q x k``."""
    B, T = ids.shape
    dev = ids.device
    pos = torch.arange(T, device=dev)
    token = torch.where(inside, ids, -1 - pos[None, :])  # a padding position matches nothing
    perm = (token.to(torch.int64) * (T + 1) + pos[None, :]).argsort(dim=-1)  # by token, then position
    run = token.gather(1, perm)
    i = pos[None, :].expand(B, T)
    opens = torch.ones(B, T, dtype=torch.bool, device=dev)
    opens[:, 1:] = run[:, 1:] != run[:, :-1]
    rank = i - torch.where(opens, i, 0).cummax(dim=-1).values  # earlier positions with the same token
    m = max(most if most is not None else int(rank.max()) if T else 0, 1)
    back = i[..., None] - 1 - torch.arange(m, device=dev)  # [B, T, m]: sorted places, latest first
    valid = torch.arange(m, device=dev) < rank[..., None]
    where = torch.where(valid, perm.gather(1, back.clamp(min=0).reshape(B, -1)).view(B, T, m), 0)
    at = perm[..., None].expand(B, T, m)  # back to query order
    index = torch.zeros(B, T, m, dtype=torch.long, device=dev).scatter_(1, at, where)
    real = torch.zeros(B, T, m, dtype=torch.bool, device=dev).scatter_(1, at, valid)
    return index, real


def columns_mass(
    pattern: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, norms: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, H, q, n]``: attention on each of ``n`` key sets shared by every query of a story,
    given as ``index [B, m]`` key positions and ``weight [B, m, n]``; equal to
    :func:`~storylens.looking.patterns.key_columns_mass` with those columns, reading ``m`` keys per row instead of all. Keys
    past the pattern's last (a chunk of rows sees only the keys before it) weigh nothing.
    ``norms [B, H, keys]``: the same on the scaled map ``pattern * norms[key]`` (:func:`~storylens.looking.patterns.scaled`),
    bit for bit, without forming it."""
    B, H, Q, K = pattern.shape
    weight = weight * (index < K)[..., None].to(weight.dtype)
    index = index.clamp(max=K - 1)
    picked = pattern.gather(-1, index[:, None, None, :].expand(B, H, Q, index.shape[-1]))  # [B, H, q, m]
    if norms is not None:
        picked = picked * norms_for_keys(pattern, norms).gather(-1, index[:, None, :].expand(B, H, -1))[:, :, None, :]
    return picked @ weight[:, None].to(pattern.dtype)


def norms_for_keys(pattern: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``norms [B, H, keys]`` cut to ``pattern``'s keys, in its dtype: the factor :func:`~storylens.looking.patterns.scaled` applies."""
    return norms[..., : pattern.shape[-1]].to(pattern.dtype)


def row_earlier_max(pattern: torch.Tensor, start: int) -> torch.Tensor:
    """``[..., n]``: each row's largest weight on keys other than ``q - 1`` and ``q`` (keys after ``q``
    hold 0), the two newest diagonals set to 0 for the ``amax`` and written back after."""
    prev = pattern.diagonal(offset=start - 1, dim1=-2, dim2=-1)
    own = pattern.diagonal(offset=start, dim1=-2, dim2=-1)
    saved_prev, saved_own = prev.clone(), own.clone()
    prev.zero_()
    own.zero_()
    try:
        return pattern.amax(-1)
    finally:
        prev.copy_(saved_prev)
        own.copy_(saved_own)


READ_KEYS = PREV_SPAN + 2  # Reads: each row's weights on keys q, q - 1, .., q - PREV_SPAN, then on key 0
