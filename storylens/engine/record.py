"""The one recording driver: run the stories through the model once, in batches, and hand every
block's attention to every measure the moment it exists, as :class:`Chunk` objects.

**The contract.** A *measure* (:class:`Measure`) declares what it needs in ``needs``
(:class:`Needs`) and implements three methods:

``begin(batch)``
    a new :class:`~storylens.engine.encode.StoryBatch` is about to run;
``feed(chunk)``
    a :class:`Chunk` of block ``chunk.layer``'s attention: query rows ``chunk.start ..`` of its
    probabilities ``[batch, head, n, keys]`` over the keys they see, with the batch's masks cut to
    those rows and whatever the measure's ``needs`` asked for. A block's chunks come in order and
    cover every query once; a whole map is one chunk (``start == 0``);
``end()``
    the batch is done.

Nothing else is looked up on a measure: what it needs is read from its declaration, once.

**The plan** (:func:`plan`, which :func:`record` follows): when every measure streams
(``Needs.streams``) and the model forms its maps in storylens's own attention
(:func:`storylens.lm.attention.streaming`), blocks are handed over a chunk of query rows at a time
and no block's whole map ever exists: memory stays within a fixed budget whatever the story's
length. The chunk's probabilities are written, in inference mode, into memory reused for the next
chunk: read them, and copy what you keep. The named key columns the measures ask for
(:class:`KeyColumn`, deduplicated by name) are then carried through the attention's own
``probs @ V`` product (extra columns of the value matrix) and come back in ``chunk.columns``. Else
(a measure that does not stream, a model whose attention cannot) every block's whole map is handed
over as one chunk from ``hook_pattern``, and ``chunk.columns`` is empty: a measure forms what it
needs from ``chunk.probs``.

``key_norms`` (:mod:`storylens.engine.images`): ``|f_j|`` for every key (each value vector
through its head's slice of the output projection, from ``hook_v``); ``outputs``: the size of what
each head writes at each of the chunk's queries ``|sum_j alpha_ij f_j|`` (from the head outputs the
streamed kernel forms with the chunk, or from ``hook_z``), and ``output_vectors`` the vectors
themselves in an orthonormal frame of each head's output space (``k <= head size`` numbers instead of
``d_model``; lengths, distances and means are the residual stream's). Where the model's value
vectors or output weights cannot be read, they stay None (the plan says why).

**Gradients.** A measure whose ``needs.gradients`` is set (:class:`GradientMeasure`, e.g.
:class:`storylens.effects.attribution.CausalAccumulator`) gets, per batch and block (the last block
first), ``gradients(grads)``: from :func:`storylens.engine.gradients.gradient_pass`, one forward
with the model's fused attention (no map formed) and one backward of the batch's summed next-token
loss, run block by block so that one block's activations exist at a time, no weight gradients; each
hands a block's head outputs ``z`` and ``dL/dz``, the final norm's scale and the batch
(:class:`storylens.engine.gradients.Gradients`).
``plan().gradients`` says so; where no measure reads attention (``Needs(attention=False)``) the
recording forward is skipped. Where some measure does and the maps stream, the recording rides on the
gradient pass's first forward (:class:`~storylens.engine.gradients.Riding`): each layer streams its rows
in inference mode from its queries, keys and values detached and hands the fused kernel's output on, so
the batch runs through the model once for both, the gradients are bit for bit those of the pass alone,
and the rows those of the fused forward's hidden states (a recording of its own reads the explicit
attention's: the same to rounding).

**Reruns.** A measure whose ``needs.reruns`` is set (:class:`RerunMeasure`, e.g.
:class:`storylens.effects.exact.ExactMeasure`, every head's exact ablation) gets, per batch and after
the gradient pass, ``rerun(lm, batch, chunk)``: it runs its own passes over the batch with no recording
hook on (``chunk``: the encoded stories the batch was cut from, for a measure that draws from them).

So ``storylens report --beyond`` records the quiz once and feeds the head scores, the position
control and the pronoun measure from the same patterns (the latter two take whole maps).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from functools import reduce
from typing import Any, Protocol, cast

import torch
from tqdm.auto import tqdm

from storylens.core.batching import BATCH_TOKENS
from storylens.core.errors import StorylensError
from storylens.core.modes import eval_mode
from storylens.core.text import checked_stories, not_stories
from storylens.data.names import name_vocabulary
from storylens.engine.encode import (
    CHUNK_STORIES,
    EncodedStory,
    StoryBatch,
    batch_of,
    is_encoded,
    iter_encoded,
    length_batches,
)
from storylens.engine.gradients import GRAPH_BYTES, Gradients, Riding, gradient_pass
from storylens.engine.images import head_images, key_norms, ov_factor
from storylens.engine.masks import Masks
from storylens.lm import AttentionLM, Hook, HookFn


@dataclass(frozen=True)
class KeyColumn:
    """A named key column a measure wants summed under each query's attention: ``weights(masks,
    key_norms) -> [batch, 1 or head, keys]`` (the whole batch's masks; ``key_norms [batch, head,
    keys]`` or None), or None where it cannot be formed (it needs key norms and there are none)."""

    name: str
    weights: Callable[[Masks, torch.Tensor | None], torch.Tensor | None]


@dataclass(frozen=True)
class Needs:
    """What a measure needs handed with each chunk, besides the probabilities and the masks."""

    columns: tuple[KeyColumn, ...] = ()  # key columns whose attention-weighted sums it reads (chunk.columns)
    key_norms: bool = False  # |f_j| of every key (chunk.key_norms)
    outputs: bool = (
        False  # what each head writes at each query: its size and its vector (chunk.outputs, .output_vectors)
    )
    streams: bool = True  # it can take a block's map a chunk of query rows at a time (else: whole maps)
    # the gradient pass's Gradients per batch and block (storylens.engine.gradients), to gradients(grads)
    gradients: bool = False
    attention: bool = True  # it reads attention (False: no recording forward is run for it)
    # with gradients: what the first blocks' graphs may hold to skip their reruns (gradients.gradient_pass)
    graph_bytes: int = GRAPH_BYTES
    # passes of its own over each batch (e.g. ablations), to rerun(lm, batch, chunk), with no recording hook
    reruns: bool = False


@dataclass(frozen=True)
class Chunk:
    """Query rows ``start .. start + n - 1`` of block ``layer``'s attention (a whole map: ``start == 0``
    and ``n == keys``), and what the measures' :class:`Needs` asked for."""

    layer: int
    start: int  # the first query row
    probs: torch.Tensor  # [batch, head, n, keys]: the rows over the keys they see
    masks: Masks  # the batch's masks cut to these rows and keys
    columns: Mapping[str, torch.Tensor] = field(default_factory=dict)  # name -> [batch, head, n], from probs @ V
    key_norms: torch.Tensor | None = None  # [batch, head, keys]: |f_j| (asked for, and readable)
    outputs: torch.Tensor | None = None  # [batch, head, n]: |sum_j alpha_ij f_j| (asked for, and readable)
    # [batch, head, n, k]: sum_j alpha_ij f_j itself, in an orthonormal frame of the head's output space
    # (storylens.engine.images.head_images): every length, distance and mean as in the residual stream
    output_vectors: torch.Tensor | None = None

    @property
    def stop(self) -> int:
        return self.start + self.probs.shape[-2]


class Measure(Protocol):
    """Fed by :func:`record` (see the module docstring)."""

    @property
    def needs(self) -> Needs: ...

    def begin(self, batch: StoryBatch) -> None: ...

    def feed(self, chunk: Chunk) -> None: ...

    def end(self) -> object: ...  # what it returns is not read


class GradientMeasure(Measure, Protocol):
    """A measure whose ``needs.gradients`` is set: after the batch's recording forward (if any
    measure reads attention) it gets ``gradients(grads)`` once per block, the last block first, with
    that block's :class:`storylens.engine.gradients.Gradients` (one fused forward and one backward)."""

    def gradients(self, grads: Any) -> None: ...


class RerunMeasure(Measure, Protocol):
    """A measure whose ``needs.reruns`` is set: after the batch's recording forward and gradient pass
    it gets ``rerun(lm, batch, chunk)`` once, to run passes of its own over the batch (no recording
    hook is on), ``chunk`` the encoded stories the batch was cut from (in order)."""

    def rerun(self, lm: AttentionLM, batch: StoryBatch, chunk: Sequence[EncodedStory]) -> None: ...


class Rerun:
    """A :class:`RerunMeasure` that reads no attention: its work is all in ``rerun`` (define it)."""

    needs = Needs(attention=False, reruns=True)

    def rerun(self, lm: AttentionLM, batch: StoryBatch, chunk: Sequence[EncodedStory]) -> None:
        raise NotImplementedError

    def begin(self, batch: StoryBatch) -> None:
        pass

    def feed(self, chunk: Chunk) -> None:
        pass

    def end(self) -> None:
        pass


class Counter:
    """A measure that reads no attention: ``update(stories)`` after every batch (how a progress
    line, :class:`~storylens.core.progress.ProgressLines`, counts a recording)."""

    needs = Needs(attention=False)

    def __init__(self, update: Callable[[int], None]):
        self.update, self._stories = update, 0

    def begin(self, batch: StoryBatch) -> None:
        self._stories = len(batch.ids)

    def feed(self, chunk: Chunk) -> None:
        pass

    def end(self) -> None:
        self.update(self._stories)


@dataclass(frozen=True)
class Plan:
    """How a recording pass feeds its measures, and why."""

    streamed: bool  # chunks of query rows from storylens's attention (else whole maps from hook_pattern)
    why: str  # why streamed or not
    columns: tuple[KeyColumn, ...]  # every key column asked for, once each (formed in probs @ V when streamed)
    key_norms: bool  # |f_j| handed over
    outputs: bool  # head output sizes handed over
    no_norms: str | None = None  # why key norms and outputs were asked for but cannot be read
    gradients: bool = False  # one fused forward+backward per batch too (storylens.effects.attribution.gradients)
    attention: bool = True  # the recording forward runs (some measure reads attention)
    graph_bytes: int = GRAPH_BYTES  # the gradient pass's kept graphs at most (the least any measure allows)
    reruns: bool = False  # some measure runs passes of its own over each batch (RerunMeasure)

    @property
    def per_batch(self) -> bool:
        """The recording's hooks live for each batch's recording forward only (other passes follow it)."""
        return self.gradients or self.reruns


def plan(lm: AttentionLM, measures: Sequence[Measure]) -> Plan:
    """The plan of :func:`record` for ``measures`` on ``lm`` (see the module docstring)."""
    needs = [m.needs for m in measures]
    columns: dict[str, KeyColumn] = {}  # by name, the first measure's, in the order asked
    for n in needs:
        for c in n.columns:
            columns.setdefault(c.name, c)
    wanted = any(n.key_norms or n.outputs for n in needs)
    no_norms = lm.moving_unsupported() if wanted else None
    whole = [type(m).__name__ for m, n in zip(measures, needs) if not n.streams]
    if whole:
        streamed, why = False, f"whole maps: {', '.join(whole)} cannot take chunks of rows"
    elif not lm.can_stream():
        streamed, why = False, f"whole maps: {lm.name}'s attention cannot stream"
    else:
        streamed, why = True, "chunks of rows: every measure streams and the model's attention can"
    readable = no_norms is None
    key, out = any(n.key_norms for n in needs) and readable, any(n.outputs for n in needs) and readable
    grads, attention = any(n.gradients for n in needs), any(n.attention for n in needs)
    graph = min([n.graph_bytes for n in needs if n.gradients], default=GRAPH_BYTES)
    reruns = any(n.reruns for n in needs)
    return Plan(
        streamed, why, tuple(columns.values()) if streamed else (), key, out, no_norms, grads, attention, graph, reruns
    )


@dataclass(frozen=True)
class RecordStats:
    n_stories: int
    n_cut: int  # stories cut to the window
    n_main_character: int  # stories with a main character

    def __add__(self, other: RecordStats) -> RecordStats:
        return RecordStats(
            self.n_stories + other.n_stories, self.n_cut + other.n_cut, self.n_main_character + other.n_main_character
        )


class _Pass:
    """One recording's wiring: turns what the model hands over (hooks, or the streamed kernel's rows)
    into :class:`Chunk` objects for every measure, per :class:`Plan`."""

    def __init__(self, lm: AttentionLM, measures: Sequence[Measure], chosen: Plan):
        self.lm, self.measures, self.plan = lm, measures, chosen
        self.factors: list[torch.Tensor] = []  # per block, the output weights' factor (storylens.engine.images)
        if chosen.key_norms or chosen.outputs:
            with torch.inference_mode():
                self.factors = [ov_factor(lm.head_output_weights(i).detach()) for i in range(lm.n_layer)]
        self.masks: Masks | None = None
        self.norms: dict[int, torch.Tensor] = {}  # per block, |f_j| [B, H, keys] (from hook_v)
        self.waiting: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}  # whole map, output vectors
        self.formed: list[str] = []  # the key columns in the streamed kernel's masses, in order

    def context(self, riding: bool = False) -> ExitStack:
        """The model's hooks, and the streamed attention if planned (``riding``: on the gradient pass's
        first forward, run outside inference mode, :class:`~storylens.engine.gradients.Riding`; streamed
        plans only: the hooks' work is then done in inference mode on their tensors detached, as the
        streamed rows are)."""
        lm, chosen, n = self.lm, self.plan, self.lm.n_layer
        hooks: list[tuple[str, HookFn]] = []
        if not chosen.streamed:
            hooks += [(f"blocks.{i}.attn.hook_pattern", self._pattern) for i in range(n)]
            if chosen.outputs:
                hooks += [(f"blocks.{i}.attn.hook_z", self._outputs) for i in range(n)]
        if chosen.key_norms:
            hooks += [
                (f"blocks.{i}.attn.hook_v", _in_inference(self._values) if riding else self._values) for i in range(n)
            ]
        stack = ExitStack()
        stack.enter_context(lm.hooks(hooks))
        if chosen.streamed:
            stack.enter_context(lm.streaming(self, riding))
        return stack

    def rides(self) -> bool:
        """Whether the recording forward rides on the gradient pass's first forward (one run of the batch
        through the model for both): where both run and the maps stream."""
        return self.plan.gradients and self.plan.attention and self.plan.streamed

    def run(self, batch: StoryBatch, chunk: Sequence[EncodedStory] = ()) -> None:
        self.masks, self.norms, self.waiting = Masks(batch, self.lm.dtype), {}, {}
        for m in self.measures:
            m.begin(batch)
        rides = self.rides()
        if (self.plan.attention or not self.plan.per_batch) and not rides:
            # with a gradient pass or reruns, the hooks and streaming live for this forward only: those
            # passes run the model's own attention, handing no rows to any measure
            with self.context() if self.plan.per_batch else contextlib.nullcontext():
                self._forward(batch.ids)
        if self.plan.gradients:
            takers = [cast(GradientMeasure, m) for m in self.measures if m.needs.gradients]

            def hand(grads: Gradients) -> None:
                for t in takers:
                    t.gradients(grads)

            riding = Riding(lambda: self.context(riding=True), lambda: self._alone(batch.ids)) if rides else None
            gradient_pass(self.lm, batch, hand, self.plan.graph_bytes, riding)
        for m in self.measures:
            if m.needs.reruns:
                cast(RerunMeasure, m).rerun(self.lm, batch, chunk)
        for m in self.measures:
            m.end()
        self.masks = None

    def _alone(self, ids: torch.Tensor) -> None:
        """The recording forward on its own, in inference mode (where the gradient pass has no forward to ride)."""
        with torch.inference_mode(), self.context():
            self._forward(ids)

    def _forward(self, ids: torch.Tensor) -> None:
        """The recording forward. Streamed, it stops at the last block's head outputs (``hook_z``, the
        output projection's input): every chunk of every map has been handed over by then, and nothing
        after it (that block's output projection and MLP, the final norm) is read by any measure (whole
        maps arrive after the attention module returns: those run to the end)."""
        if not self.plan.streamed:
            self.lm.forward(ids, record_attention=True, logits=False)
            return
        try:
            with self.lm.hooks([(f"blocks.{self.lm.n_layer - 1}.attn.hook_z", _stop)]):
                self.lm.forward(ids, record_attention=True, logits=False)
        except _Done:
            pass

    def _masks(self, probs: torch.Tensor) -> Masks:
        if self.masks is None:
            raise RuntimeError("record: attention outside a batch")
        if self.masks.dtype != probs.dtype:
            self.masks = Masks(self.masks.batch, probs.dtype)
        return self.masks

    def _feed(self, chunk: Chunk) -> None:
        for m in self.measures:
            m.feed(chunk)

    # --- hooks
    def _values(self, v: torch.Tensor, hook: Hook) -> None:
        self.norms[hook.layer] = key_norms(v, self.factors[hook.layer])

    def _pattern(self, pattern: torch.Tensor, hook: Hook) -> None:
        self._whole(hook.layer, pattern, None)

    def _outputs(self, z: torch.Tensor, hook: Hook) -> None:
        self._whole(hook.layer, None, head_images(z, self.factors[hook.layer]))

    def _whole(self, layer: int, pattern: torch.Tensor | None, vectors: torch.Tensor | None) -> None:
        """A whole map is fed once its head outputs are in too (``hook_z`` fires before or after it)."""
        if self.plan.outputs:
            held = self.waiting.pop(layer, (None, None))
            pattern, vectors = pattern if pattern is not None else held[0], vectors if vectors is not None else held[1]
            if pattern is None or vectors is None:
                self.waiting[layer] = (pattern, vectors)
                return
        assert pattern is not None
        norms = self.norms.pop(layer, None) if self.plan.key_norms else None
        outputs = None if vectors is None else torch.linalg.vector_norm(vectors, dim=-1)
        self._feed(Chunk(layer, 0, pattern, self._masks(pattern), {}, norms, outputs, vectors))

    # --- the streamed kernel's consumer (storylens.lm.attention.RowConsumer)
    def key_weights(self, layer: int) -> torch.Tensor | None:
        if not self.plan.columns or self.masks is None:
            return None
        masks, norms = self.masks, self.norms.get(layer)
        B, T = masks.batch.ids.shape
        formed = [(c.name, c.weights(masks, norms)) for c in self.plan.columns]
        self.formed = [name for name, w in formed if w is not None]
        weights = [w for _, w in formed if w is not None]
        if not weights:
            return None
        dtype = reduce(torch.promote_types, [w.dtype for w in weights])
        return torch.stack([w.to(dtype).expand(B, self.lm.n_head, T) for w in weights], -1)  # [B, H, T, c]

    def rows(
        self, layer: int, probs: torch.Tensor, start: int, masses: torch.Tensor | None, heads: torch.Tensor
    ) -> None:
        n, keys = probs.shape[-2], probs.shape[-1]
        masks = self._masks(probs)
        columns = {} if masses is None else {name: masses[..., i] for i, name in enumerate(self.formed)}
        norms = self.norms.get(layer) if self.plan.key_norms else None
        if start + n >= masks.batch.ids.shape[1] and norms is not None:  # the block's last rows: its norms go
            del self.norms[layer]
        vectors = head_images(heads.transpose(1, 2), self.factors[layer]) if self.plan.outputs else None
        outputs = None if vectors is None else torch.linalg.vector_norm(vectors, dim=-1)
        masks = masks.rows(start, start + n, keys)
        key = None if norms is None else norms[..., :keys]
        self._feed(Chunk(layer, start, probs, masks, columns, key, outputs, vectors))


def _in_inference(fn: HookFn) -> HookFn:
    """``fn`` run in inference mode on its tensor detached (a hook of a recording riding on a pass with autograd)."""

    def run(t: torch.Tensor, hook: Hook) -> Any:
        with torch.inference_mode():
            return fn(t.detach(), hook)

    return run


class _Done(Exception):
    """Raised at the last block's head outputs by a streamed recording: the rest is not read."""


def _stop(_out: torch.Tensor, _hook: Hook) -> None:
    raise _Done


def _unless(per_batch: bool, context: Callable[[], ExitStack]) -> AbstractContextManager:
    """The wiring's context around the whole run, unless it is entered per batch (a gradient pass, reruns)."""
    return contextlib.nullcontext() if per_batch else context()


def _check(stories: Iterable, batch_size: int, names: frozenset[str] | set[str] | None) -> frozenset[str] | None:
    """Refuse what cannot be recorded; the name vocabulary (a first pass over the texts, if needed)."""
    if problem := not_stories(stories):
        raise StorylensError(problem)
    if isinstance(stories, Sequence) and len(stories) == 0:
        raise StorylensError("stories: nothing to score (empty list)")
    if batch_size < 1:
        raise StorylensError(f"batch_size: must be at least 1, got {batch_size}")
    if isinstance(stories, Sequence) and not is_encoded(stories):
        checked_stories(stories)  # every story a str of valid Unicode, not all empty (the API's misuse in one line)
    if names is None and not is_encoded(stories):
        if not isinstance(stories, Sequence):
            raise StorylensError("stories: a stream is read once; pass names (a first pass over it)")
        return frozenset(name_vocabulary(stories))
    return None if names is None else frozenset(names)


def record(
    lm: AttentionLM,
    stories: Iterable[str] | Iterable[EncodedStory],
    measures: Sequence[Measure],
    *,
    batch_size: int = 16,
    batch_tokens: int | None = BATCH_TOKENS,
    names: frozenset[str] | set[str] | None = None,
    first_limit: int | None = None,
    progress: bool = True,
    chunk_stories: int = CHUNK_STORIES,
    start: int = 0,
    total: int | None = None,
    on_chunk: Callable[[RecordStats], None] | None = None,
) -> RecordStats:
    """Run ``stories`` (texts, or :class:`~storylens.engine.encode.EncodedStory` records already
    encoded) through ``lm`` once, feeding every measure (see the module docstring), in batches
    of at most ``batch_size`` stories and ``batch_tokens`` padded tokens (None: no token limit).

    ``names``: the name vocabulary (default: that of ``stories`` themselves, a first pass over the
    texts, as the lesson defines names; a one-pass stream must bring its own). ``first_limit``:
    batches mark the stories among the first that many (for the lesson's first-100 columns).
    Stories are encoded and batched ``chunk_stories`` at a time, chunk by chunk in order, so the
    same stories always make the same batches; ``start`` is the index of the first story (a run
    resumed after ``start`` stories), ``total`` the count for the progress bar, and
    ``on_chunk(stats so far)`` is called after every chunk (where a long run checkpoints)."""
    names = _check(stories, batch_size, names)
    chosen = plan(lm, measures)
    if chosen.no_norms is not None:  # raw scores still; the norm-weighted columns stay empty
        print(
            f"storylens: note: {chosen.no_norms}; the norm-weighted columns and output norms are left empty",
            file=sys.stderr,
        )
    wiring = _Pass(lm, measures, chosen)
    n = n_cut = n_main = 0
    if total is None and isinstance(stories, Sequence):
        total = start + len(stories)
    bar = tqdm(total=total, initial=start, unit="story", desc="recording attention", disable=None if progress else True)
    with (
        eval_mode(lm.module),
        torch.inference_mode(),
        _unless(chosen.per_batch, wiring.context),
        bar,
    ):  # disable None: terminals only
        for chunk in iter_encoded(lm, stories, names, chunk_stories=chunk_stories, start=start):
            n += len(chunk)
            n_cut += sum(s.cut for s in chunk)
            n_main += sum(s.main is not None for s in chunk)
            for idx in length_batches([len(s.ids) for s in chunk], batch_size, batch_tokens):
                wiring.run(batch_of([chunk[i] for i in idx], lm.marker_id, lm.device, first_limit), chunk)
                bar.update(len(idx))
            if on_chunk is not None:
                on_chunk(RecordStats(n, n_cut, n_main))
    if n == 0:
        raise StorylensError("stories: nothing to score (no story)")
    return RecordStats(n, n_cut, n_main)
