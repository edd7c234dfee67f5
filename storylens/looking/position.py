"""Name mass against a matched-distance control: is a name attended for being a name,
or for where it sits?

The lesson's third limit: "name position is not controlled". Heads have strong
distance habits (recent tokens, the story's opening), so a name may draw attention
because of its distance from the query rather than because it is a name. Here every
head's name mass is set against what the same head, from the same queries, gives
non-name keys at the same query-key distances.

Definitions (one story; positions count the end-of-story marker as 0)
-----------------------------------------------------------------------

* **Queries** ``Q``: positions ``q`` with ``first_mention < q < T`` that are not name
  tokens (``T`` the story's length): the queries of the lesson's name mass (and of
  ``storylens.table.scores``). Each query has weight ``w_q = 1 / |Q|``, so every
  story counts once.
* **Name pairs**: ``(q, k)``, ``q`` in ``Q``, ``k`` a name token, ``k < q``; their
  distance is ``d = q - k`` (always >= 1: a query is never a name token).
* **Control pairs**: ``(q, k)``, ``q`` in ``Q``, ``k`` *not* a name token,
  ``min_key <= k < q``. ``min_key`` is 1 by default: the marker at position 0 is an
  attention sink and not a word, so it is no control for a name (``skip_marker``).
* Per head and distance ``d``: ``S_N(d) = sum w_q a[q, k]`` and ``W_N(d) = sum w_q`` over
  the name pairs at distance ``d``; ``S_C(d)``, ``W_C(d)`` the same over control pairs.
* **Distance profile** ``P(d) = S_C(d) / W_C(d)``: the mean attention these queries
  give a non-name key ``d`` tokens back. If no control pair has distance ``d``
  (``W_C(d) = 0``: e.g. the only key that far back is a name or the marker), ``P(d)``
  is taken from the nearest distance that has one (both nearest, averaged, on a tie);
  the share of name-pair weight so handled is reported as ``unmatched_share``.
* **Name mass** ``= sum_d S_N(d)``: the mean over queries of the attention on the name
  tokens, exactly the lesson's per-story name mass.
* **Control** ``= sum_d W_N(d) P(d)``: for each query, the sum over its earlier name
  tokens of the attention an average non-name key at that token's distance receives;
  averaged over queries like the name mass.
* **Even spread** ``= sum_q w_q n_q / (q + 1)``, ``n_q`` the name tokens before ``q``:
  the lesson's baseline, for reference (one number, no head involved).

Over many stories (:class:`PositionControlAccumulator`) the four per-distance sums are
added story by story (each story's weights sum to 1) and the profile is the pooled
one, ``P(d) = sum S_C(d) / sum W_C(d)``; name mass and control are then divided by the
number of stories. So the name mass is the lesson's mean over stories of per-story
means, and the control uses every story's non-name keys to estimate each distance.
Nothing but ``[block, head, window]`` sums is kept, however many stories are added.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from storylens.core.heads import head_label
from storylens.engine.encode import StoryBatch
from storylens.engine.record import Chunk, Needs, record
from storylens.lm import ModelLike, wrap


def _as_blocks(pattern: torch.Tensor) -> torch.Tensor:
    """``[head, T, T]`` or ``[block, head, T, T]`` -> ``[block, head, T, T]`` float64 (cpu)."""
    a = torch.as_tensor(pattern).detach()
    if a.dim() == 3:
        a = a[None]
    if a.dim() != 4 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"attention: expected [head, T, T] or [block, head, T, T], got {tuple(a.shape)}")
    return a.to("cpu", torch.float64)


def _query_set(T: int, names: set[int], first_mention: int | None) -> list[int]:
    if first_mention is None:
        if not names:
            return []
        first_mention = min(names)
    return [q for q in range(first_mention + 1, T) if q not in names]


@dataclass
class DistanceSums:
    """Per-distance sums for one story or many (see the module docstring).

    ``name_sum``/``control_sum``: ``[block, head, D]``; ``name_weight``/``control_weight``:
    ``[D]`` (no head involved). Index ``d`` is the query-key distance.
    """

    name_sum: torch.Tensor
    name_weight: torch.Tensor
    control_sum: torch.Tensor
    control_weight: torch.Tensor
    even_spread: float  # sum over stories of the per-story even-spread baseline
    n_stories: int
    n_queries: int

    def __iadd__(self, other: DistanceSums) -> DistanceSums:
        D = max(self.name_weight.shape[0], other.name_weight.shape[0])
        for f in ("name_sum", "name_weight", "control_sum", "control_weight"):
            a, b = getattr(self, f), getattr(other, f)
            setattr(self, f, _widen(a, D) + _widen(b, D))
        self.even_spread += other.even_spread
        self.n_stories += other.n_stories
        self.n_queries += other.n_queries
        return self


def _widen(x: torch.Tensor, D: int) -> torch.Tensor:
    if x.shape[-1] == D:
        return x
    pad = torch.zeros(*x.shape[:-1], D - x.shape[-1], dtype=x.dtype)
    return torch.cat([x, pad], dim=-1)


def distance_sums(
    pattern: torch.Tensor,
    name_positions: Iterable[int],
    first_mention: int | None = None,
    *,
    length: int | None = None,
    skip_marker: bool = True,
) -> DistanceSums | None:
    """The per-distance sums of one story; None when it has no query.

    ``pattern``: the story's attention, ``[head, T, T]`` or ``[block, head, T, T]``
    (query, key); ``length`` cuts it to the story's real tokens when it is padded.
    ``name_positions``: the main character's name tokens (marker = 0);
    ``first_mention`` defaults to the smallest of them.
    """
    a = _as_blocks(pattern)
    T = a.shape[-1] if length is None else int(length)
    a = a[..., :T, :T]
    names = {int(p) for p in name_positions if 0 <= int(p) < T}
    queries = _query_set(T, names, first_mention)
    if not queries:
        return None
    w = torch.zeros(T, dtype=torch.float64)
    w[queries] = 1.0 / len(queries)
    pos = torch.arange(T)
    dist = pos[:, None] - pos[None, :]  # [q, k]
    before = dist > 0
    is_name = torch.zeros(T, dtype=torch.bool)
    if names:
        is_name[sorted(names)] = True
    min_key = 1 if skip_marker else 0
    name_w = w[:, None] * (before & is_name[None, :])
    ctrl_w = w[:, None] * (before & ~is_name[None, :] & (pos[None, :] >= min_key))
    idx = dist.clamp(min=0).reshape(-1)
    L, H = a.shape[:2]
    flat = a.reshape(L * H, T * T)

    def per_distance(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.zeros(L * H, T, dtype=torch.float64).index_add_(1, idx, flat * weights.reshape(1, -1))
        wt = torch.zeros(T, dtype=torch.float64).index_add_(0, idx, weights.reshape(-1))
        return s.reshape(L, H, T), wt

    name_sum, name_weight = per_distance(name_w)
    control_sum, control_weight = per_distance(ctrl_w)
    n_before = is_name.to(torch.float64).cumsum(0) - is_name.to(torch.float64)  # name tokens < q
    even = float((w * n_before / (pos + 1)).sum())
    return DistanceSums(name_sum, name_weight, control_sum, control_weight, even, 1, len(queries))


def distance_profile(control_sum: torch.Tensor, control_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``P(d)`` per head, ``[..., D]``, gaps filled from the nearest distance; and the gap mask ``[D]``.

    Distances with no control pair take the profile of the nearest distance that has
    one (the mean of both when two are equally near). With no control pair at all the
    profile is NaN.
    """
    D = control_weight.shape[0]
    have = control_weight > 0
    prof = torch.full_like(control_sum, math.nan)
    prof[..., have] = control_sum[..., have] / control_weight[have]
    avail = have.nonzero().flatten().tolist()
    if not avail:
        return prof, ~have
    for d in (~have).nonzero().flatten().tolist():
        gap = min(abs(d - x) for x in avail)
        near = [x for x in (d - gap, d + gap) if 0 <= x < D and bool(have[x])]
        prof[..., d] = prof[..., near].mean(-1)
    return prof, ~have


@dataclass(frozen=True)
class PositionControl:
    """Per head, ``[block, head]`` float64: name mass, matched-distance control, and counts."""

    name_mass: torch.Tensor
    control: torch.Tensor
    even_spread: float
    unmatched_share: float  # share of name-pair weight whose distance had no control pair
    n_stories: int
    n_queries: int

    @property
    def excess(self) -> torch.Tensor:
        """Name mass minus control: attention a name gets beyond its distance's due."""
        return self.name_mass - self.control

    @property
    def ratio(self) -> torch.Tensor:
        return self.name_mass / self.control

    def to_rows(self) -> list[dict]:
        rows = []
        L, H = self.name_mass.shape
        for b in range(L):
            for h in range(H):
                rows.append(
                    {
                        "label": head_label(b, h),
                        "name_mass": float(self.name_mass[b, h]),
                        "control": float(self.control[b, h]),
                        "excess": float(self.excess[b, h]),
                        "ratio": float(self.ratio[b, h]),
                        "even_spread": self.even_spread,
                    }
                )
        return rows

    def format(self, sort_by: str = "name_mass") -> str:
        rows = sorted(self.to_rows(), key=lambda r: -r[sort_by])
        lines = [
            f"{self.n_stories} stories, {self.n_queries} queries; even spread {self.even_spread:.4f}; "
            f"unmatched distances {self.unmatched_share:.2%} of name-pair weight",
            f"{'head':<6} {'name':>8} {'control':>8} {'excess':>8} {'ratio':>7}",
        ]
        for r in rows:
            lines.append(
                f"{r['label']:<6} {r['name_mass']:>8.4f} {r['control']:>8.4f} {r['excess']:>+8.4f} {r['ratio']:>7.2f}"
            )
        return "\n".join(lines)


def summarise(sums: DistanceSums) -> PositionControl:
    """Name mass and control from (possibly pooled) per-distance sums."""
    n = sums.n_stories
    prof, gaps = distance_profile(sums.control_sum, sums.control_weight)
    total_w = float(sums.name_weight.sum())
    used = sums.name_weight > 0
    control = (prof[..., used] * sums.name_weight[used]).sum(-1) / n
    unmatched = float(sums.name_weight[gaps].sum()) / total_w if total_w > 0 else 0.0
    return PositionControl(
        name_mass=sums.name_sum.sum(-1) / n,
        control=control,
        even_spread=sums.even_spread / n,
        unmatched_share=unmatched,
        n_stories=n,
        n_queries=sums.n_queries,
    )


def position_control(
    pattern: torch.Tensor,
    name_positions: Iterable[int],
    first_mention: int | None = None,
    *,
    length: int | None = None,
    skip_marker: bool = True,
) -> PositionControl | None:
    """One story's name mass and matched-distance control (its own profile); None: no query."""
    s = distance_sums(pattern, name_positions, first_mention, length=length, skip_marker=skip_marker)
    return None if s is None else summarise(s)


class PositionControlAccumulator:
    """Streaming: add stories (or batches of them), read :meth:`result` at any time."""

    def __init__(self, n_layer: int, n_head: int, window: int = 256, *, skip_marker: bool = True):
        self.skip_marker = skip_marker
        z = torch.zeros
        self.sums = DistanceSums(
            z(n_layer, n_head, window, dtype=torch.float64),
            z(window, dtype=torch.float64),
            z(n_layer, n_head, window, dtype=torch.float64),
            z(window, dtype=torch.float64),
            0.0,
            0,
            0,
        )

    def add(
        self,
        pattern: torch.Tensor,
        name_positions: Iterable[int],
        first_mention: int | None = None,
        *,
        length: int | None = None,
    ) -> bool:
        """Add one story (``[head, T, T]`` or ``[block, head, T, T]``); False if it has no query."""
        s = distance_sums(pattern, name_positions, first_mention, length=length, skip_marker=self.skip_marker)
        if s is None:
            return False
        if s.name_sum.shape[:2] != self.sums.name_sum.shape[:2]:
            raise ValueError(
                f"attention has {tuple(s.name_sum.shape[:2])} blocks x heads, "
                f"the accumulator {tuple(self.sums.name_sum.shape[:2])}"
            )
        self.sums += s
        return True

    def add_batch(
        self,
        patterns: Sequence[torch.Tensor],
        lengths: Sequence[int],
        name_positions: Sequence[Iterable[int] | None],
        first_mentions: Sequence[int | None] | None = None,
    ) -> int:
        """Add a batch: one ``[batch, head, T, T]`` per block (as ``GPTOutput.patterns``).

        Stories with ``name_positions`` None or empty are skipped. Returns how many counted.
        """
        stacked = torch.stack([a.detach() for a in patterns], dim=1)  # [batch, block, head, T, T]
        n = 0
        for i, L in enumerate(lengths):
            names = name_positions[i]
            if not names:
                continue
            first = None if first_mentions is None else first_mentions[i]
            n += self.add(stacked[i, :, :, :L, :L], names, first)
        return n

    # --- a measure for storylens.engine.record: fed whole maps, block by block, from the one recording
    needs = Needs(streams=False)  # a story's distances and spans read its whole map
    _batch: StoryBatch | None = None

    def begin(self, batch: StoryBatch) -> None:
        self._batch = batch

    def feed(self, chunk: Chunk) -> None:
        if self._batch is None:
            raise RuntimeError("feed() before begin(batch)")
        layer, pattern = chunk.layer, chunk.probs
        sums = self.sums
        for i, story in enumerate(self._batch.stories):
            if not story.name_positions or story.main is None:
                continue
            T = len(story.ids)
            s = distance_sums(
                pattern[i, :, :T, :T], story.name_positions, story.main.first_mention, skip_marker=self.skip_marker
            )
            if s is None:
                continue
            D = s.name_weight.shape[0]
            sums.name_sum[layer, :, :D] += s.name_sum[0]
            sums.control_sum[layer, :, :D] += s.control_sum[0]
            if layer == 0:  # what depends on no head is added once per story
                sums.name_weight[:D] += s.name_weight
                sums.control_weight[:D] += s.control_weight
                sums.even_spread += s.even_spread
                sums.n_stories += 1
                sums.n_queries += s.n_queries

    def end(self) -> None:
        self._batch = None

    def result(self) -> PositionControl:
        if self.sums.n_stories == 0:
            raise ValueError("no story with a query has been added")
        return summarise(self.sums)


def position_control_scores(
    model: ModelLike, stories: Sequence[str], *, batch_size: int = 16, skip_marker: bool = True
) -> PositionControl:
    """Name mass vs matched-distance control for every head of ``model`` over story texts.

    Main characters and their name tokens come from :mod:`storylens.data.names`
    (the name vocabulary of ``stories`` themselves); one recording pass (to share it with other
    measures, pass a :class:`PositionControlAccumulator` to :func:`storylens.engine.record.record`).
    """

    lm = wrap(model)
    acc = PositionControlAccumulator(lm.n_layer, lm.n_head, lm.window, skip_marker=skip_marker)
    record(lm, stories, [acc], batch_size=batch_size, progress=False)
    return acc.result()
