"""Head detectors: pure functions of one block's attention ``[batch, head, query, key]``.

A detector gives, for every query, a number ``[batch, head, query]`` (how much of the query's
attention goes where the detector looks), and says which queries count ``[batch, query]``. A
head's score is then the **mean over stories of the per-story mean over the counted queries**
(every story counts once; a story with no counted query is left out), streamed by
:class:`storylens.analysis.scores.HeadScoreAccumulator`. Positions count the opening marker as 0.

The lesson's detectors (definitions in :mod:`storylens.analysis.scores`):
``name_mass``, ``prev_token``, ``prev_argmax``, ``prev4``, ``marker``.

TransformerLens's two token patterns (its ``head_detector``), as masses:

``duplicate_token``
    Attention on earlier positions holding the same token as the query (``k < q``,
    ``ids[k] == ids[q]``), over the queries that have such a position.
``induction``
    Attention on the positions just after an earlier occurrence of the query's token
    (``k <= q``, ``k >= 1``, ``ids[k - 1] == ids[q]``, ``k - 1 < q``), over the queries that
    have one. (TransformerLens averages its "mul" score over every position, queries with no
    such key adding 0; storylens averages over the queries the pattern applies to.)

``first_mass``
    Attention on position 0, the token that opens every sequence (where attention sinks rest),
    over queries q >= 1.

A user pattern (:func:`pattern_detector`) is any function of the token ids ``[batch, tokens]``
giving key weights ``[batch, query, key]``; its score is the attention-weighted sum of those
weights over the queries whose row is not all zero.

The detectors own the head table's columns: each :class:`Detector` carries its column's title,
meaning and where it is shown, and declares the columns derived from it; :func:`table_columns`
lays the table out from the list of detectors (built-in and user ones alike), and every reader
(the table's files, the report, the faithfulness table, the training timeline) reads it from there.
Adding a built-in detector is its definition here, appended to :data:`BUILTIN_DETECTORS`, and its test.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import torch
from torch.nn import functional as F

from storylens.analysis.encode import StoryBatch
from storylens.analysis.sinks import ACTIVE_SHARE, DORMANT_NATS, DORMANT_SHARE, SINK_THRESHOLD
from storylens.core.errors import StorylensError

T_ = TypeVar("T_")

PREV_SPAN = 4  # prev4: attention on the last four positions together
NORM_PREFIX = "norm_"  # norm_<column>: the same detector on the norm-weighted map (storylens.analysis.faithful)
FIRST_SUFFIX = "_first"  # <detector>_first: the same detector over only the first stories (the lesson's)

# where a column is shown (Column.shown): the report's overview grids (raw, then norm-weighted), the
# lesson's own sections of the report (which name their columns), the report's "More detectors",
# the faithfulness table (its strongest heads switched off), the training timeline's figures
OVERVIEW, LESSON, MORE, TRUTH, TIMELINE = "overview", "lesson", "more", "truth", "timeline"
SINKS = "sinks"  # the report's grids of sinks and dormant heads (storylens.analysis.sinks)
SHOWN_BEYOND_LESSON = frozenset((OVERVIEW, MORE, TRUTH))  # a detector beyond the lesson's, a user's among them


@dataclass(frozen=True)
class Column:
    """One column of the head table (:class:`storylens.analysis.scores.HeadScores`): its name, its title
    (a table's or heatmap's heading; ``{marker}`` stands for what the model's opening token is called),
    what it means in one line, where it is shown (``OVERVIEW`` .. ``TIMELINE``), and whether it has a
    norm-weighted twin ``norm_<name>``."""

    name: str
    title: str
    meaning: str
    shown: frozenset[str] = frozenset()
    norm: bool = False

    @property
    def twin(self) -> Column:
        """The norm-weighted twin: the same score on the norm-weighted map, in the overview where this one is."""
        meaning = f"{self.name} on the norm-weighted map (what the head moves, not only where it looks)"
        return Column(NORM_PREFIX + self.name, "Norm-weighted: " + self.title.lower(), meaning, self.shown & {OVERVIEW})


# ---------------------------------------------------------------- what a batch offers


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
        self.whole: Masks  # the whole batch's view (set by Masks)

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
        m = max(int(keys.sum(-1).max()), 1)
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
        index, valid = duplicate_index(self.batch.ids, self.inside)  # [B, q, m]
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
            P = max(int(count.max()) if B else 0, 1)
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

    ``batch``: a :class:`storylens.analysis.encode.StoryBatch` (ids, lengths, name and marker
    masks, first mentions)."""

    def __init__(self, batch: StoryBatch, dtype: torch.dtype):
        T = batch.ids.shape[1]
        self._set(_KeySets(batch, dtype), 0, T, T, None)
        self._sets.whole = self

    def _set(self, sets: _KeySets, start: int, stop: int, keys: int, mass) -> None:
        self._sets, self.batch, self.dtype = sets, sets.batch, sets.dtype
        self.start, self.stop, self.keys = start, stop, keys
        self._mass: tuple[torch.Tensor, torch.Tensor] | None = mass  # (the map, its column masses)
        self._pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._earlier: list[tuple[weakref.ref, torch.Tensor]] = []  # (the map, _earlier_max of it): one

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
        """The whole batch's masks (every view of the batch shares one)."""
        return self._sets.whole

    def rows(self, start: int, stop: int, keys: int) -> Masks:
        """The masks of query rows ``start .. stop - 1`` over keys ``0 .. keys - 1``: what a
        detector reads with a chunk of a map (``[batch, head, stop - start, keys]``)."""
        view = self._view(start, stop, keys)
        return self.full if view.whole else view

    def with_mass(self, pattern: torch.Tensor, mass: torch.Tensor) -> Masks:
        """These masks, with ``column_mass(pattern)`` already formed (``[B, H, q, 2]``: name and
        marker, e.g. in the attention's product with the values: :mod:`storylens.analysis.record`).
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
        (:func:`prev_is_argmax`), taken once per map: the raw and the norm-weighted previous-token
        argmax read it (views made by :meth:`with_mass` share it; the map is held weakly)."""
        held = self._earlier
        if not held or held[0][0]() is not pattern:
            held[:] = [(weakref.ref(pattern), _earlier_max(pattern, self.start))]
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
            P = max(int((hi - lo).max()), 1)
            at = lo + torch.arange(P, device=queries.device)[None, :]  # [B, P]
            real = at < hi
            at = at.clamp(max=queries.shape[1] - 1)
            self._pairs[name] = (
                torch.where(real, queries.gather(1, at), self.stop),
                torch.where(real, keys.gather(1, at), 0),
            )
        return self._pairs[name]

    def read_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where :class:`Reads` reads these rows' map ``[B, H, n, keys]`` seen flat: ``[n * READ_KEYS]``
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
        :class:`Reads` gathers and sums them: ``[B, 1, P]`` each pair's slot in a per-row ``[2 * (n + 1)]``
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


# ---------------------------------------------------------------- the pure functions


def duplicate_index(ids: torch.Tensor, inside: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's earlier positions holding its token (inside its story), latest first:
    ``[B, q, m]`` positions and ``[B, q, m]`` bool (which are real), ``m`` the most any query has
    (at least 1). The tokens are sorted (positions rising within a token), so a query's earlier
    duplicates are the ones before it in its run: ``B x q x m`` memory, never ``q x k``."""
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
    m = max(int(rank.max()) if T else 0, 1)
    back = i[..., None] - 1 - torch.arange(m, device=dev)  # [B, T, m]: sorted places, latest first
    valid = torch.arange(m, device=dev) < rank[..., None]
    where = torch.where(valid, perm.gather(1, back.clamp(min=0).reshape(B, -1)).view(B, T, m), 0)
    at = perm[..., None].expand(B, T, m)  # back to query order
    index = torch.zeros(B, T, m, dtype=torch.long, device=dev).scatter_(1, at, where)
    real = torch.zeros(B, T, m, dtype=torch.bool, device=dev).scatter_(1, at, valid)
    return index, real


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
    form of :func:`prev_span` takes (raw, scaled, from :class:`Reads`), so all give the same bits."""
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
    chunk of rows (see :func:`diagonal`). ``earlier``: :func:`_earlier_max` of ``pattern``, where
    already taken (:meth:`Masks.earlier_max`).
    """
    n, lead = pattern.shape[-2], max(0, 1 - start)  # lead: query 0 has no previous key
    prev = pattern.diagonal(offset=start - 1, dim1=-2, dim2=-1)  # views: [..., n - lead]
    own = pattern.diagonal(offset=start, dim1=-2, dim2=-1)
    earlier = _earlier_max(pattern, start) if earlier is None else earlier  # [..., query]: keys 0 .. q-2
    wins = (prev >= own[..., lead:n]) & (prev > earlier[..., lead:])
    return F.pad(wins.to(pattern.dtype), (lead, 0))[..., :n]


def key_columns_mass(pattern: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``pattern [B, H, q, k] @ columns [B, 1, k, n]``: attention on each of ``n`` key sets."""
    return pattern @ columns


def columns_mass(
    pattern: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, norms: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, H, q, n]``: attention on each of ``n`` key sets shared by every query of a story,
    given as ``index [B, m]`` key positions and ``weight [B, m, n]``; equal to
    :func:`key_columns_mass` with those columns, reading ``m`` keys per row instead of all. Keys
    past the pattern's last (a chunk of rows sees only the keys before it) weigh nothing.
    ``norms [B, H, keys]``: the same on the scaled map ``pattern * norms[key]`` (:func:`scaled`),
    bit for bit, without forming it."""
    B, H, Q, K = pattern.shape
    weight = weight * (index < K)[..., None].to(weight.dtype)
    index = index.clamp(max=K - 1)
    picked = pattern.gather(-1, index[:, None, None, :].expand(B, H, Q, index.shape[-1]))  # [B, H, q, m]
    if norms is not None:
        picked = picked * _key_norms(pattern, norms).gather(-1, index[:, None, :].expand(B, H, -1))[:, :, None, :]
    return picked @ weight[:, None].to(pattern.dtype)


def _key_norms(pattern: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``norms [B, H, keys]`` cut to ``pattern``'s keys, in its dtype: the factor :func:`scaled` applies."""
    return norms[..., : pattern.shape[-1]].to(pattern.dtype)


def scaled(pattern: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """The norm-scaled map ``pattern * norms[key]`` ``[B, H, q, k]`` (what :attr:`Detector.scaled`
    computes on without forming it; :func:`storylens.analysis.faithful.norm_scaled`'s products)."""
    return pattern * _key_norms(pattern, norms)[:, :, None, :]


def key_diagonal(norms: torch.Tensor, k: int, start: int, n: int) -> torch.Tensor:
    """``out[..., r] = norms[..., q - k]`` for the query ``q = start + r`` of row ``r`` (0 for q < k):
    the key norm :func:`diagonal` ``k`` reads at each row, ``[B, H, n]``."""
    lead = min(n, max(0, k - start))
    return F.pad(norms[..., start + lead - k : start + n - k], (lead, 0))


def scaled_diagonal(pattern: torch.Tensor, norms: torch.Tensor, k: int, start: int = 0) -> torch.Tensor:
    """:func:`diagonal` of the scaled map (:func:`scaled`), bit for bit, reading ``n`` entries."""
    n = pattern.shape[-2]
    return diagonal(pattern, k, start) * key_diagonal(_key_norms(pattern, norms), k, start, n)


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
    w = _key_norms(pattern, norms)  # [B, H, keys]
    earlier = _earlier_max(pattern, start) if earlier is None else earlier  # [..., n]: raw, keys 0 .. q-2
    prev = diagonal(pattern, 1, start) * key_diagonal(w, 1, start, n)  # [..., n]: s_{q-1}
    own = pattern.diagonal(offset=start, dim1=-2, dim2=-1)[..., :n] * w[..., start : start + n]  # s_q
    return _scaled_wins(pattern, w, start, earlier, prev, own)


def _scaled_wins(
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


def _earlier_max(pattern: torch.Tensor, start: int) -> torch.Tensor:
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
    """Attention on a key set given as pairs (:meth:`Masks.key_pairs`: ``queries``, ``keys``
    ``[B, P]``, a query past the chunk's rows marking no pair), for a chunk of rows whose first
    query is ``start``: ``[B, H, q]``, equal to :func:`keys_mass` on the same key set. One
    gather of the pairs' weights from the map seen flat (a query's few keys, not every query padded
    to the most any has), then each query's summed."""
    B, H, Q, K = pattern.shape
    row = (queries - start).clamp(max=Q)  # Q: no pair (a slot of its own, dropped)
    flat = torch.where(row < Q, row * K + keys, 0)  # [B, P] into each story's [q * k]
    picked = pattern.reshape(B, H, Q * K).gather(-1, flat[:, None].expand(B, H, flat.shape[1]))  # [B, H, P]
    if norms is not None:  # on the scaled map (:func:`scaled`), bit for bit: each pair's weight times its key's norm
        picked = picked * _key_norms(pattern, norms).gather(-1, keys[:, None].expand(B, H, keys.shape[1]))
    out = torch.zeros(B, H, Q + 1, dtype=pattern.dtype, device=pattern.device)
    return out.scatter_add_(-1, row[:, None].expand(B, H, row.shape[1]), picked)[..., :Q]


READ_KEYS = PREV_SPAN + 2  # Reads: each row's weights on keys q, q - 1, .., q - PREV_SPAN, then on key 0


class Reads:
    """What the built-in detectors read of one chunk of a block's map ``pattern [B, H, n, keys]``
    (:attr:`Detector.read`), taken once for all of them: each row's weights on its newest keys
    ``q .. q - PREV_SPAN`` and on key 0 in one gather, every duplicate-token and induction pair's weight
    (:meth:`Masks.key_pairs`) in another, summed per query in one scatter. :meth:`scaled` gives the same
    reads of the norm-scaled map (:func:`scaled`): each read weight times its key's norm, the map not
    formed. Each value equals the detector's ``values`` (``scaled``) bit for bit: the same entries, the
    same products, the same sums in the same order (a key before position 0 reads 0, as
    :func:`diagonal` pads)."""

    def __init__(
        self,
        pattern: torch.Tensor,
        masks: Masks,
        norms: torch.Tensor | None = None,
        raw: Reads | None = None,
        held: HeldReads | None = None,
    ):
        self.pattern, self.masks, self.norms, self._raw = pattern, masks, norms, raw
        self._held = held  # the raw reads of a map now gone (:meth:`HeldReads.scaled`): served from it

    def held(self, norms: torch.Tensor) -> HeldReads:
        """What the reads of the map scaled by ``norms [B, H, keys]`` need of the map, taken now: the
        raw entries and pairs gathered, and the scaled previous-token argmax decided (it needs the map
        where its bounds leave a row unsure)."""
        B, H, n, _ = self.pattern.shape
        start = self.masks.start
        w = _key_norms(self.pattern, norms)
        key = self.masks.read_index()[1]
        # the scaled reads, bit for bit (the same products): keys q, q - 1, .., q - PREV_SPAN, then 0
        scaled = (self._entries.view(B, H, -1) * w.gather(-1, key.expand(B, H, key.shape[0]))).view(B, H, n, -1)
        # a lower bound of the largest on keys 0 .. q - 2: those read there (0 where a key is missing). For
        # q < 2 key 0 is q - 1 or q itself, but no row there is unsure (the upper bound is 0: prev > 0 wins)
        known = scaled[..., 2:].amax(-1)
        prev, own = scaled[..., 1], scaled[..., 0]
        wins = _scaled_wins(self.pattern, w, start, self.masks.earlier_max(self.pattern), prev, own, known)
        return HeldReads(self._entries, self._picked, self.pattern.shape[-1], norms, wins)

    def scaled(self, norms: torch.Tensor, masks: Masks | None = None) -> Reads:
        """The same reads of ``pattern * norms[key]`` (``norms [B, H, keys]``), from these; ``masks``:
        views of the same rows with the scaled name and marker masses formed (:meth:`Masks.with_mass`)."""
        return Reads(self.pattern, self.masks if masks is None else masks, norms, self)

    @cached_property
    def _w(self) -> torch.Tensor:  # [B, H, keys]: the key norms in the map's dtype
        assert self.norms is not None
        return _key_norms(self.pattern, self.norms)

    @cached_property
    def _entries(self) -> torch.Tensor:
        """``[B, H, n, READ_KEYS]``: each row's weights on keys ``q, q - 1, .., q - PREV_SPAN`` and 0."""
        if self._held is not None:
            return self._held.entries
        flat, key, valid = self.masks.read_index()
        B, H, n, K = self.pattern.shape
        if self._raw is None:  # (a gather, several times faster on a CPU than index_select on the last axis)
            got = self.pattern.reshape(B, H, n * K).gather(-1, flat.expand(B, H, flat.shape[0]))
        else:
            got = self._raw._entries.view(B, H, -1) * self._w.gather(-1, key.expand(B, H, key.shape[0]))
        return torch.where(valid, got.view(B, H, n, READ_KEYS), torch.zeros((), dtype=got.dtype))

    def diagonal(self, k: int) -> torch.Tensor:
        """:func:`diagonal` ``k`` (0 .. PREV_SPAN) of the map, ``[B, H, n]``."""
        return self._entries[..., k]

    def first(self) -> torch.Tensor:
        """Each row's weight on key 0, ``[B, H, n]``."""
        return self._entries[..., READ_KEYS - 1]

    def prev_span(self, span: int = PREV_SPAN) -> torch.Tensor:
        """:func:`prev_span`: the weights on keys ``q - 1 .. q - span`` summed in the same order."""
        return span_sum(self.diagonal, span)

    def column_mass(self) -> torch.Tensor:
        """:meth:`Masks.column_mass` (or its scaled twin), ``[B, H, n, 2]``: name and marker."""
        if self._raw is None:
            return self.masks.column_mass(self.pattern)
        assert self.norms is not None
        return self.masks.scaled_column_mass(self.pattern, self.norms)

    def prev_is_argmax(self) -> torch.Tensor:
        """:func:`prev_is_argmax` (or :func:`scaled_prev_is_argmax`) from the read diagonals."""
        if self._raw is not None and self._raw._held is not None:  # decided when the map was fed
            return self._raw._held.wins
        earlier = self.masks.earlier_max(self.pattern)
        prev, own = self.diagonal(1), self.diagonal(0)
        if self._raw is not None:
            return _scaled_wins(self.pattern, self._w, self.masks.start, earlier, prev, own)
        valid = self.masks.read_index()[2][:, 1]  # [n]: query q >= 1
        return ((prev >= own) & (prev > earlier) & valid).to(self.pattern.dtype)

    @cached_property
    def _picked(self) -> torch.Tensor:
        """``[B, H, P]``: the weight of every pair of both key sets (:meth:`Masks.read_pairs`)."""
        if self._held is not None:
            return self._held.picked
        rows, flat, keys = self.masks.read_pairs()
        B, H, n, K = self.pattern.shape
        if self._raw is None:
            return self.pattern.reshape(B, H, n * K).gather(-1, flat.expand(B, H, flat.shape[-1]))
        return self._raw._picked * self._w.gather(-1, keys.expand(B, H, keys.shape[-1]))

    @cached_property
    def _pair_sums(self) -> torch.Tensor:
        rows, _, _ = self.masks.read_pairs()
        B, H, n, _ = self.pattern.shape
        out = torch.zeros(B, H, 2 * (n + 1), dtype=self.pattern.dtype, device=self.pattern.device)
        return out.scatter_add_(-1, rows.expand(B, H, rows.shape[-1]), self._picked)

    def pairs(self, name: str) -> torch.Tensor:
        """:func:`pairs_mass` of the key set ``name`` ("duplicate_keys" or "induction_keys"), ``[B, H, n]``."""
        n = self.pattern.shape[-2]
        at = ("duplicate_keys", "induction_keys").index(name) * (n + 1)
        return self._pair_sums[..., at : at + n]


@dataclass(frozen=True)
class HeldReads:
    """What :class:`Reads` of the norm-scaled map read of one chunk (:meth:`Reads.held`), kept once the
    map is gone: the raw entries ``[B, H, n, READ_KEYS]`` and pairs ``[B, H, P]``, the key norms
    ``[B, H, keys]`` and the scaled previous-token argmax ``[B, H, n]``. Chunks of the same rows of
    several blocks :meth:`join` along the head axis, so their scaled reads are made once for all of
    them: each entry the same product as the chunk's own, so the same bits."""

    entries: torch.Tensor
    picked: torch.Tensor
    keys: int  # the map's
    norms: torch.Tensor
    wins: torch.Tensor

    @staticmethod
    def join(parts: Sequence[HeldReads]) -> HeldReads:
        """Chunks of the same rows and keys, block after block along the head axis."""
        if len(parts) == 1:
            return parts[0]
        entries, picked, norms, wins = (
            torch.cat(x, 1) for x in zip(*((p.entries, p.picked, p.norms, p.wins) for p in parts))
        )
        return HeldReads(entries, picked, parts[0].keys, norms, wins)

    def scaled(self, masks: Masks) -> Reads:
        """The scaled reads (:meth:`Reads.scaled`) of these rows, ``masks`` theirs with the scaled name
        and marker masses formed (:meth:`Masks.with_mass`). The map they stand for is gone: their
        ``pattern`` is a stand-in of its shape, dtype and device, holding no entries."""
        B, H, n, _ = self.entries.shape
        standin = torch.zeros((), dtype=self.entries.dtype, device=self.entries.device).expand(B, H, n, self.keys)
        return Reads(standin, masks, held=self).scaled(self.norms, masks)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x [batch, head, query]`` over the queries in ``mask [batch, query]``: ``[batch, head]``."""
    m = mask.to(x.dtype)[:, None, :]
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1)


# ---------------------------------------------------------------- detectors as data


@dataclass(frozen=True)
class Detector:
    """A named detector: ``values(pattern, masks) -> [B, H, q]`` and ``queries(masks) -> [B, q]``,
    and what its column of the head table needs: a title, a one-line meaning, where it is shown
    (:class:`Column`), the columns derived from it, and whether the ``*_first`` twin is kept. Every
    detector has its norm-weighted twin ``norm_<name>`` (when the norm-weighted map is scored)."""

    name: str
    values: Callable[[torch.Tensor, Masks], torch.Tensor]
    queries: Callable[[Masks], torch.Tensor]
    first_columns: bool = False  # also scored over the first N stories (the lesson's *_first)
    # reads a chunk of query rows right (masks cut to them, its first row masks.start) and is linear
    # in each row (or, scale_free, unchanged when a row is scaled): every built-in and pattern
    # detector. A detector made by hand without it gets whole maps and the norm-weighted map itself.
    rows: bool = False
    scale_free: bool = False
    # values(pattern * norms[key], masks) without forming that map, bit for bit: ``scaled(pattern,
    # norms [B, H, keys], masks)`` (the norm-weighted columns then cost a few reads of the map, not a
    # pass; None: the scaled map is formed for it)
    scaled: Callable[[torch.Tensor, torch.Tensor, Masks], torch.Tensor] | None = None
    # values (and scaled) from the block's shared reads (:class:`Reads`), bit for bit: the built-in
    # detectors read a few entries of each row, gathered once for all of them (None: values, scaled)
    read: Callable[[Reads], torch.Tensor] | None = None
    title: str = ""  # "" : "Detector <name>"
    meaning: str = ""
    shown: frozenset[str] = SHOWN_BEYOND_LESSON
    derived: tuple[Column, ...] = ()  # columns computed from this one's (following it in the table)
    kind: str = ""  # the kind of head it finds, as the training timeline's formation table says ("" : none)

    def story_means(self, pattern: torch.Tensor, masks: Masks) -> torch.Tensor:
        return masked_mean(self.values(pattern, masks), self.queries(masks))

    @property
    def column(self) -> Column:
        """Its own column (with a norm-weighted twin)."""
        title = self.title or f"Detector {self.name}"
        return Column(self.name, title, self.meaning or title, self.shown, norm=True)

    @property
    def first_column(self) -> Column:
        """``<name>_first``: the same over the first stories only (``max_stories_prev``)."""
        return Column(self.name + FIRST_SUFFIX, f"{self.column.title} (first stories)", self.column.meaning)


def _duplicate_queries(m: Masks) -> torch.Tensor:
    return m.sparse_keys("duplicate_keys")[1][:, 0].any(-1)  # a query with an earlier duplicate


def _induction_queries(m: Masks) -> torch.Tensor:
    return m.sparse_keys("induction_keys")[1][:, 0].any(-1)


NAME_BASELINE = Column(
    "name_baseline",
    "Even-spread baseline of name mass",
    "name tokens at or before q over q + 1, over the name queries: what an even spread would give (one number)",
)
NAME_RATIO = Column(
    "name_ratio",
    "Name mass / even-spread baseline",
    "name_mass / name_baseline: a ratio of the two means",
    frozenset((OVERVIEW, LESSON)),
    norm=True,
)
NAME_MASS = Detector(
    "name_mass",
    lambda p, m: m.column_mass(p)[..., 0],
    lambda m: m.name_queries,
    rows=True,
    scaled=lambda p, w, m: m.scaled_column_mass(p, w)[..., 0],
    read=lambda r: r.column_mass()[..., 0],
    title="Name mass (share of attention on the main character's name)",
    meaning="attention on the main character's name tokens, over the queries after its first mention",
    shown=frozenset((OVERVIEW, LESSON, TRUTH, TIMELINE)),
    derived=(NAME_BASELINE, NAME_RATIO),
    kind="name",
)
MARKER = Detector(
    "marker",
    lambda p, m: m.column_mass(p)[..., 1],
    lambda m: m.queries,
    rows=True,
    scaled=lambda p, w, m: m.scaled_column_mass(p, w)[..., 1],
    read=lambda r: r.column_mass()[..., 1],
    title="Attention on {marker}",
    meaning="attention on the end-of-story marker tokens, over queries q >= 1",
    shown=frozenset((OVERVIEW, LESSON, TRUTH, TIMELINE)),
)
PREV_TOKEN = Detector(
    "prev_token",
    lambda p, m: prev_token(p, m.start),
    lambda m: m.queries,
    first_columns=True,
    rows=True,
    scaled=lambda p, w, m: scaled_diagonal(p, w, 1, m.start),
    read=lambda r: r.diagonal(1),
    title="Attention on the previous token",
    meaning="attention on position q - 1, over queries q >= 1",
    shown=frozenset((OVERVIEW, LESSON, TRUTH, TIMELINE)),
    kind="previous-token",
)
PREV_ARGMAX = Detector(
    "prev_argmax",
    lambda p, m: prev_is_argmax(p, m.start, m.earlier_max(p)),
    lambda m: m.queries,
    first_columns=True,
    rows=True,
    scaled=lambda p, w, m: scaled_prev_is_argmax(p, w, m.start, m.earlier_max(p)),
    read=lambda r: r.prev_is_argmax(),
    scale_free=True,
    title="Share of queries whose top key is the previous token",
    meaning="share of queries q >= 1 whose most-attended key is q - 1 (ties to the earliest key)",
    shown=frozenset((OVERVIEW, LESSON, TRUTH)),
)
PREV4 = Detector(
    "prev4",
    lambda p, m: prev_span(p, start=m.start),
    lambda m: m.queries,
    first_columns=True,
    rows=True,
    scaled=lambda p, w, m: scaled_prev_span(p, w, start=m.start),
    read=lambda r: r.prev_span(),
    title="Attention on the last four tokens",
    meaning="attention on positions q - 1 .. q - 4 together, over queries q >= 1",
    shown=frozenset((OVERVIEW, LESSON, TRUTH)),
)
DUPLICATE_TOKEN = Detector(
    "duplicate_token",
    lambda p, m: pairs_mass(p, *m.key_pairs("duplicate_keys"), m.start),
    _duplicate_queries,
    rows=True,
    scaled=lambda p, w, m: pairs_mass(p, *m.key_pairs("duplicate_keys"), m.start, w),
    read=lambda r: r.pairs("duplicate_keys"),
    title="Attention on earlier copies of the query's token (duplicate-token)",
    meaning="attention on earlier positions holding the query's token, over the queries that have one",
    shown=frozenset((OVERVIEW, MORE, TRUTH, TIMELINE)),
)
INDUCTION = Detector(
    "induction",
    lambda p, m: pairs_mass(p, *m.key_pairs("induction_keys"), m.start),
    _induction_queries,
    rows=True,
    scaled=lambda p, w, m: pairs_mass(p, *m.key_pairs("induction_keys"), m.start, w),
    read=lambda r: r.pairs("induction_keys"),
    title="Attention on the token after an earlier copy of the query's token (induction)",
    meaning="attention on the positions just after an earlier copy of the query's token, over the queries that have one",
    shown=frozenset((OVERVIEW, MORE, TRUTH, TIMELINE)),
    kind="induction",
)
FIRST_MASS = Detector(
    "first_mass",
    lambda p, m: p[..., 0].clone(),  # a copy: the map's memory is reused once its block is scored
    lambda m: m.queries,
    rows=True,
    scaled=lambda p, w, m: p[..., 0] * _key_norms(p, w)[..., 0, None],
    read=lambda r: r.first(),
    title="Attention on position 0 (the opening token)",
    meaning="attention on position 0, the token that opens every sequence, over queries q >= 1",
    shown=frozenset((OVERVIEW, MORE, SINKS)),
)

LESSON_DETECTORS = (NAME_MASS, PREV_TOKEN, PREV_ARGMAX, PREV4, MARKER)
BUILTIN_DETECTORS = LESSON_DETECTORS + (DUPLICATE_TOKEN, INDUCTION, FIRST_MASS)

# the induction test on repeated random tokens (storylens.analysis.induction): a column of the model alone,
# measured once per run (one forward pass of INDUCTION_SEQUENCES x (1 + 2 x INDUCTION_LENGTH) tokens), not a detector
INDUCTION_SEQUENCES, INDUCTION_LENGTH, INDUCTION_SEED = 4, 50, 0
INDUCTION_RANDOM = Column(
    "induction_random",
    "Induction on repeated random tokens",
    f"attention from each token of a random sequence's second copy on the token after that token in the first copy "
    f"(TransformerLens's induction score): {INDUCTION_SEQUENCES} sequences of {INDUCTION_LENGTH} random ordinary "
    f"tokens (seed {INDUCTION_SEED}), twice, after the opening token; the model's alone, not the stories'",
    frozenset((OVERVIEW, MORE)),
)

# what each head writes (storylens.analysis.faithful), and the flag drawn from it: not detectors
OUTPUT_NORM = Column("output_norm", "Output norm", "the mean size of what the head writes, over queries q >= 1")
OUTPUT_SHARE = Column(
    "output_share",
    "Output share: the head's part of its block's head-output sizes",
    "output_norm over the sum of its block's heads' output norms",
    frozenset((OVERVIEW,)),
)
SINK_RATE = Column(
    "sink_rate",
    f"Sink rate: the share of stories with attention on position 0 above {SINK_THRESHOLD}",
    f"the share of stories whose first_mass exceeds {SINK_THRESHOLD} (Gu et al. 2024's Sink^{SINK_THRESHOLD})",
    frozenset((SINKS,)),
)
FIRST_VALUE_RATIO = Column(
    "first_value_ratio",
    "First value ratio: |f_0| over the mean |f_j| of the other keys",
    "the opening token's value vector through the head's output slice, over the mean of the story's other keys' "
    "(Guo et al. 2024's value-state drain), mean over stories",
    frozenset((SINKS,)),
)
CONTEXT_SHARE = Column(
    "context_share",
    "Context share: the part of what the head writes that depends on the story",
    "E|o_i - mean(o)|^2 / E|o_i|^2 over every query q >= 1, o_i the head's output through its slice of the "
    "output projection and mean(o) its corpus mean: what mean ablation removes, as a share of the output",
    frozenset((OVERVIEW, SINKS)),
)
CONTEXT_NORM = Column(
    "context_norm",
    "Context norm: the size of the story-dependent output",
    "sqrt(E|o_i - mean(o)|^2) over every query q >= 1",
    frozenset((SINKS,)),
)
ACTIVE_RATE = Column(
    "active_rate",
    f"Active rate: the share of stories where the head's own context share exceeds {ACTIVE_SHARE}",
    f"the share of stories in which the head's context share, about the story's own mean, exceeds {ACTIVE_SHARE}",
    frozenset((SINKS,)),
)
# what each head does to the loss (storylens.analysis.causal, `--causal`): None where not computed
ATP_MEAN = Column(
    "atp_mean",
    "AtP, mean ablation: the change in mean next-token loss, in nats",
    "attribution patching: the first-order change in the corpus's mean next-token loss (nats, pooled over "
    "predicted tokens) when the head's output is replaced by its corpus mean at every position after the opening token",
    frozenset((OVERVIEW,)),
)
ATP_MEAN_SE = Column("atp_mean_se", "AtP, mean ablation: standard error", "atp_mean's standard error over stories")
ATP_ZERO = Column(
    "atp_zero",
    "AtP, zero ablation: the change in mean next-token loss, in nats",
    "attribution patching: as atp_mean, the head's output replaced by zero",
    frozenset((OVERVIEW,)),
)
ATP_ZERO_SE = Column("atp_zero_se", "AtP, zero ablation: standard error", "atp_zero's standard error over stories")
DLA = Column(
    "dla",
    "Direct logit attribution: the head's direct push on the next token's logit",
    "the head's output through the final norm (scale frozen) on the next token's unembedding minus the "
    "vocabulary's mean, mean over predicted tokens (TransformerLens's logit_attrs); negative: it pushes the "
    "right token down",
    frozenset((OVERVIEW,)),
)
DLA_SE = Column("dla_se", "Direct logit attribution: standard error", "dla's standard error over stories")
CAUSAL_COLUMNS = (ATP_MEAN, ATP_MEAN_SE, ATP_ZERO, ATP_ZERO_SE, DLA, DLA_SE)
OLD_FLAG = "looks_without_moving"  # the flag before dormant (storylens 0.x runs): refused when read back
SINK_COLUMNS = (SINK_RATE, FIRST_VALUE_RATIO, CONTEXT_SHARE, CONTEXT_NORM, ACTIVE_RATE)
FLAG = Column(
    "dormant",
    "Dormant: switching the head to its mean moves nothing",
    f"its story-dependent output is under {DORMANT_SHARE} of an even share of its block's (context_norm^2 against "
    f"the block's mean) and, where AtP was computed, |atp_mean| + 2 se is under {DORMANT_NATS} nats",
)


def score_columns(detectors: Sequence[Detector]) -> tuple[Column, ...]:
    """The raw score columns of ``detectors``, in the table's order: each detector's own, then
    those derived from it; the ``*_first`` twins follow the last detector that keeps them."""
    firsts = [d for d in detectors if d.first_columns]
    out: list[Column] = []
    for d in detectors:
        out += [d.column, *d.derived]
        if firsts and d is firsts[-1]:
            out += [f.first_column for f in firsts]
    return tuple(out)


def table_columns(detectors: Sequence[Detector]) -> tuple[Column, ...]:
    """Every column of the head table for ``detectors`` (after label, block, head), in order: the raw
    scores (:func:`score_columns`), their norm-weighted twins, the induction test on random tokens
    (:mod:`storylens.analysis.induction`), what each head writes, the sink and
    context columns (:mod:`storylens.analysis.sinks`), the causal columns (:mod:`storylens.analysis.causal`),
    the flag."""
    raw = score_columns(detectors)
    twins = (c.twin for c in raw if c.norm)
    return (*raw, *twins, INDUCTION_RANDOM, OUTPUT_NORM, OUTPUT_SHARE, *SINK_COLUMNS, *CAUSAL_COLUMNS, FLAG)


BUILTIN_COLUMNS = table_columns(BUILTIN_DETECTORS)
SCORE_COLUMNS = tuple(c.name for c in score_columns(BUILTIN_DETECTORS))  # the built-in raw score columns
# a user detector may not take a column's name, nor one a head's row answers to itself
RESERVED_COLUMNS = frozenset(
    ("label", "block", "head", "layer", "at", "scores", "row", "value", *(c.name for c in BUILTIN_COLUMNS))
)


def columns_named(names: Sequence[str]) -> tuple[Column, ...]:
    """The columns called ``names`` (a head table read back from a file): a built-in's as declared,
    any other name a user detector's (with its norm-weighted twin where ``norm_<name>`` is there too)."""
    known = {c.name: c for c in BUILTIN_COLUMNS}
    user = {n: pattern_column(n) for n in names if n not in known and not n.startswith(NORM_PREFIX)}
    for n in names:
        if n not in known and n.startswith(NORM_PREFIX) and n[len(NORM_PREFIX) :] in user:
            known[n] = user[n[len(NORM_PREFIX) :]].twin
    known.update(user)
    return tuple(known.get(n) or Column(n, n, n) for n in names)


def pattern_column(name: str) -> Column:
    """A user pattern's column (:func:`pattern_detector`)."""
    return Column(
        name, f"Detector {name} (a pattern of key weights)", f"the user pattern {name}", SHOWN_BEYOND_LESSON, True
    )


def pattern_detector(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Detector:
    """A detector from a user pattern: ``fn(ids [B, T]) -> key weights [B, q, k]`` (see the module
    docstring). The weights are kept causal and inside each story."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"detector name {name!r}: use letters, digits and _ (it becomes a column)")
    if name in RESERVED_COLUMNS:
        raise ValueError(f"detector name {name!r} is already a column of the head table; choose another NAME")
    if name.startswith(NORM_PREFIX):
        raise ValueError(
            f"detector name {name!r} starts with {NORM_PREFIX!r}, kept for the norm-weighted columns; choose another NAME"
        )
    cache_key = f"pattern:{name}"

    def keys(m: Masks) -> torch.Tensor:
        return m.cut(m.cached(cache_key, lambda: m.full.pattern_keys(fn, name)))

    column = pattern_column(name)
    return Detector(
        name,
        lambda p, m: keys_mass(p, keys(m)),
        lambda m: (keys(m) != 0).any(-1),
        rows=True,
        title=column.title,
        meaning=column.meaning,
    )
