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

A user pattern (:func:`pattern_detector`) is any function of the token ids ``[batch, tokens]``
giving key weights ``[batch, query, key]``; its score is the attention-weighted sum of those
weights over the queries whose row is not all zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.nn import functional as F

from storylens.core.errors import StorylensError

PREV_SPAN = 4  # prev4: attention on the last four positions together

# every column the head table already has: a user detector may not take one of these names
SCORE_COLUMNS = (  # the head table's score columns, in order (storylens.analysis.scores)
    "name_mass",
    "name_baseline",
    "name_ratio",
    "prev_token",
    "prev_argmax",
    "prev4",
    "prev_token_first",
    "prev_argmax_first",
    "prev4_first",
    "marker",
    "duplicate_token",
    "induction",
)
NORM_PREFIX = "norm_"  # norm_<detector>: the same detector on the norm-weighted map (storylens.analysis.faithful)
NORM_COLUMNS = tuple(
    NORM_PREFIX + c
    for c in ("name_mass", "name_ratio", "prev_token", "prev_argmax", "prev4", "marker", "duplicate_token", "induction")
)
MOVE_COLUMNS = ("output_norm", "output_share")  # what each head writes (storylens.analysis.faithful)
FLAG_COLUMN = "looks_without_moving"  # the detectors a head is strong on while it writes almost nothing
RESERVED_COLUMNS = frozenset(
    ("label", "block", "head", "layer", "extra", FLAG_COLUMN, *SCORE_COLUMNS, *NORM_COLUMNS, *MOVE_COLUMNS)
)


# ---------------------------------------------------------------- what a batch offers


class BatchMasks:
    """Masks of one batch, made once and shared by every block and detector.

    ``batch``: a :class:`storylens.analysis.encode.StoryBatch` (ids, lengths, name and marker
    masks, first mentions)."""

    def __init__(self, batch, dtype: torch.dtype):
        self.batch = batch
        self.dtype = dtype
        T = batch.ids.shape[1]
        pos = torch.arange(T, device=batch.ids.device)[None, :]
        self.inside = pos < batch.lengths[:, None]  # [B, T] real tokens
        self.queries = self.inside & (pos >= 1)  # q >= 1: query 0 is the marker
        first = batch.first_mention[:, None]
        self.name_queries = self.inside & (first >= 0) & (pos > first) & ~batch.name_mask
        self.key_columns = torch.stack([batch.name_mask, batch.marker_mask], -1)[:, None].to(dtype)  # [B, 1, T, 2]

    def column_mass(self, pattern: torch.Tensor) -> torch.Tensor:
        """``[B, H, q, 2]``: attention on the name tokens and on the markers, one product for both
        (kept for the block being scored: the name and marker detectors share it)."""
        last = self.__dict__.get("_column_mass")
        if last is None or last[0] is not pattern:
            last = (pattern, key_columns_mass(pattern, self.key_columns))
            self.__dict__["_column_mass"] = last
        return last[1]

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

    def sparse_keys(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The key set ``name`` ("duplicate_keys" or "induction_keys") as indices: ``[B, 1, q, m]``
        key positions and a ``[B, 1, q, m]`` 0/1 weight, ``m`` the most keys any query has. A
        query's duplicates are few, so gathering them reads a sliver of each map (not all of it)."""
        key = f"_sparse_{name}"
        if key not in self.__dict__:
            keys = getattr(self, name)  # [B, q, k] bool
            m = max(int(keys.sum(-1).max()), 1)
            pos = torch.arange(keys.shape[-1], device=keys.device)
            ranked = torch.where(keys, pos, -1).topk(m, dim=-1).values  # [B, q, m]: key positions, -1 = none
            self.__dict__[key] = (ranked.clamp(min=0)[:, None], (ranked >= 0)[:, None].to(self.dtype))
        return self.__dict__[key]

    def pattern_keys(self, fn: Callable[[torch.Tensor], torch.Tensor], name: str = "pattern") -> torch.Tensor:
        """A user pattern's key weights, ``[B, q, k]``, kept inside each story and causal. Anything
        but finite weights from 0 to 1 of the right shape is refused in one line naming the detector
        (a weight is how much a key counts: 1 fully, 0 not at all)."""
        ids = self.batch.ids
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
            w = torch.as_tensor(raw).to(device=ids.device, dtype=self.dtype)
        except (TypeError, ValueError, RuntimeError) as e:
            raise StorylensError(
                f"{where} returned weights that are not numbers ({' '.join(str(e).split())[:120]})"
            ) from None
        if tuple(w.shape) != (B, T, T):
            raise StorylensError(
                f"{where} returned weights of shape {tuple(w.shape)}; expected {(B, T, T)} ([batch, query, key])"
            )
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        w = torch.where(causal & self.inside[:, :, None] & self.inside[:, None, :], w, torch.zeros((), dtype=w.dtype))
        if not torch.isfinite(w).all():
            raise StorylensError(f"{where} returned NaN or infinite weights; a weight is a number from 0 to 1")
        if (w < 0).any() or (w > 1).any():
            raise StorylensError(
                f"{where} returned weights from {w.min().item():g} to {w.max().item():g}; "
                "a weight is a number from 0 to 1 (how much that key counts)"
            )
        return w


# ---------------------------------------------------------------- the pure functions


def diagonal(pattern: torch.Tensor, k: int) -> torch.Tensor:
    """``out[..., q] = pattern[..., q, q - k]`` (0 for q < k)."""
    T = pattern.shape[-2]
    return F.pad(pattern.diagonal(offset=-k, dim1=-2, dim2=-1), (k, 0))[..., :T]


def prev_token(pattern: torch.Tensor) -> torch.Tensor:
    return diagonal(pattern, 1)


def prev_span(pattern: torch.Tensor, span: int = PREV_SPAN) -> torch.Tensor:
    """Attention on the ``span`` positions before each query, together."""
    return sum((diagonal(pattern, k) for k in range(2, span + 1)), diagonal(pattern, 1))


def prev_is_argmax(pattern: torch.Tensor) -> torch.Tensor:
    """``[..., query]`` float: 1 where key ``q - 1`` is the query's most-attended key, ties going
    to the earliest key (exactly ``pattern.argmax(-1) == q - 1``; 0 for query 0).

    Computed with one ``amax`` instead of ``argmax`` (which tracks indices and is four times slower
    here): key q - 1 wins when its weight is at least query q's own (a later key, which it beats
    on a tie) and above every key before it. Keys after q hold exactly 0 and never win (every
    weight the softmax gives is above 0). To take the maximum over keys 0 .. q-2 without a copy
    of the map, the two newest diagonals are set to 0 for the ``amax`` and written back after:
    ``pattern`` leaves this function bit for bit as it came in.
    """
    T = pattern.shape[-1]
    prev = pattern.diagonal(offset=-1, dim1=-2, dim2=-1)  # views: [..., T - 1]
    own = pattern.diagonal(dim1=-2, dim2=-1)
    saved_prev, saved_own = prev.clone(), own.clone()
    prev.zero_()
    own.zero_()
    try:
        earlier = pattern.amax(-1)  # [..., query]: the largest weight on keys 0 .. q-2
    finally:
        prev.copy_(saved_prev)
        own.copy_(saved_own)
    wins = (saved_prev >= saved_own[..., 1:]) & (saved_prev > earlier[..., 1:])
    return F.pad(wins.to(pattern.dtype), (1, 0))[..., :T]


def key_columns_mass(pattern: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``pattern [B, H, q, k] @ columns [B, 1, k, n]``: attention on each of ``n`` key sets."""
    return pattern @ columns


def keys_mass(pattern: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Attention on a per-query key set ``keys [B, q, k]`` (weights or 0/1): ``[B, H, q]``."""
    return torch.einsum("bhqk,bqk->bhq", pattern, keys.to(pattern.dtype))


def gathered_mass(pattern: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Attention on a few keys per query, ``index``/``weight`` ``[B, 1, q, m]``: ``[B, H, q]``. Equal to
    :func:`keys_mass` with the same key set, reading ``m`` keys per query instead of all."""
    B, H, Q, _ = pattern.shape
    return (pattern.gather(-1, index.expand(B, H, Q, index.shape[-1])) * weight).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x [batch, head, query]`` over the queries in ``mask [batch, query]``: ``[batch, head]``."""
    m = mask.to(x.dtype)[:, None, :]
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1)


# ---------------------------------------------------------------- detectors as data


@dataclass(frozen=True)
class Detector:
    """A named detector: ``values(pattern, masks) -> [B, H, q]`` and ``queries(masks) -> [B, q]``."""

    name: str
    values: Callable[[torch.Tensor, BatchMasks], torch.Tensor]
    queries: Callable[[BatchMasks], torch.Tensor]
    first_columns: bool = False  # also scored over the first N stories (the lesson's *_first)

    def story_means(self, pattern: torch.Tensor, masks: BatchMasks) -> torch.Tensor:
        return masked_mean(self.values(pattern, masks), self.queries(masks))


def _duplicate_queries(m: BatchMasks) -> torch.Tensor:
    return m.duplicate_keys.any(-1)


def _induction_queries(m: BatchMasks) -> torch.Tensor:
    return m.induction_keys.any(-1)


NAME_MASS = Detector("name_mass", lambda p, m: m.column_mass(p)[..., 0], lambda m: m.name_queries)
MARKER = Detector("marker", lambda p, m: m.column_mass(p)[..., 1], lambda m: m.queries)
PREV_TOKEN = Detector("prev_token", lambda p, m: prev_token(p), lambda m: m.queries, first_columns=True)
PREV_ARGMAX = Detector("prev_argmax", lambda p, m: prev_is_argmax(p), lambda m: m.queries, first_columns=True)
PREV4 = Detector("prev4", lambda p, m: prev_span(p), lambda m: m.queries, first_columns=True)
DUPLICATE_TOKEN = Detector(
    "duplicate_token", lambda p, m: gathered_mass(p, *m.sparse_keys("duplicate_keys")), _duplicate_queries
)
INDUCTION = Detector("induction", lambda p, m: gathered_mass(p, *m.sparse_keys("induction_keys")), _induction_queries)

LESSON_DETECTORS = (NAME_MASS, PREV_TOKEN, PREV_ARGMAX, PREV4, MARKER)
BUILTIN_DETECTORS = LESSON_DETECTORS + (DUPLICATE_TOKEN, INDUCTION)


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
    cache_key = f"_pattern_{name}"

    def keys(m: BatchMasks) -> torch.Tensor:
        if cache_key not in m.__dict__:
            m.__dict__[cache_key] = m.pattern_keys(fn, name)
        return m.__dict__[cache_key]

    return Detector(name, lambda p, m: keys_mass(p, keys(m)), lambda m: (keys(m) != 0).any(-1))
