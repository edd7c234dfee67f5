"""The gradient pass (:func:`gradient_pass`) and what it hands a measure that asks for gradients
(:class:`~storylens.engine.record.Needs` ``gradients=True``): one :class:`Gradients` per block and
batch, that block's head outputs and their gradients, and the model's
:class:`~storylens.engine.readout.Readout` (its final norm and unembedding, for direct logit
attribution). :mod:`storylens.engine.record` runs the pass (a recording of the attention may ride on
its first forward, :class:`Riding`), :mod:`storylens.effects.attribution` reads what it hands over.

**Memory.** The backward needs what each block's forward saved (its activations), and holding that
for every block at once grows with the model's depth: on a 3,000-token story, several GB for GPT-2
small. So the pass recomputes, as activation checkpointing does, within a budget (``graph_bytes``,
``storylens score --graph-memory``): a forward keeps the graph of as many of the first blocks as
the budget holds (:func:`_kept`, from what one block's graph holds, :class:`BlockCost`, measured
once per model), only the input of each block after them (one ``[batch, pos, d_model]`` tensor per
block), and a graph for the last block and the model's tail (final norm, unembedding); then, from
the last block but one down to the kept ones, each block is run again from its kept input with a
graph and backpropagated on its own, handing over its ``z`` and ``dL/dz`` and passing
``dL/d(input)`` down; last, the kept blocks are backpropagated together. At any time the kept
blocks' activations and one other block's exist, at the cost of a second forward of every block
but the kept ones and the last (``benchmarks/bench_causal.py`` measures both; a budget of 0 keeps
none: one block's activations at a time). A model whose blocks cannot be rerun this way
(:meth:`~storylens.lm.AttentionLM.blocks` unknown, or a block's rerun output not what the next
block was given) takes one graph through the whole model instead, and a note says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from storylens.core.errors import StorylensError
from storylens.engine.encode import StoryBatch
from storylens.engine.readout import Readout, norm_scale, readout
from storylens.lm import AttentionLM, Hook


@dataclass
class Gradients:
    """One block of one batch's gradient pass (:func:`gradient_pass`): block ``layer``'s head
    outputs ``z [batch, pos, head, d_head]`` and ``grad = dL/dz`` (``L`` the batch's summed next-token
    loss, so each story's rows are its own loss's gradient), the batch, and for DLA the final norm's
    scale ``[batch, pos]`` (the same object for every block of a batch), the model's readout (None:
    not readable) and the block's output weights ``W_O [head, d_head, d_model]``. Blocks come from
    the last to the first, each batch's ``n_layer`` of them before the next batch's."""

    batch: StoryBatch
    layer: int
    z: torch.Tensor
    grad: torch.Tensor
    scale: torch.Tensor | None
    readout: Readout | None
    output_weights: torch.Tensor | None

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``after [B, T]``: positions 1 .. len - 1 (after the opening token); ``predicted [B, T]``:
        positions 0 .. len - 2 (those whose next token is in the story)."""
        ids = self.batch.ids
        t = torch.arange(ids.shape[1], device=ids.device)[None, :]
        lengths = self.batch.lengths.to(ids.device)[:, None]
        return (t >= 1) & (t < lengths), t < lengths - 1


LOSS_ROWS = 256  # positions whose softmax over the vocabulary is formed at once in loss_gradient


def loss_gradient(logits: torch.Tensor, nexts: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """``dL/dlogits`` of ``L = sum over predicted positions of -log softmax(logits)[next]`` (``logits
    [B, T, V]``, ``nexts`` and ``predicted [B, T]``), in the logits' dtype: ``softmax - onehot(next)``
    on predicted rows, 0 elsewhere, formed :data:`LOSS_ROWS` positions at a time in float32 at least
    (as the loss would be). Autograd through ``cross_entropy`` would allocate the log-softmax, its
    gradient and the logits' gradient, three tensors the size of the logits (600 MB each for a
    3,000-token story and a 50k vocabulary); this allocates one, the result."""
    B, T, V = logits.shape
    flat, nx, keep = logits.reshape(B * T, V), nexts.reshape(-1), predicted.reshape(-1)
    out = torch.empty_like(flat)
    wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
    for s in range(0, B * T, LOSS_ROWS):
        rows = slice(s, s + LOSS_ROWS)
        g = torch.log_softmax(flat[rows].to(wide), -1).exp_()  # [n, V]
        g[torch.arange(g.shape[0], device=g.device), nx[rows]] -= 1.0
        out[rows] = torch.where(keep[rows, None], g, 0.0)
    return out.view(B, T, V)


@contextlib.contextmanager
def _frozen(module: nn.Module) -> Iterator[None]:
    """Every parameter's ``requires_grad`` off for the block (no weight gradients), then back."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


frozen_weights = _frozen  # for the effects' estimators, which differentiate through the model too


class _Taps:
    """``hook_z`` in every block: where grad mode is on, ``z + delta`` with ``delta`` a zero leaf, so
    ``dL/ddelta = dL/dz``; ``z`` and ``delta`` kept per block until taken."""

    def __init__(self) -> None:
        self.z: dict[int, torch.Tensor] = {}
        self.delta: dict[int, torch.Tensor] = {}

    def __call__(self, z: torch.Tensor, hook: Hook) -> torch.Tensor | None:  # z [B, T, H, d]
        if not torch.is_grad_enabled():
            return None
        delta = torch.zeros_like(z, requires_grad=True)
        self.z[hook.layer], self.delta[hook.layer] = z.detach(), delta
        return z + delta

    def take(self, lm: AttentionLM, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.delta:
            raise StorylensError(f"{lm.name}: hook_z did not fire in block {layer} (its heads cannot be reached)")
        return self.z.pop(layer), self.delta.pop(layer)


def _tap(stack: ExitStack, lm: AttentionLM, taps: _Taps, read: Readout | None, held: dict[str, torch.Tensor]) -> None:
    """On ``stack``: ``taps`` at every block's ``hook_z``, and the final norm's input kept in ``held["x"]``
    (its frozen scale, :func:`_scale`) where DLA can be read."""
    stack.enter_context(lm.hooks([(f"blocks.{i}.attn.hook_z", taps) for i in range(lm.n_layer)]))
    if read is not None:
        handle = read.norm.register_forward_pre_hook(lambda m, args: held.update(x=args[0].detach()))
        stack.callback(handle.remove)


def _targets(batch: StoryBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids`` (a normal tensor: the batch is made in inference mode), ``nexts`` and ``predicted [B, T]``."""
    ids = batch.ids.clone()
    t = torch.arange(ids.shape[1], device=ids.device)
    predicted = t[None, :] < batch.lengths.to(ids.device)[:, None] - 1  # [B, T]
    nexts = torch.where(predicted, ids.roll(-1, 1), torch.zeros_like(ids))  # [B, T]
    return ids, nexts, predicted


def _scale(read: Readout | None, held: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The final norm's divisor ``[B, T]`` float64, frozen at the run's value (from its input)."""
    if read is None or "x" not in held:
        return None
    return norm_scale(read, held["x"])


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A block's input hidden states: its first positional argument, or ``hidden_states``."""
    x = args[0] if args else kwargs.get("hidden_states")
    return x if isinstance(x, torch.Tensor) else None


def _with_hidden(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    return ((x, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": x})


def _output(out: Any) -> torch.Tensor:
    """A block's output hidden states (a block returns them, or a tuple that starts with them)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def _rebuilt(out: Any, h: torch.Tensor) -> Any:
    return h if isinstance(out, torch.Tensor) else (h, *out[1:])


def _differs(rerun: torch.Tensor, given: torch.Tensor) -> bool:
    """The rerun of a block is not what the model handed on: something between blocks, or another
    computation. The rerun repeats the same operations, so equal but for rounding where a kernel
    choice differs (a graph's kernel may not be the no-graph one): a relative difference of 1% of the
    largest value (and 32 of the dtype's epsilon) allows that many roundings, and any real change of
    the hidden states (a scale, a residual, a norm: of order one) is far above it."""
    if rerun.shape != given.shape:
        return True
    tol = max(1e-2, 32 * torch.finfo(given.dtype).eps) * float(given.abs().max()) + 1e-30
    return float((rerun - given).abs().max()) > tol


Emit = Callable[[Gradients], None]


@dataclass
class _First:
    """What the first forward (:func:`_first_pass`) leaves: ``top``, the logits (or the decoder's
    output); ``leaf``, the last block's input as its graph's leaf (None where the kept blocks reach
    the last: one graph through the whole model); ``saved``, the arguments of every block between the
    kept ones and the last, with a copy of its hidden input (a block may change its input in place);
    ``bottom``, the kept blocks' output with their graph (None where none is kept or they reach the
    last); ``ran``, whether every block ran as a block, in order (was handed its hidden states)."""

    top: torch.Tensor | None
    leaf: torch.Tensor | None
    saved: list[tuple[tuple, dict] | None]
    bottom: torch.Tensor | None
    ran: bool


@dataclass(frozen=True)
class Riding:
    """A recording of the attention that rides on the pass's first forward (:func:`gradient_pass`):
    ``context()`` (its hooks, and its streaming with ``riding=True``: every layer's rows streamed in
    inference mode and the fused kernel's output handed on, so the forward computes what it computes
    alone) is entered around that forward; ``alone()`` runs the recording's own forward instead, first,
    where the pass has no such forward (one graph through the whole model)."""

    context: Callable[[], AbstractContextManager]
    alone: Callable[[], None]


def _first_pass(
    lm: AttentionLM,
    blocks: list[nn.Module],
    ids: torch.Tensor,
    base: nn.Module | None,
    kept: int,
    riding: Riding | None = None,
) -> _First:
    """The forward with a graph for the first ``kept`` blocks (:func:`_kept`: their reruns skipped)
    and from the last block's input on (that block and the tail: final norm, unembedding, a soft cap),
    none in between; with ``base``, the decoder, its output is kept and the unembedding not run; with
    ``riding``, the recording rides on it."""
    saved: list[tuple[tuple, dict] | None] = [None] * len(blocks)
    last = len(blocks) - 1
    got: dict[str, torch.Tensor] = {}
    ran: list[int] = []  # the blocks handed their hidden states, in the order they ran

    def keeper(i: int) -> Callable[..., tuple[tuple, dict] | None]:
        def keep(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            x = _hidden(args, kwargs)
            if x is None:
                return None
            ran.append(i)
            if i < kept or i == last == kept:
                torch.set_grad_enabled(True)  # a kept block with a graph
                return None
            if i < last:
                if i == kept:
                    got["bottom"] = x  # the kept blocks' output, with their graph
                saved[i] = _with_hidden(args, dict(kwargs), x.detach().clone())
                torch.set_grad_enabled(False)
                return None
            got["leaf"] = x.detach().clone().requires_grad_()
            torch.set_grad_enabled(True)  # the last block and the tail with a graph
            return _with_hidden(args, kwargs, got["leaf"])

        return keep

    handles = [b.register_forward_pre_hook(keeper(i), with_kwargs=True) for i, b in enumerate(blocks)]
    if base is not None:
        handles.append(base.register_forward_hook(lambda m, args, out: got.update(out=_output(out))))
    try:
        # left with grad mode as it was, whatever the blocks' hooks set
        with torch.no_grad(), riding.context() if riding is not None else contextlib.nullcontext():
            logits = lm.forward(ids, record_attention=riding is not None, logits=base is None)  # [B, T, V]
    finally:
        for h in handles:
            h.remove()
    top = logits if base is None else got.get("out")
    return _First(top, got.get("leaf"), saved, got.get("bottom") if kept else None, ran == list(range(len(blocks))))


GRAPH_BYTES = 512 << 20  # what the gradient pass may hold of the first blocks' graphs, to skip their reruns


def block_bytes(lm: AttentionLM, blocks: list[nn.Module], ids: torch.Tensor) -> int:
    """Bytes autograd saves for one block's backward on ``ids [1, n]`` (weights frozen, parameters and
    buffers aside): block 0 run again from its input under a hook counting every saved tensor's
    storage once."""
    own = {t.untyped_storage().data_ptr() for t in [*lm.module.parameters(), *lm.module.buffers()]}
    got: dict[str, Any] = {}
    handle = blocks[0].register_forward_pre_hook(lambda m, a, k: got.update(args=(a, k)), with_kwargs=True)
    try:
        with torch.no_grad():
            lm.forward(ids, record_attention=False, logits=False)
    finally:
        handle.remove()
    args, kwargs = got.get("args", ((), {}))
    x = _hidden(args, kwargs)
    if x is None:
        return 0
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _rerun(lm, blocks[0], *_with_hidden(args, kwargs, x.detach().clone()))
    return sum(sizes.values())


@dataclass(frozen=True)
class BlockCost:
    """What one block's graph holds for a story of ``n`` tokens: ``per_token * n + per_pair * n^2``
    bytes (the second term where the attention keeps its map: not the fused kernel), from
    :func:`block_bytes` at two lengths (:meth:`measure`)."""

    per_token: float
    per_pair: float

    @staticmethod
    def measure(lm: AttentionLM, blocks: list[nn.Module], ids: torch.Tensor) -> BlockCost:
        """From ``ids [1, m]`` tiled to ``n`` and ``2n`` tokens, ``n`` 16 or half the model's window if
        less (what a block holds does not depend on the ids): ``short = n t + n^2 p`` and
        ``long = 2n t + 4n^2 p``, so ``p = (long - 2 short) / 2n^2``."""
        n = max(1, min(16, lm.window // 2))
        short, long = (block_bytes(lm, blocks, ids.repeat(1, -(-m // ids.shape[1]))[:, :m]) for m in (n, 2 * n))
        pair = max(0.0, (long - 2 * short) / (2 * n * n))
        return BlockCost(max(0.0, (short - n * n * pair) / n), pair)

    def batch(self, ids: torch.Tensor) -> float:
        """Bytes for a batch ``ids [B, T]``."""
        B, T = ids.shape
        return B * (self.per_token * T + self.per_pair * T * T)


def _kept(graph_bytes: int, cost: BlockCost | None, ids: torch.Tensor, last: int) -> int:
    """How many of the first blocks keep their graph from the first forward (skipping their rerun)
    within ``graph_bytes``, each holding ``cost.batch(ids)`` bytes, at most all but the last (which,
    with the tail, always has its graph); none where the cost is unknown."""
    each = 0.0 if cost is None else cost.batch(ids)
    if each <= 0 or graph_bytes <= 0:
        return 0
    return min(last, int(graph_bytes // each))


_OUTPUT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _split_head(lm: AttentionLM) -> tuple[nn.Module, nn.Linear] | None:
    """The model's decoder (its base model, whose output the unembedding reads) and its unembedding,
    where the logits may be nothing but that (no soft cap or scale in the config; :func:`_splits`
    checks the rest on the probe): the pass then forms the logits :data:`LOSS_ROWS` positions at a
    time and never whole (``[tokens, vocab]``: 600 MB for 3,000 tokens and a 50k vocabulary)."""
    module = lm.module
    base = getattr(module, "base_model", None)
    getter = getattr(module, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    config = getattr(module, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _OUTPUT_CHANGES):
        return None
    if not isinstance(base, nn.Module) or base is module or not isinstance(head, nn.Linear):
        return None
    return base, head


def _head_gradient(top: torch.Tensor, head: nn.Linear, nexts: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """``dL/d(the unembedding's input)`` for ``top [B, T, d_model]``, the logits formed
    :data:`LOSS_ROWS` positions at a time: ``loss_gradient`` of each slice, times ``W_U``."""
    B, T, D = top.shape
    flat, out = top.reshape(B * T, D), torch.empty_like(top).view(B * T, D)
    nx, keep = nexts.reshape(1, -1), predicted.reshape(1, -1)
    with torch.no_grad():
        for s in range(0, B * T, LOSS_ROWS):
            rows = slice(s, s + LOSS_ROWS)
            seed = loss_gradient(head(flat[rows])[None], nx[:, rows], keep[:, rows])[0]  # [n, V]
            out[rows] = seed @ head.weight  # [n, d_model]
    return out.view(B, T, D)


def _rerun(lm: AttentionLM, block: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``block`` again from its kept arguments, with a graph: (its input leaf, its output)."""
    x = _hidden(args, kwargs)
    assert x is not None
    x = x.requires_grad_()
    a, k = _with_hidden(args, kwargs, x)
    with torch.enable_grad(), lm.fused():
        return x, _output(block(*a, **k))


_Hand = Callable[[int, torch.Tensor, torch.Tensor | None], None]


def _back(
    lm: AttentionLM,
    taps: _Taps,
    hand: _Hand,
    out: torch.Tensor,
    layers: list[int],
    up: torch.Tensor,
    below: torch.Tensor | None,
) -> Any:
    """Backpropagate ``up`` from ``out`` through ``layers`` (from the last), handing each over;
    returns ``dL/d below`` (None: not asked)."""
    taken = [taps.take(lm, i) for i in layers]
    wanted = [d for _, d in taken] + ([below] if below is not None else [])
    found = torch.autograd.grad(out, wanted, grad_outputs=up, allow_unused=True)
    for i, (z, _), g in zip(layers, taken, found):
        hand(i, z, g)
    return found[len(layers)] if below is not None else None


def _loss_seed(top: torch.Tensor, head: nn.Linear | None, nexts: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """``dL/dlogits [B, T, V]`` for the logits ``top``; with ``head``, split off, ``dL/d(decoder output) [B, T, D]``."""
    if head is None:
        return loss_gradient(top, nexts, predicted)
    return _head_gradient(top, head, nexts, predicted)


def _reran_same(lm: AttentionLM, layer: int, rerun: torch.Tensor, given: torch.Tensor, check_only: bool) -> bool:
    """Whether block ``layer`` reran to what it handed on (:func:`_differs`); if not, raises unless ``check_only``."""
    if not _differs(rerun, given):
        return True
    if check_only:
        return False
    raise StorylensError(f"{lm.name}: block {layer} reran to other hidden states than the first time")


def _blockwise(
    lm: AttentionLM,
    blocks: list[nn.Module],
    batch: StoryBatch,
    read: Readout | None,
    emit: Emit | None,
    split_head: bool = False,
    kept: int = 0,
    riding: Riding | None = None,
) -> bool:
    """The pass block by block (the module docstring); ``split_head``: the logits a few rows at a
    time (:func:`_split_head`); ``kept``: the first blocks whose graph the first forward keeps
    (:func:`_kept`), backpropagated together last. ``emit`` None: a check only, on this batch, handing
    nothing over. False: the blocks cannot be rerun (nothing was handed over; with ``emit``, a block
    that reruns to something else raises, the check having passed on this model)."""
    ids, nexts, predicted = _targets(batch)
    held: dict[str, torch.Tensor] = {}
    taps = _Taps()
    last = len(blocks) - 1
    kept = min(kept, last)  # the last block always has its graph, with the tail
    split = _split_head(lm) if split_head else None

    def hand(layer: int, z: torch.Tensor, dz: torch.Tensor | None) -> None:
        if emit is not None:
            w = None if read is None else lm.head_output_weights(layer).detach()
            emit(Gradients(batch, layer, z, torch.zeros_like(z) if dz is None else dz, scale, read, w))

    def back(out: torch.Tensor, layers: list[int], up: torch.Tensor, below: torch.Tensor | None) -> Any:
        return _back(lm, taps, hand, out, layers, up, below)

    with ExitStack() as stack:
        _tap(stack, lm, taps, read, held)
        first = _first_pass(lm, blocks, ids, None if split is None else split[0], kept, riding)
        top, x, saved = first.top, first.leaf, first.saved
        if top is None or not first.ran or (x is None and kept < last):
            return False
        seed = _loss_seed(top.detach(), None if split is None else split[1], nexts, predicted)
        scale = _scale(read, held)
        if x is None:  # the kept blocks reach the last: one graph through the whole model
            back(top, list(reversed(range(last + 1))), seed, None)
            return True
        up = back(top, [last], seed, x if last else None)
        del top, seed
        for layer in reversed(range(kept, last)):  # dL/d(input of block layer + 1) in up, that input in x
            args, kwargs = saved[layer]  # type: ignore[misc]
            saved[layer] = None
            given = x.detach()
            x, h = _rerun(lm, blocks[layer], args, kwargs)
            if not _reran_same(lm, layer, h.detach(), given, check_only=emit is None):
                return False
            up = back(h, [layer], torch.zeros_like(given) if up is None else up, x if layer > 0 else None)
            del h
        if kept:
            assert first.bottom is not None
            back(first.bottom, list(reversed(range(kept))), torch.zeros_like(x) if up is None else up, None)
    return True


def _whole(lm: AttentionLM, batch: StoryBatch, read: Readout | None, emit: Emit) -> None:
    """The pass with one graph through the whole model (every block's activations held at once)."""
    ids, nexts, predicted = _targets(batch)
    held: dict[str, torch.Tensor] = {}
    taps = _Taps()
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        _tap(stack, lm, taps, read, held)
        logits = lm.forward(ids, record_attention=False, logits=True)  # [B, T, V]
        assert logits is not None
        layers = list(range(lm.n_layer))
        kept = [taps.take(lm, i) for i in layers]
        seed = loss_gradient(logits.detach(), nexts, predicted)  # dL/dlogits [B, T, V]
        found = torch.autograd.grad(logits, [d for _, d in kept], grad_outputs=seed, allow_unused=True)
    scale = _scale(read, held)
    for layer in reversed(layers):
        z, g = kept[layer][0], found[layer]
        w = None if read is None else lm.head_output_weights(layer).detach()
        emit(Gradients(batch, layer, z, torch.zeros_like(z) if g is None else g.detach(), scale, read, w))


@dataclass(frozen=True)
class _Way:
    """How the gradient pass runs on a model (:func:`_way`): block by block, the logits a few rows at
    a time, and what one block's graph holds (None: unknown, no block's graph kept)."""

    blockwise: bool
    split_head: bool
    cost: BlockCost | None = None


_WAYS: weakref.WeakKeyDictionary[nn.Module, _Way] = weakref.WeakKeyDictionary()


def _way(lm: AttentionLM, blocks: list[nn.Module] | None, batch: StoryBatch) -> _Way:
    """How the pass runs on ``lm``, checked once per model on the batch's first story's first 16
    tokens (a note where the blocks cannot be rerun): every block reruns to what the model ran, the
    model's logits are its unembedding of its decoder's output (equal within 16 roundings), and what
    a block's graph holds (:class:`BlockCost`)."""
    if blocks is None or len(blocks) != lm.n_layer:
        return _Way(False, False)
    if lm.module not in _WAYS:
        n = min(16, int(batch.lengths[0]))
        probe = dataclasses.replace(batch, ids=batch.ids[:1, :n], lengths=batch.lengths[:1].clamp(max=n))
        blockwise = _blockwise(lm, blocks, probe, readout(lm), None)
        if not blockwise:
            print(f"storylens: note: {lm.name}'s blocks cannot be rerun one at a time: the gradient pass "
                  "holds every block's activations at once", file=sys.stderr)  # fmt: skip
        split = blockwise and _splits(lm, probe.ids.clone())
        _WAYS[lm.module] = _Way(
            blockwise, split, BlockCost.measure(lm, blocks, probe.ids.clone()) if blockwise else None
        )
    return _WAYS[lm.module]


def _splits(lm: AttentionLM, ids: torch.Tensor) -> bool:
    """Whether ``lm``'s logits on ``ids`` are its unembedding of its decoder's output (:func:`_split_head`)."""
    pair = _split_head(lm)
    if pair is None:
        return False
    base, head = pair
    got: dict[str, torch.Tensor] = {}
    handle = base.register_forward_hook(lambda m, args, out: got.update(out=_output(out)))
    try:
        with torch.no_grad():
            logits = lm.forward(ids, record_attention=False, logits=True)
            split = head(got["out"]) if "out" in got else None
    finally:
        handle.remove()
    if logits is None or split is None or split.shape != logits.shape:
        return False
    tol = 16 * torch.finfo(logits.dtype).eps * float(logits.abs().max()) + 1e-30
    return float((split - logits).abs().max()) <= tol


def gradient_pass(
    lm: AttentionLM, batch: StoryBatch, emit: Emit, graph_bytes: int = GRAPH_BYTES, riding: Riding | None = None
) -> None:
    """The gradient pass of one batch: one forward with the model's fused attention and one backward
    of the batch's summed next-token loss (every predicted token, the opening token's prediction
    included), block by block (the module docstring); no weight gradient, no map formed. A zero
    tensor added at each block's ``hook_z`` is the leaf whose gradient is ``dL/dz``; the final
    norm's input is kept for its frozen scale. ``graph_bytes``: what the first blocks' graphs may
    hold, kept from the first forward so that those blocks are not run again (0: one block's
    activations at a time). ``emit`` gets every block's :class:`Gradients`, from the last block to
    the first. ``riding``: a recording of the attention that rides on the first forward
    (:class:`Riding`), so that the batch runs through the model once for both."""
    read = readout(lm)
    with torch.inference_mode(False), _frozen(lm.module):
        blocks = lm.blocks()
        way = _way(lm, blocks, batch)
        if blocks is not None and way.blockwise:
            kept = _kept(graph_bytes, way.cost, batch.ids, len(blocks) - 1)
            _blockwise(lm, blocks, batch, read, emit, way.split_head, kept, riding)
        else:
            if riding is not None:
                riding.alone()
            _whole(lm, batch, read, emit)
