"""The head table's one accumulator: every detector, raw and norm-weighted, the output norms, the sinks, the
top examples and (with ``causal``) every head's AtP and DLA, fed by one recording pass and mergeable.

Definitions of the columns: :mod:`storylens.table.scores`; how a measure is fed: :mod:`storylens.engine.record`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from storylens.core.buffers import Workspace
from storylens.core.errors import StorylensError
from storylens.effects.attribution import CausalAccumulator
from storylens.effects.estimators import IG_STEPS, EstimateMeasure
from storylens.effects.exact import ExactMeasure, ExactPlan
from storylens.engine.accumulate import MeanAccumulator
from storylens.engine.encode import EncodedStory, StoryBatch
from storylens.engine.gradients import GRAPH_BYTES, Gradients
from storylens.engine.masks import Masks
from storylens.engine.record import Chunk, KeyColumn, Needs
from storylens.lm import AttentionLM
from storylens.looking.detectors import (
    BUILTIN_DETECTORS,
    FIRST_MASS,
    FIRST_SUFFIX,
    NAME_BASELINE,
    NAME_MASS,
    NAME_RATIO,
    NORM_PREFIX,
    OUTPUT_NORM,
    OUTPUT_SHARE,
    Detector,
)
from storylens.looking.example_store import PER_STORY
from storylens.looking.examples import TopExamples
from storylens.looking.faithful import norm_scaled, norm_weighted, row_divide, shares
from storylens.looking.patterns import masked_mean
from storylens.looking.reads import HeldReads, Reads
from storylens.looking.sinks import SinkAccumulator
from storylens.table.effect_parts import PARTS, EffectParts
from storylens.table.finite import Scores as Scores  # the old storylens.analysis.scores name
from storylens.table.finite import refuse_non_finite

# the norm-weighted reads a batch's chunks hold back to sum once for every block (HeadScoreAccumulator._sum_held),
# at most (about a batch of quiz stories' 30 blocks; a long story's chunks are summed whenever they reach it)
HELD_BYTES = 64 * 2**20


_COUNT_FIELDS = (
    "n_stories",
    "n_cut",
    "n_main_character",
    "n_name_scored",
    "max_stories_prev",
    "n_prev_first",
    "window",
)

# the parts of HeadScoreAccumulator.state()
_STATE_PARTS = frozenset(
    {"shape", "detectors", "means", "first", "norm", "output", "sinks", "examples", "name_baseline", *PARTS}
)


def _mean_state(
    part: str, state: dict, shape: tuple[int, ...], max_stories: int | None, bounded: bool = True
) -> MeanAccumulator:
    """:meth:`MeanAccumulator.from_state`, its ValueError prefixed with ``state: {part}: ``."""
    try:
        return MeanAccumulator.from_state(state, shape, max_count=max_stories, bounded=bounded)
    except ValueError as e:
        raise ValueError(f"state: {part}: {e}") from None


def name_baseline(batch: StoryBatch, name_queries: torch.Tensor) -> torch.Tensor:
    """Per story: mean over the name queries of (name tokens at <= q) / (q + 1).

    Computed in float64 where the batch is (it needs no attention map, and nothing waits for it): exact to rounding.
    """
    names = batch.name_mask.to(torch.float64)
    pos = torch.arange(names.shape[1], dtype=torch.float64, device=names.device)
    even = names.cumsum(-1) / (pos + 1)
    return masked_mean(even[:, None, :], name_queries)[:, 0]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _add(sums: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> None:
    sums[name] = x if name not in sums else sums[name] + x


def _story_column(i: int) -> KeyColumn:
    """Column ``i`` of the masks' name and marker key columns (0: name, 1: marker): ``[B, 1, T]``."""
    return KeyColumn(("name", "marker")[i], lambda m, norms: m.story_columns[:, None, :, i])


def _norm_column(i: int | None) -> KeyColumn:
    """``|f_j|`` (None), or ``|f_j|`` times the name (0) or marker (1) column: ``[B, H, T]``, or None
    without key norms. Under each query's attention: the norm-weighted map's row sums and column masses."""

    def weights(m: Masks, norms: torch.Tensor | None) -> torch.Tensor | None:
        if norms is None or i is None:
            return norms
        return norms * m.story_columns[:, None, :, i].to(norms.dtype)

    return KeyColumn("key_norm" if i is None else ("norm_name", "norm_marker")[i], weights)


# what the head scores read from probs @ V when the attention streams: the name and marker masses,
# and (norm-weighted) the row sums and those masses of the map scaled by |f_j|
MASS_COLUMNS = (_story_column(0), _story_column(1))


NORM_MASS_COLUMNS = (_norm_column(None), _norm_column(0), _norm_column(1))


def _formed_mass(chunk: Chunk, probs: torch.Tensor, names: tuple[str, str]) -> Masks:
    """The chunk's masks, with ``probs``' name and marker masses where the kernel formed them."""
    cols = chunk.columns
    if names[0] in cols and names[1] in cols:
        return chunk.masks.with_mass(probs, torch.stack([cols[names[0]], cols[names[1]]], -1))
    return chunk.masks


def _read_scaled(d: Detector, scaled: Reads, norms: torch.Tensor, masks: Masks) -> torch.Tensor:
    """Detector ``d``'s values on the norm-scaled map, not formed: from the scaled reads, or its ``scaled``."""
    if d.read is not None:
        return d.read(scaled)
    assert d.scaled is not None
    return d.scaled(scaled.pattern, norms, masks)


class HeadScoreAccumulator:
    """Every detector's per-story means, summed and counted batch by batch (a measure for
    :func:`storylens.engine.record.record`): :meth:`begin` a batch, :meth:`feed` every chunk of
    every block's map as the model makes it (no map outlives its block), :meth:`end`. Mergeable:
    :meth:`merge` adds another accumulator's sums and counts (float64), in any order.

    ``faithful`` (default): also every detector on the norm-weighted map and each head's output
    norm (:mod:`storylens.looking.faithful`), from the key norms and head outputs the chunks
    carry (:attr:`needs`); a batch recorded without them adds to the raw columns only.

    ``causal``: also every head's AtP and DLA (:class:`~storylens.effects.attribution.CausalAccumulator`,
    the ``atp_*`` and ``dla*`` columns, None without it), from one fused forward and backward per batch
    that :func:`~storylens.engine.record.record` runs beside the recording (``needs.gradients``),
    ``graph_bytes`` its kept graphs at most (:func:`~storylens.engine.gradients.gradient_pass`).

    ``exact``: also every head's exact effect (:class:`~storylens.effects.exact.ExactMeasure`, the
    ``exact_*`` columns), from passes of its own over each batch after the recording (``needs.reruns``), and
    ``estimator`` beside it (:mod:`storylens.effects.estimators`), ``audit_atp`` AtP again where the exact effect ran
    (its audit): :class:`~storylens.table.effect_parts.EffectParts`."""

    @property
    def causal(self) -> CausalAccumulator | None:
        return self.effects.causal

    @property
    def exact(self) -> ExactMeasure | None:
        return self.effects.exact

    @property
    def estimate(self) -> EstimateMeasure | None:
        return self.effects.estimate

    @property
    def graph_bytes(self) -> int:
        return self.effects.graph_bytes

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        detectors: Sequence[Detector] = BUILTIN_DETECTORS,
        *,
        faithful: bool = True,
        examples: int = 0,
        causal: bool = False,
        graph_bytes: int = GRAPH_BYTES,
        exact: ExactPlan | None = None,
        estimator: str | None = None,
        ig_steps: int = IG_STEPS,
        audit_atp: bool = False,
    ):
        names = [d.name for d in detectors]
        if len(set(names)) != len(names):
            raise StorylensError(f"detectors: names must differ ({', '.join(names)})")
        shape = (n_layer, n_head)
        self.n_layer, self.n_head = n_layer, n_head
        self.detectors = tuple(detectors)
        self.means = {d.name: MeanAccumulator(shape) for d in self.detectors}
        self.first = {d.name: MeanAccumulator(shape) for d in self.detectors if d.first_columns}
        self.name_baseline = MeanAccumulator(())
        self.faithful = faithful
        self.norm = {d.name: MeanAccumulator(shape) for d in self.detectors} if faithful else {}
        self.output = MeanAccumulator(shape)
        # sinks and what each head moves that depends on the story (storylens.looking.sinks): from the same outputs
        self.sinks = SinkAccumulator(n_layer, n_head) if faithful else None
        # where each head fires: the top `examples` queries per head and detector (0: not kept),
        # at most PER_STORY of them from one story, so a head's examples span several stories
        self.examples = TopExamples(n_layer, n_head, names, examples, per_story=PER_STORY) if examples else None
        # every detector reads chunks of rows (Detector.rows): else whole maps
        streams = all(d.rows for d in self.detectors)
        self.needs = (
            Needs(MASS_COLUMNS + NORM_MASS_COLUMNS, key_norms=True, outputs=True, streams=streams)
            if faithful
            else Needs(MASS_COLUMNS, streams=streams)
        )
        # the effect columns: AtP and DLA (--causal), the exact effect (--exact), an estimator (--estimator)
        self.effects = EffectParts(
            n_layer, n_head, causal=causal, graph_bytes=graph_bytes, exact=exact, estimator=estimator,
            ig_steps=ig_steps, audit_atp=audit_atp,
        )  # fmt: skip
        self.needs = self.effects.needs(self.needs)
        self._batch: StoryBatch | None = None
        self._masks: Masks | None = None  # the batch's, from its first chunk
        self._sums: list[dict[str, torch.Tensor]] = []
        self._norm_sums: list[dict[str, torch.Tensor]] = []
        self._rows_seen: list[int] = []
        self._out_rows: list[list[torch.Tensor]] = []
        self._out_blocks: list[torch.Tensor | None] = []
        self._scratch = Workspace()  # a batch's scratch memory (the norm-weighted chunk), freed at end()
        # per chunk whose norm-weighted values wait for end(): (block, its masks, its held reads, [B, H, n, 3]
        # the scaled map's row sums, name and marker masses)
        self._held: list[tuple[int, Masks, HeldReads, torch.Tensor]] = []
        self._held_bytes = 0  # their tensors' size, at most HELD_BYTES (then summed at once)
        self._counted_rows: dict[tuple[int, int], tuple[list[torch.Tensor], torch.Tensor]] = {}  # see _counted

    def begin(self, batch: StoryBatch) -> None:
        self._batch, self._masks = batch, None
        self._sums = [{} for _ in range(self.n_layer)]  # per block and detector: [B, H] sums over counted queries
        self._norm_sums = [{} for _ in range(self.n_layer)]
        self._rows_seen = [0] * self.n_layer
        self._out_rows = [[] for _ in range(self.n_layer)]  # per block, [B, H, n] output sizes of its chunks
        self._out_blocks = [None] * self.n_layer
        self._held, self._held_bytes = [], 0
        self._counted_rows = {}
        if self.sinks is not None:
            self.sinks.begin(batch)

    def feed(self, chunk: Chunk) -> None:
        """A chunk of block ``chunk.layer``'s map (:class:`~storylens.engine.record.Chunk`): every
        detector's per-query values are summed over the counted queries; :meth:`end` divides by the
        counts. A block's chunks come in order and cover every query once."""
        if self._batch is None:
            raise RuntimeError("feed() before begin(batch)")
        layer, probs = chunk.layer, chunk.probs
        full = self._masks = chunk.masks.full
        if self.sinks is not None:  # first: the output vectors were just made (still in the processor's caches)
            self.sinks.feed(layer, chunk.output_vectors, chunk.outputs, chunk.masks.queries, chunk.key_norms, full)
        masks = _formed_mass(chunk, probs, ("name", "marker"))
        reads = Reads(probs, masks)  # what the built-in detectors read of the map, gathered once for all
        values = [d.values(probs, masks) if d.read is None else d.read(reads) for d in self.detectors]
        counted, mask = self._counted(masks)
        stacked = self._sum(self._sums[layer], values, counted, mask=mask)
        if self.examples is not None:  # where each head fires: every detector's values in one selection
            if stacked is None:
                offers = [(d.name, v, c) for d, v, c in zip(self.detectors, values, counted)]
                self.examples.add_block(layer, offers, probs, full.batch, start=chunk.start)
            else:
                self.examples.add_stacked(
                    layer, self.examples.detectors, *stacked, probs, full.batch, start=chunk.start
                )
        if self.faithful and chunk.key_norms is not None:
            self._norm_weighted(chunk, counted, reads)
        T = full.inside.shape[1]
        self._rows_seen[layer] += probs.shape[-2]
        if self.faithful and chunk.outputs is not None:
            self._out_rows[layer].append(chunk.outputs)
            if self._rows_seen[layer] >= T:  # the block's every query: its mean output size
                rows = self._out_rows[layer]
                outputs = rows[0] if len(rows) == 1 else torch.cat(rows, -1)  # [B, H, T]
                self._out_blocks[layer], self._out_rows[layer] = masked_mean(outputs, full.queries), []

    def _counted(self, masks: Masks) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every detector's counted queries of the rows ``masks`` cut, ``[B, n]`` each, and stacked
        ``[B, D, n]`` bool: the same in every block, so made once per batch and rows."""
        rows = (masks.start, masks.stop)
        if rows not in self._counted_rows:
            counted = [d.queries(masks) for d in self.detectors]
            self._counted_rows[rows] = counted, torch.stack([c.to(torch.bool) for c in counted], 1)
        return self._counted_rows[rows]

    def _sum(
        self,
        sums: dict[str, torch.Tensor],
        values: list[torch.Tensor],
        counted: list[torch.Tensor],
        total: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every detector's ``values [B, H, n]`` summed over its ``counted [B, n]`` queries into ``sums``
        (``total [B, H, n]``: each value not scale free divided by it first, :func:`row_divide`), in one
        stacked product and sum where the values share a dtype (each row's sum is the one
        ``(values * counted).sum(-1)`` gives alone); returns the values so stacked, ``[B, H, D, n]``,
        and the counted queries, ``[B, D, n]`` bool (``mask``: these, already stacked; None: values of
        several dtypes, summed one by one)."""
        if len({v.dtype for v in values}) != 1:
            self._sum_each(sums, values, counted, total)
            return None
        stacked = torch.stack(values, 2)  # [B, H, D, n]
        if total is not None:  # the same quotients row_divide gives, for every detector at once
            free = torch.tensor([d.scale_free for d in self.detectors], device=stacked.device)[:, None]
            stacked = torch.where(free, stacked, row_divide(stacked, total[:, :, None, :]))
        mask = torch.stack([c.to(torch.bool) for c in counted], 1) if mask is None else mask  # [B, D, n]
        for d, x in zip(self.detectors, (stacked * mask[:, None].to(stacked.dtype)).sum(-1).unbind(-1)):
            _add(sums, d.name, x)
        return stacked, mask

    def _sum_each(
        self,
        sums: dict[str, torch.Tensor],
        values: list[torch.Tensor],
        counted: list[torch.Tensor],
        total: torch.Tensor | None = None,
    ) -> None:
        """:meth:`_sum` one detector at a time (the same sums): where the values' dtypes differ, and for
        the chunks of every block held to the batch's end (:meth:`_sum_held`), where a stacked copy would
        be as large as all their values."""
        for d, v, c in zip(self.detectors, values, counted):
            v = v if total is None or d.scale_free else row_divide(v, total)
            _add(sums, d.name, (v * c.to(v.dtype)[:, None, :]).sum(-1))

    def _norm_weighted(self, chunk: Chunk, counted: list[torch.Tensor], reads: Reads) -> None:
        """Every detector on the chunk's norm-weighted map (:mod:`storylens.looking.faithful`): the
        rows scaled by ``|f_j|``, a detector linear in a row divided after by the row's sum. ``reads``:
        the raw map's (:class:`~storylens.looking.reads.Reads`), scaled for the detectors that read them."""
        probs, norms, cols = chunk.probs, chunk.key_norms, chunk.columns
        assert norms is not None
        if self._norm_unformed(chunk, norms, counted, reads):
            return
        scratch = None  # [B, H, n, keys], in memory the last chunk's scaled map was in (inference only)
        if torch.is_inference_mode_enabled():
            room = probs.shape[0] * probs.shape[1] * probs.shape[-2] * chunk.masks.full.inside.shape[1]
            scratch = self._scratch.take("scaled", probs.shape, probs.dtype, probs.device, room)
        formed = cols["key_norm"] if "key_norm" in cols else None  # the row sums, from probs @ V
        scaled, total = norm_scaled(probs, norms, scratch, row_sums=formed is None)
        total = formed if formed is not None else total
        assert total is not None
        masks = _formed_mass(chunk, scaled, ("norm_name", "norm_marker"))
        weighted = None
        for d, count in zip(self.detectors, counted):
            if not d.rows:  # a hand-made detector: on the map itself
                weighted = norm_weighted(probs, norms) if weighted is None else weighted
                values = d.values(weighted, masks)
            else:  # linear in a row: divided after; scale free: as it is
                values = d.values(scaled, masks)
                values = values if d.scale_free else row_divide(values, total)
            _add(self._norm_sums[chunk.layer], d.name, (values * count.to(values.dtype)[:, None, :]).sum(-1))

    def _norm_unformed(self, chunk: Chunk, norms: torch.Tensor, counted: list[torch.Tensor], reads: Reads) -> bool:
        """:meth:`_norm_weighted` without forming the scaled map, where every detector reads the few
        entries of it it needs (``Detector.read`` of ``reads`` scaled, or ``Detector.scaled``, bit for
        bit) and the row sums and name and marker masses came out of ``probs @ V`` (a streamed chunk);
        False (nothing added) otherwise."""
        cols = chunk.columns
        total, name, marker = (cols.get(k) for k in ("key_norm", "norm_name", "norm_marker"))
        if total is None or name is None or marker is None:
            return False
        if any(d.read is None and d.scaled is None for d in self.detectors):
            return False
        if all(d.read is not None for d in self.detectors):  # summed at end(), for every block at once
            held = reads.held(norms)
            formed = torch.stack([total, name, marker], -1)
            self._held.append((chunk.layer, chunk.masks, held, formed))
            self._held_bytes += sum(_bytes(t) for t in (held.entries, held.picked, held.wins, formed))
            if self._held_bytes > HELD_BYTES:  # (a long story's chunks): summed now, memory stays bounded
                self._sum_held()
            return True
        masks = chunk.masks.with_mass(norms, torch.stack([name, marker], -1))
        scaled = reads.scaled(norms, masks)
        values = [_read_scaled(d, scaled, norms, masks) for d in self.detectors]
        self._sum(self._norm_sums[chunk.layer], values, counted, total, self._counted(chunk.masks)[1])
        return True

    def _sum_held(self) -> None:
        """The norm-weighted values of the chunks held back (:meth:`_norm_unformed`), made once for all
        the blocks whose chunks cover the same rows (their reads joined along the head axis), each
        block's sums added in the order its chunks came."""
        held, self._held, self._held_bytes = self._held, [], 0
        groups: dict[tuple[int, int, int], list[tuple[int, Masks, HeldReads, torch.Tensor]]] = {}
        for h in held:
            groups.setdefault((h[1].start, h[1].stop, h[1].keys), []).append(h)
        for group in groups.values():
            layers, masks = [h[0] for h in group], group[0][1]
            formed = torch.cat([h[3] for h in group], 1)  # [B, G * H, n, 3]
            joined = HeldReads.join([h[2] for h in group])
            scaled_masks = masks.with_mass(joined.norms, formed[..., 1:])
            scaled = joined.scaled(scaled_masks)
            values = [_read_scaled(d, scaled, joined.norms, scaled_masks) for d in self.detectors]
            sums: dict[str, torch.Tensor] = {}
            self._sum_each(sums, values, self._counted(masks)[0], formed[..., 0])
            for name, x in sums.items():
                for layer, part in zip(layers, x.view(x.shape[0], len(layers), self.n_head).unbind(1)):
                    _add(self._norm_sums[layer], name, part)

    def end(self) -> dict[str, torch.Tensor]:
        """Adds the batch; returns its per-story means, ``{detector: [batch, layer, head]}``."""
        if self._batch is None:
            raise RuntimeError("end(): no batch begun")
        if self._masks is None:
            raise RuntimeError(f"end(): no map for blocks {list(range(self.n_layer))}")
        T = self._masks.inside.shape[1]
        missing = [i for i, n in enumerate(self._rows_seen) if n < T]
        if missing:
            raise RuntimeError(f"end(): no map for blocks {missing}")
        self._sum_held()
        normed = sum(1 for b in self._norm_sums if b)
        outs = [o for o in self._out_blocks if o is not None]
        if 0 < normed < self.n_layer or 0 < len(outs) < self.n_layer:
            raise RuntimeError(f"end(): value vectors or head outputs for only some blocks ({normed}, {len(outs)})")
        if self.examples is not None:  # the batch's taken queries into every block's top k, in one pass
            self.examples.flush()
        masks, sums, norm_sums = self._masks, self._sums, self._norm_sums
        self._batch, self._masks, self._sums, self._norm_sums, self._out_blocks = None, None, [], [], []
        self._scratch = Workspace()
        batch = masks.batch
        raw, norm = {}, {}  # per detector: [B, L, H] per-story means, and the stories that count
        for d in self.detectors:
            counted = d.queries(masks)  # [B, q]
            per = counted.sum(-1).clamp(min=1)[:, None, None]  # each story's counted queries
            values = torch.stack([b[d.name] for b in sums], dim=1) / per.to(sums[0][d.name].dtype)  # [B, L, H]
            raw[d.name] = (values, counted.any(-1))
            if self.faithful and normed == self.n_layer:  # a batch counts in every block or none
                nv = torch.stack([b[d.name] for b in norm_sums], dim=1)
                norm[d.name] = (nv / per.to(nv.dtype), counted.any(-1))
        output = (torch.stack(outs, dim=1), masks.queries.any(-1)) if len(outs) == self.n_layer else None
        refuse_non_finite(batch, raw, norm, output, masks.dtype)  # before anything is added: never a NaN score
        out = {}
        for d in self.detectors:
            values, story_counts = raw[d.name]
            self.means[d.name].add(values, story_counts)
            if d.first_columns:
                self.first[d.name].add(values, story_counts & batch.in_first)
            if d.name in norm:
                self.norm[d.name].add(*norm[d.name])
            out[d.name] = values
        if output is not None:
            self.output.add(*output)
        if self.sinks is not None:
            self.sinks.end(masks, raw.get(FIRST_MASS.name))
        if "name_mass" in self.means:
            self.name_baseline.add(name_baseline(batch, masks.name_queries), masks.name_queries.any(-1))
        return out

    def gradients(self, grads: Gradients) -> None:
        """The batch's gradient pass (asked for only with ``causal``): to the causal sums."""
        self.effects.gradients(grads)

    def rerun(self, lm: AttentionLM, batch: StoryBatch, chunk: Sequence[EncodedStory]) -> None:
        """The batch's exact ablations and estimates (asked for only with ``exact``)."""
        self.effects.rerun(lm, batch, chunk)

    def like(self) -> HeadScoreAccumulator:
        """An empty accumulator of the same heads, detectors and columns (a worker's part to merge)."""
        examples = 0 if self.examples is None else self.examples.k
        return HeadScoreAccumulator(
            self.n_layer, self.n_head, self.detectors, faithful=self.faithful, examples=examples,
            **self.effects.settings(),
        )  # fmt: skip

    def update(self, patterns: Sequence[torch.Tensor], batch: StoryBatch) -> dict[str, torch.Tensor]:
        """One batch of whole maps ``[batch, head, query, key]``, one per block (raw scores only)."""
        self.begin(batch)
        masks = Masks(batch, patterns[0].dtype)
        for layer, pattern in enumerate(patterns):
            self.feed(Chunk(layer, 0, pattern, masks))
        return self.end()

    def merge(self, other: HeadScoreAccumulator) -> HeadScoreAccumulator:
        if (other.n_layer, other.n_head) != (self.n_layer, self.n_head) or [d.name for d in other.detectors] != [
            d.name for d in self.detectors
        ]:
            raise ValueError("merge: the accumulators score different heads or detectors")
        if other.faithful != self.faithful or (other.examples is None) != (self.examples is None):
            raise ValueError("merge: one accumulator has the norm-weighted scores or the examples and the other not")
        self.effects.merge(other.effects)
        for k, acc in [*self.means.items(), *(("first/" + k, v) for k, v in self.first.items())]:
            theirs = other.means[k] if not k.startswith("first/") else other.first[k[6:]]
            acc.merge(theirs)
        for k, acc in self.norm.items():
            acc.merge(other.norm[k])
        self.output.merge(other.output)
        if self.sinks is not None and other.sinks is not None:
            self.sinks.merge(other.sinks)
        if self.examples is not None and other.examples is not None:
            self.examples.merge(other.examples)
        self.name_baseline.merge(other.name_baseline)
        return self

    def state(self) -> dict:
        """Every sum and count as plain data (a checkpoint, or what a worker sends to be merged)."""
        return {
            "shape": [self.n_layer, self.n_head],
            "detectors": [d.name for d in self.detectors],
            "means": {k: a.state() for k, a in self.means.items()},
            "first": {k: a.state() for k, a in self.first.items()},
            "norm": {k: a.state() for k, a in self.norm.items()},
            "output": self.output.state(),
            "sinks": None if self.sinks is None else self.sinks.state(),
            "examples": None if self.examples is None else self.examples.state(),
            "name_baseline": self.name_baseline.state(),
            **self.effects.state(),
        }

    def load_state(self, state: dict, max_stories: int | None = None) -> HeadScoreAccumulator:
        """Take the sums and counts of :meth:`state` (the same heads and detectors), every number
        checked (:meth:`MeanAccumulator.from_state`; counts at most ``max_stories``). A state
        that is not what :meth:`state` writes raises ValueError saying which part is wrong."""
        if isinstance(state, dict):  # a state written before the causal (exact) columns has no such part
            state = dict.fromkeys(PARTS) | state
        if not isinstance(state, dict) or set(state) != _STATE_PARTS:
            raise ValueError("state: not an accumulator's state")
        if state["shape"] != [self.n_layer, self.n_head] or state["detectors"] != [d.name for d in self.detectors]:
            raise ValueError("state: other heads or detectors than this accumulator's")
        shape = (self.n_layer, self.n_head)
        parts = {
            "means": (state["means"], self.means),
            "first": (state["first"], self.first),
            "norm": (state["norm"], self.norm),
        }
        loaded: dict[str, dict] = {}
        for part, (given, mine) in parts.items():
            if not isinstance(given, dict) or set(given) != set(mine):
                raise ValueError(f"state: {part} are for other scores ({', '.join(map(str, given)) or 'none'})")
            loaded[part] = {}
            for k, v in given.items():
                loaded[part][k] = _mean_state(f"{part}.{k}", v, shape, max_stories)
        baseline = _mean_state("name_baseline", state["name_baseline"], (), max_stories)
        output = _mean_state("output", state["output"], shape, max_stories, bounded=False)
        examples = None
        if self.examples is not None or state["examples"] is not None:
            if self.examples is None or state["examples"] is None:
                raise ValueError("state: examples kept in one of the state and this accumulator only")
            try:
                examples = TopExamples.from_state(state["examples"])
            except ValueError as e:
                raise ValueError(f"state: {e}") from None
            kept_as = (self.examples.k, self.examples.detectors, self.examples.per_story)
            if (examples.k, examples.detectors, examples.per_story) != kept_as:
                raise ValueError("state: examples of another size or other detectors")
        if (self.sinks is None) != (state["sinks"] is None):
            raise ValueError("state: the sink columns kept in one of the state and this accumulator only")
        if self.sinks is not None:
            try:
                self.sinks = SinkAccumulator(self.n_layer, self.n_head).load_state(state["sinks"], max_stories)
            except ValueError as e:
                raise ValueError(f"state: sinks: {e}") from None
        self.effects.load_state(state, max_stories)
        self.examples = examples
        self.means, self.first, self.norm = loaded["means"], loaded["first"], loaded["norm"]
        self.name_baseline, self.output = baseline, output
        return self

    def columns(self, with_first: bool) -> dict[str, torch.Tensor | None]:
        """Every score as a ``[layer, head]`` float64 tensor (None: not computed); the columns
        derived from a detector's (:mod:`storylens.looking.detectors`) where it was scored."""
        cols: dict[str, torch.Tensor | None] = {k: a.mean() for k, a in self.means.items()}
        mass = cols.get(NAME_MASS.name)
        if mass is not None:
            base = self.name_baseline.mean()
            cols[NAME_BASELINE.name] = base.expand_as(mass)
            cols[NAME_RATIO.name] = mass / base
        for k, a in self.first.items():
            cols[k + FIRST_SUFFIX] = a.mean() if with_first else None
        for k, a in self.norm.items():
            cols[NORM_PREFIX + k] = a.mean()
        norm_mass = cols.get(NORM_PREFIX + NAME_MASS.name)
        if norm_mass is not None and self.norm[NAME_MASS.name].count == self.means[NAME_MASS.name].count:
            # the same stories behind both means (a batch recorded without value vectors would not be)
            cols[NORM_PREFIX + NAME_RATIO.name] = norm_mass / self.name_baseline.mean()
        output = self.output.mean()
        cols[OUTPUT_NORM.name], cols[OUTPUT_SHARE.name] = output, shares(output)
        if self.sinks is not None:
            cols.update(self.sinks.columns())
        cols.update(self.effects.columns())
        return cols
