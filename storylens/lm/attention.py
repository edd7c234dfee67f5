"""storylens's attention function for transformers models: the probabilities formed once per
layer, grouped key/value heads read in place.

transformers' eager attention, the implementation that returns the probabilities, first copies
every key/value head once per query head it serves (``repeat_kv``: a 30 x 9-head Llama with 3
key/value heads copies its keys and values three times per layer) and then multiplies. Here each
group's query heads are stacked on the query axis instead, so one matrix product per group reads
its keys and values where they are:

    query [B, H, T, d] -> [B, G, r*T, d]  (H = G * r query heads, head h in group h // r, as repeat_kv)
    scores = query @ key^T * scaling      [B, G, r*T, S] -> [B, H, T, S]
    probs = softmax(scores + mask)        (in the precision the model's own eager attention uses)
    out = probs @ value                   [B, G, r*T, d] -> [B, T, H, d]

The softmax runs in the precision the model's own eager attention uses: Llama's and GPT-NeoX's
(and every model generated from them) in float32 whatever the input (so in a float64 run their
probabilities are float32-rounded, as transformers' own are), GPT-2's in the input's dtype
(:func:`softmax_dtype`). So the numbers are eager attention's up to the order of a sum. It is
registered with transformers' ``AttentionInterface`` under :data:`NAME`, with sdpa's mask (none
where the attention is plainly causal, so no ``T x S`` mask is built for a long story), and
used by :class:`~storylens.lm.transformers_lm.TransformersLM` for every model that dispatches through
that interface (``_supports_attention_backend``); others keep transformers' eager attention.

**Streamed** (:func:`streaming`, used by :func:`storylens.engine.record.record`): each attention
module the model wrapper wraps holds an :class:`AttentionTap` (:func:`attach`), the kernel's one
consumer, owned by the wrapper (no module-level state). Inside the context a layer's queries are
taken :func:`query_chunk` rows at a time, each chunk's probabilities ``[B, H, rows, keys]`` are
handed to the tap's :class:`RowConsumer` and freed, and the layer returns no map, so one
layer's attention never holds more than a fixed memory budget whatever the story's length (and no
map-sized temporary is ever allocated, the larger part of the cost on a CPU). In inference mode
each chunk's scores and probabilities are written into two buffers the context takes once and reuses
chunk after chunk and layer after layer (:class:`~storylens.core.buffers.Workspace`), so the rows a
consumer is handed are overwritten by the next chunk: it copies what it keeps. The consumer may also
ask for *key weights* (``key_weights(layer) -> [B, H, keys, c]``): they ride along as extra columns of each
group's value matrix (padded to :data:`COLUMN_ALIGN`), so ``rows @ weights`` comes out of the
probabilities-times-values product that runs anyway, handed over with each chunk (with each head's
output at those rows), instead of a pass over the chunk of its own (the name and marker masses, the
norm-weighted row sums). A chunk of queries
``q0 .. q1 - 1`` reads only the keys it can see (``q1 + S - T``: causal), and in inference mode its
rows are taken :data:`SUB_ROWS` at a time, each band's scores, softmax and product with the values
over the keys its own rows see (about half the products and exponentials of a square chunk),
written into the one map handed over, whose keys past a band's rows are set to 0 (:meth:`_Rows.banded`);
so its rows are the full rows' up to the order of the softmax's sum (the scaling is taken inside the one product,
``baddbmm(buffer, q, k^T, beta=0, alpha=scaling)``, and where no mask is given only the corner of
keys ahead of the chunk's queries, ``[rows, rows]``, is set to -inf: no ``[rows, keys]`` mask or
bias is built or read); where the softmax runs in float32 under float64 inputs
(Llama, NeoX) every row is taken at full length instead, so the probabilities stay bit-equal to eager.

**Fused** (:func:`fused`, a count on the same taps, used by :meth:`~storylens.lm.transformers_lm.TransformersLM.forward` whenever no
probabilities are asked for: switching heads off, head output means, perplexity): inside that context
the layer calls transformers' own sdpa attention (``sdpa_attention_forward``, the function the model
runs with ``attn_implementation="sdpa"``, on the same sdpa mask), so a forward pass that reads no
attention costs what the model's own fused forward costs and returns its numbers.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Protocol

import torch
from torch import nn

from storylens.core.buffers import Workspace

NAME = "storylens"
# a streamed chunk's scores at most this (3 such buffers live at once). Each chunk costs every measure a
# fixed few dozen tensor calls besides its reads: at 8 MB (29 query rows of an 8,000-token story on 9
# heads) those were a third of a long story's scoring; at 32 MB they are a few percent
# (benchmarks/bench_long.py)
CHUNK_BYTES = 32 * 2**20

COLUMN_ALIGN = 16  # the value matrix widened by key columns is padded to a multiple of this (BLAS's speed)
SUB_ROWS = 64  # a streamed chunk's products are taken this many query rows at a time (:meth:`_Rows.banded`)
HIDE_ROWS = 32  # the causal corner is hidden this many query rows at a time (:func:`_hide_ahead`)
TAP = "storylens_tap"  # the attribute under which a wrapped model's attention module holds its tap


class RowConsumer(Protocol):
    """What a streamed layer hands its probabilities to, a chunk of query rows at a time."""

    def key_weights(self, layer: int) -> torch.Tensor | None:
        """``[B, H, keys, c]`` key weights to carry through ``probs @ value`` (None: none)."""
        ...

    def rows(
        self, layer: int, probs: torch.Tensor, start: int, masses: torch.Tensor | None, heads: torch.Tensor
    ) -> None:
        """Query rows ``start .. start + n - 1``: ``probs [B, H, n, keys]`` (overwritten by the next
        chunk), ``masses [B, H, n, c]`` (``probs @ key_weights``, or None) and each head's output at
        those rows ``heads [B, H, n, d]`` (what ``hook_z`` would see there)."""
        ...


class AttentionTap:
    """The consumer of one attention module's kernel, owned by the model wrapper (which attaches
    one to each attention module it wraps, :func:`attach`): while a :func:`streaming` context holds
    it, the layer hands its probabilities to ``consumer`` chunk by chunk; while a :func:`fused`
    context holds it, the layer runs transformers' sdpa attention."""

    def __init__(self, layer: int):
        self.layer = layer
        self.consumer: RowConsumer | None = None
        self.chunk_bytes = CHUNK_BYTES
        self.buffers = Workspace()
        self.fused = 0  # how many fused() contexts hold it
        self.riding = False  # streamed on another pass's forward (streaming(riding=True))


def attach(modules: Sequence[nn.Module]) -> list[AttentionTap]:
    """One tap per attention module (``modules[i]`` is block ``i``), kept on the module itself (a
    module wrapped twice keeps its tap)."""
    taps = []
    for i, m in enumerate(modules):
        tap = m.__dict__.get(TAP)
        if not isinstance(tap, AttentionTap):
            tap = AttentionTap(i)
            object.__setattr__(m, TAP, tap)  # a plain attribute, not a submodule: no state, no repr
        taps.append(tap)
    return taps


def _tap(module: nn.Module) -> AttentionTap | None:
    tap = module.__dict__.get(TAP)
    return tap if isinstance(tap, AttentionTap) else None


@contextmanager
def fused(taps: Sequence[AttentionTap]) -> Iterator[None]:
    """Inside: the attention of these taps' modules runs transformers' sdpa attention and returns no
    probabilities (see the module docstring); a streamed module still streams."""
    for tap in taps:
        tap.fused += 1
    try:
        yield
    finally:
        for tap in taps:
            tap.fused -= 1


@cache
def _sdpa() -> Callable[..., tuple[torch.Tensor, None]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


@contextmanager
def streaming(
    taps: Sequence[AttentionTap], consumer: RowConsumer, chunk_bytes: int = CHUNK_BYTES, riding: bool = False
) -> Iterator[None]:
    """Inside: the attention of each tap's module hands its probabilities to ``consumer.rows`` chunk by
    chunk and returns none (see the module docstring; the rows are overwritten by the next chunk),
    with ``consumer.key_weights(layer)`` carried through the product of the probabilities and the
    values (extra columns of each group's value matrix, so no pass over the probabilities of their own).
    ``riding``: the recording rides on a forward run outside inference mode for its own ends (the
    gradient pass's): there each layer streams its rows in inference mode from its inputs detached, as a
    recording does, and returns transformers' sdpa output of those inputs (with their graph where
    autograd records), what that forward would get with nothing streamed, so the two runs are one."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: must be at least 1, got {chunk_bytes}")
    if any(tap.consumer is not None for tap in taps):
        raise RuntimeError("streaming(): these attention modules are already streamed")
    buffers = Workspace()  # one for every layer: chunk after chunk and layer after layer
    for tap in taps:
        tap.consumer, tap.chunk_bytes, tap.buffers, tap.riding = consumer, chunk_bytes, buffers, riding
    try:
        yield
    finally:
        for tap in taps:
            tap.consumer, tap.buffers, tap.riding = None, Workspace(), False


def query_chunk(batch: int, heads: int, keys: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many query rows of ``[batch, heads, rows, keys]`` scores fit in ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // max(1, batch * heads * keys * itemsize))


@cache
def _eager_upcasts(module_name: str) -> bool:
    """Whether the modeling file's own ``eager_attention_forward`` takes its softmax in float32
    (``softmax(..., dtype=torch.float32)``, Llama's and NeoX's) rather than in the input's dtype (GPT-2's)."""
    eager = getattr(sys.modules.get(module_name), "eager_attention_forward", None)
    try:
        return eager is not None and "dtype=torch.float32" in inspect.getsource(eager)
    except (OSError, TypeError):
        return True


def softmax_dtype(module: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``module``'s own eager attention takes its softmax in, for inputs of ``dtype``."""
    return torch.float32 if _eager_upcasts(type(module).__module__) else dtype


def grouped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer's attention: ``(output [B, T, H, d], probabilities [B, H, T, S])`` (streamed: no
    probabilities, they went to the sink)."""
    B, H, T, d = query.shape
    G, S = key.shape[1], key.shape[2]
    if H % G:
        raise ValueError(f"{H} query heads cannot share {G} key/value heads evenly")
    scaling = d**-0.5 if scaling is None else scaling
    tap = _tap(module)
    if tap is not None and tap.consumer is not None and not (dropout and module.training):
        if tap.riding and not torch.is_inference_mode_enabled():  # the recording rides on a pass with autograd
            with torch.inference_mode():
                _streamed(
                    module, query.detach(), key.detach(), value.detach(), attention_mask, scaling, tap, tap.consumer
                )
            return _sdpa()(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        return _streamed(module, query, key, value, attention_mask, scaling, tap, tap.consumer), None
    if tap is not None and tap.fused:
        return _sdpa()(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    q = query.reshape(B, G, (H // G) * T, d)  # each group's query heads stacked on the query axis
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scaling).view(B, H, T, S)
    if attention_mask is not None:
        scores = _masked(scores, attention_mask[..., :S], in_place=False)
    elif T > 1:  # no mask given: causal, the queries being the last T of the S positions
        keep = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril(S - T)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype(module, query.dtype))
    probs = probs.to(value.dtype)
    if dropout and module.training:
        probs = nn.functional.dropout(probs, p=dropout)
    out = torch.matmul(probs.view(B, G, (H // G) * T, S), value).view(B, H, T, d)
    return out.transpose(1, 2), probs


def _masked(scores: torch.Tensor, mask: torch.Tensor, *, in_place: bool) -> torch.Tensor:
    """``scores`` under transformers' mask: a boolean one (sdpa's: True attends) sets the rest to the
    dtype's lowest value, as eager's float mask does; a float one is added."""
    if mask.dtype == torch.bool:
        low = torch.finfo(scores.dtype).min
        return scores.masked_fill_(~mask, low) if in_place else scores.masked_fill(~mask, low)
    return scores.add_(mask) if in_place else scores + mask


def _streamed(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    tap: AttentionTap,
    consumer: RowConsumer,
) -> torch.Tensor:
    """:func:`grouped_attention`'s output ``[B, T, H, d]``, the probabilities handed to ``consumer`` a
    chunk of queries at a time (the module docstring)."""
    B, H, T, d = query.shape
    G, S = key.shape[1], key.shape[2]
    r = H // G  # query heads per key/value head; the queries are the last T of the S positions
    soft = softmax_dtype(module, query.dtype)
    full_rows = soft != query.dtype and query.dtype == torch.float64  # keep eager's rows bit for bit
    itemsize = max(torch.finfo(soft).bits, torch.finfo(query.dtype).bits) // 8
    layer, buffers = tap.layer, tap.buffers
    rows = query_chunk(B, H, S, itemsize, tap.chunk_bytes)
    grouped = query.view(B, G, r, T, d)
    # transformers hands keys and values in [B, S, G, d] memory: made contiguous once here, not copied
    # again by every band's product (a band's k^T and values are then views BLAS reads in place)
    key = key.contiguous()
    # [B, G, r, T, d] over [B, T, H, d] memory: the output handed back is the layout the output
    # projection reads, with no copy
    out = torch.empty(B, T, G, r, d, dtype=value.dtype, device=value.device).permute(0, 2, 3, 1, 4)
    extra = consumer.key_weights(layer)
    c = 0
    if extra is not None:  # each group's values widened by its heads' key columns: [B, G, S, d + r * c + pad]
        if extra.shape[:3] != (B, H, S):
            raise ValueError(f"key weights: shape {tuple(extra.shape)}; expected [{B}, {H}, {S}, c]")
        c = extra.shape[-1]
        packed = extra.to(value.dtype).view(B, G, r, S, c).permute(0, 1, 3, 2, 4).reshape(B, G, S, r * c)
        pad = -(d + r * c) % COLUMN_ALIGN
        value = torch.cat([value, packed, value.new_zeros(B, G, S, pad)], -1)
    value = value.contiguous()
    reuse = torch.is_inference_mode_enabled()  # out= products record no gradient
    room = B * H * min(rows, T) * S  # the largest chunk: the buffers are taken at that size once
    rowed = _Rows(grouped, key, value, attention_mask, scaling, soft, full_rows, buffers if reuse else None, room)
    for q0 in range(0, T, rows):
        q1 = min(T, q0 + rows)
        n = q1 - q0
        probs, moved = rowed.chunk(q0, q1)  # [B, H, n, keys], [B, G, r*n, width]
        masses = None
        if extra is not None:  # head i of a group: its rows (i*n ..) times its own columns (d + i*c ..)
            wide = moved[..., d : d + r * c].view(B, G, r, n, r, c)
            masses = wide.diagonal(dim1=2, dim2=4).permute(0, 1, 4, 2, 3).reshape(B, H, n, c)
        out[:, :, :, q0:q1] = moved[..., :d].view(B, G, r, n, d)
        # each head's output at these rows, in inference as a view of the output: [B, T, H, d] memory, so
        # a block taken in one chunk is handed over in the layout the head outputs' images read with no
        # copy (under autograd a view of the product: the next chunk's rows written into the output
        # would mark a view of it modified for a consumer's backward)
        heads = (out[:, :, :, q0:q1] if reuse else moved[..., :d]).reshape(B, H, n, d)
        consumer.rows(layer, probs, q0, masses, heads)
        del probs, moved, masses, heads
    return out.view(B, H, T, d).transpose(1, 2)


@dataclass(frozen=True)
class _Rows:
    """One layer's queries ``grouped [B, G, r, T, d]`` against its keys and (widened) values: the
    probabilities and the products of a chunk of query rows (:func:`_streamed`). ``buffers``: the
    workspace the scores and probabilities are written into (None: fresh tensors, as autograd needs)."""

    grouped: torch.Tensor
    key: torch.Tensor  # [B, G, S, d]
    value: torch.Tensor  # [B, G, S, width]
    mask: torch.Tensor | None
    scaling: float
    soft: torch.dtype  # the softmax's dtype
    full_rows: bool  # every row over every key (else each over the keys up to its chunk's last row's)
    buffers: Workspace | None
    room: int

    @property
    def past(self) -> int:  # S - T: the keys before the first query
        return self.key.shape[2] - self.grouped.shape[3]

    def probs(self, a: int, b: int, keys: int, name: str, room: int) -> torch.Tensor:
        """``[B, H, b - a, keys]`` in the softmax's dtype: queries ``a .. b - 1`` over keys ``0 ..
        keys - 1``, into workspace buffer ``name`` (and the scores into "scores"), each made with
        ``room`` elements where it must grow."""
        B, G, r, _, d = self.grouped.shape
        n, H, past = b - a, G * r, self.past
        q = self.grouped[:, :, :, a:b].reshape(B, G, r * n, d)
        k_t = self.key[:, :, :keys].transpose(-1, -2)  # [B, G, d, keys]
        # scores = scaling * q k^T in one product (beta=0: what the buffer held is ignored)
        q3, k3 = q.reshape(B * G, r * n, d), k_t.reshape(B * G, d, keys)
        if self.buffers is None:
            scores = torch.baddbmm(q3.new_empty(B * G, r * n, keys), q3, k3, beta=0, alpha=self.scaling)
        else:
            flat = self.buffers.take("scores", (B * G, r * n, keys), q.dtype, q.device, room)
            scores = torch.baddbmm(flat, q3, k3, beta=0, alpha=self.scaling, out=flat)
        if self.mask is None and keys > a + past + 1:  # no mask given: causal, hiding only what is ahead
            _hide_ahead(scores.view(B, G, r, n, keys), keys - (a + past))
        per_head = scores.view(B, H, n, keys)
        if self.mask is not None:
            _masked(per_head, self.mask[:, :, a:b, :keys], in_place=True)
        if self.buffers is not None and self.soft == per_head.dtype:  # [B, H, n, keys]
            place = self.buffers.take(name, (B, H, n, keys), self.soft, q.device, room)
            return torch.ops.aten._softmax.out(per_head, -1, False, out=place)
        return torch.softmax(per_head, dim=-1, dtype=self.soft)

    def chunk(self, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``q0 .. q1 - 1``: :meth:`banded` in bands of :data:`SUB_ROWS` rows where the workspace
        holds the map (inference) and rows need not be whole, else :meth:`whole`."""
        if self.buffers is not None and not self.full_rows and q1 - q0 > SUB_ROWS:
            return self.banded(q0, q1, SUB_ROWS)
        return self.whole(q0, q1)

    def whole(self, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``q0 .. q1 - 1`` over every key up to the last one's, in one product:
        ``(probs [B, H, n, keys], probs @ value [B, G, r * n, width])``."""
        B, G, r, _, _ = self.grouped.shape
        n, keys = q1 - q0, (self.key.shape[2] if self.full_rows else q1 + self.past)
        probs = self.probs(q0, q1, keys, "probs", self.room).to(self.value.dtype)
        return probs, torch.matmul(probs.view(B, G, r * n, keys), self.value[:, :, :keys])

    def banded(self, q0: int, q1: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`whole`, the rows taken ``step`` at a time, each band over the keys its own rows see
        (causal: about half the products and exponentials of a square chunk), written into one map
        whose keys past a band's last row hold 0, as the softmax leaves them."""
        assert self.buffers is not None  # (inference only: the bands are written into the map)
        B, G, r, _, _ = self.grouped.shape
        n, keys, width, past = q1 - q0, q1 + self.past, self.value.shape[-1], self.past
        dtype, device = self.value.dtype, self.value.device
        probs = self.buffers.take("probs", (B, G * r, n, keys), dtype, device, self.room)
        moved = torch.empty(B, G, r, n, width, dtype=dtype, device=device)
        room = B * G * r * step * self.key.shape[2]  # a band's scores at most: no chunk-sized scores buffer
        for a in range(q0, q1, step):
            b = min(q1, a + step)
            m, seen = b - a, b + past
            band = self.probs(a, b, seen, "band", room).to(dtype)  # [B, H, m, seen]
            probs[:, :, a - q0 : b - q0, :seen] = band
            probs[:, :, a - q0 : b - q0, seen:] = 0
            product = torch.matmul(band.view(B, G, r * m, seen), self.value[:, :, :seen])  # [B, G, r*m, width]
            moved[:, :, :, a - q0 : b - q0] = product.view(B, G, r, m, width)
        return probs, moved.view(B, G, r * n, width)


def _hide_ahead(scores: torch.Tensor, width: int) -> None:
    """Set the keys ahead of each query to -inf, in place: ``scores [..., n, keys]`` holds query rows
    whose first sees the keys up to ``keys - width`` (the last ``width`` columns hold the first row's
    own key and the keys after it), row ``i`` seeing ``i`` more. Only that ``[n, width]`` corner is
    touched, not a ``[n, keys]`` mask, and it a band of :data:`HIDE_ROWS` rows at a time: the keys
    past a band's last row are hidden from all of it (a plain fill, no mask read), only the band's
    own ``[rows, rows]`` triangle is masked (a masked fill is several times slower per entry than a
    fill on a CPU; the entries set are the same)."""
    n = scores.shape[-2]
    corner = scores[..., -width:]  # [..., n, width]: row i sees corner columns 0 .. i
    ahead = _ahead(scores.device)
    for i0 in range(0, n, HIDE_ROWS):
        i1 = min(n, i0 + HIDE_ROWS)
        corner[..., i0:i1, i1:].fill_(float("-inf"))  # past the band's last row
        corner[..., i0:i1, i0:i1].masked_fill_(ahead[: i1 - i0, : i1 - i0], float("-inf"))


@cache
def _ahead(device: torch.device) -> torch.Tensor:
    """``[HIDE_ROWS, HIDE_ROWS]`` bool: True above the diagonal (the keys ahead of each row of a band), made once
    per device (never written: :func:`_hide_ahead` reads it), outside inference mode: a normal tensor, which a
    pass with autograd may save for its backward."""
    with torch.inference_mode(False):
        return torch.ones(HIDE_ROWS, HIDE_ROWS, dtype=torch.bool, device=device).triu(1)


def register() -> bool:
    """Register :func:`grouped_attention` (and sdpa's mask) with transformers under :data:`NAME`;
    False where this transformers has no attention interface (then eager attention is used)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(NAME, grouped_attention)
    # sdpa's mask: none at all where the attention is plainly causal (no T x S tensor for a long
    # story), a boolean one where padding or a window needs it
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return True
