"""A causal language model whose attention storylens can read: one small interface, two kinds.

* :class:`~storylens.lm.native.NativeLM` wraps storylens's own :class:`~storylens.model.GPT` (the Tiny Storyteller);
* :class:`~storylens.lm.transformers_lm.TransformersLM` wraps any transformers ``AutoModelForCausalLM`` (GPT-2, GPT-Neo,
  Llama-style, ...) run with storylens's own attention (:mod:`storylens.lm.attention`; GPT-Neo and
  others that do not dispatch through transformers' attention interface: eager attention), which
  hands back its attention probabilities, or streams them while a recording runs.

Both give the same handful of things: sizes (``n_layer``, ``n_head``, ``window``), the tokenizer
(a ``tokenizers.Tokenizer``: stories are encoded without special tokens and opened by
``marker_id``, the end-of-story marker / beginning-of-sequence token), a forward pass, and
named hook points in TransformerLens's spirit, through torch's own hooks:

``blocks.{l}.attn.hook_v``
    ``[batch, key, kv_head, head_size]``: the value vectors of block ``l`` (with grouped key/value
    heads, ``kv_head`` counts the groups: query head ``h`` reads group ``h // (n_head // n_kv_head)``).
``blocks.{l}.attn.hook_pattern``
    the *pattern* of block ``l`` (0-based): its ``[batch, head, query, key]`` attention
    probabilities, read the moment they exist (on the native model only on its explicit path:
    ``record_attention=True``).
``blocks.{l}.attn.hook_z``
    ``[batch, query, head, head_size]``: each head's output before the output projection.
    A hook that returns a tensor replaces it (how heads are switched off).

A hook function is called ``fn(tensor, hook)`` (TransformerLens's convention): ``hook`` is a
:class:`Hook`, which carries the point's ``name`` and its block, ``layer``, so one function serves
every block (the native model hands its :class:`~storylens.model.gpt.HookPoint` module, a
transformers model a :class:`HookSite`).

:func:`~storylens.lm.loader.load_lm` opens a storylens model folder, a transformers model folder, or (with
``allow_download``) a hub id; :func:`~storylens.lm.loader.wrap` wraps a model already in memory.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from tokenizers import Tokenizer
from torch import nn
from torch.utils.hooks import RemovableHandle

from storylens.core.errors import StorylensError
from storylens.core.text import checked_texts
from storylens.lm.attention import RowConsumer
from storylens.model.gpt import GenerationStep
from storylens.model.tokenizer import text_only

if TYPE_CHECKING:
    pass


class Hook(Protocol):
    """What a hook function is handed beside the tensor: the hook point's TransformerLens ``name``
    (``"blocks.3.attn.hook_pattern"``) and its block, ``layer`` (3, from 0)."""

    @property
    def name(self) -> str: ...

    @property
    def layer(self) -> int: ...


@dataclass(frozen=True)
class HookSite:
    """A :class:`Hook` of a transformers model (its hook points are places in its modules, not modules)."""

    name: str
    layer: int


HookFn = Callable[[torch.Tensor, Hook], "torch.Tensor | None"]


ATTN_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z")  # blocks.{l}.attn.<kind>


BLOCK_HOOKS = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post")  # blocks.{l}.<kind>


HOOK_KINDS = ATTN_HOOKS + BLOCK_HOOKS


_HOOK_NAME = re.compile(r"^blocks\.(\d+)\.(?:attn\.(" + "|".join(ATTN_HOOKS) + r")|(" + "|".join(BLOCK_HOOKS) + r"))$")


class AttentionLM:
    """The interface (see the module docstring). Subclasses set the attributes in ``__init__``."""

    module: nn.Module
    tokenizer: Tokenizer
    marker_id: int
    n_layer: int
    n_head: int
    n_kv_head: int  # key/value heads (groups); n_head without grouped attention
    window: int
    vocab_size: int
    name: str
    source_folder: Path | None = None
    _after: Any = None  # inside continuing(): the prefix's keys and values (:meth:`_prefill`'s)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def encode_batch(self, texts: list[str]):
        """``tokenizers.Encoding`` per text (ids and character offsets), no special tokens: a
        special token's text inside a story stays text (:func:`storylens.model.tokenizer.text_only`). A text that is
        not a str or not valid Unicode is refused in one line."""
        return text_only(self.tokenizer).encode_batch(checked_texts(texts), add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """``[marker] + text's tokens``: how storylens feeds every story and prompt."""
        (text,) = checked_texts([text], "text")
        return [self.marker_id] + text_only(self.tokenizer).encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # --- hooks
    def hook_names(self) -> list[str]:
        """Every hook point, TransformerLens's names: ``blocks.{l}.hook_resid_pre``, ``blocks.{l}.attn.hook_q``,
        ``hook_k``, ``hook_v``, ``hook_pattern``, ``hook_z``, ``blocks.{l}.hook_attn_out``, ``hook_mlp_out``,
        ``hook_resid_post``."""
        return [
            f"blocks.{i}.{'attn.' if k in ATTN_HOOKS else ''}{k}"
            for i in range(self.n_layer)
            for k in ("hook_resid_pre", *ATTN_HOOKS, "hook_attn_out", "hook_mlp_out", "hook_resid_post")
        ]

    def _parse_hook(self, name: str) -> tuple[int, str]:
        m = _HOOK_NAME.match(name) if isinstance(name, str) else None
        if not m or not 0 <= int(m.group(1)) < self.n_layer:
            raise StorylensError(
                f"hook {name!r}: no such hook point (blocks.0 .. blocks.{self.n_layer - 1}, then "
                + ", ".join(f"attn.{k}" for k in ATTN_HOOKS)
                + " or "
                + ", ".join(BLOCK_HOOKS)
                + ")"
            )
        return int(m.group(1)), m.group(2) or m.group(3)

    def add_hook(self, name: str, fn: HookFn) -> RemovableHandle:
        """Call ``fn(tensor, hook)`` at hook point ``name`` on every forward pass (a returned tensor
        replaces a ``hook_z``); returns a handle with ``.remove()``."""
        raise NotImplementedError

    @contextlib.contextmanager
    def hooks(self, hooks: list[tuple[str, HookFn]]) -> Iterator[None]:
        """``with lm.hooks([(name, fn), ...]):`` the hooks live for the ``with`` block only."""
        handles: list[RemovableHandle] = []
        try:
            for name, fn in hooks:
                handles.append(self.add_hook(name, fn))
            yield
        finally:
            for h in handles:
                h.remove()

    def head_output_weights(self, layer: int) -> torch.Tensor:
        """``[head, head_size, d_model]``: each head's slice of block ``layer``'s output projection,
        ``W_O^h`` (no bias), so that head ``h``'s share of the block's output at a query is
        ``z[..., h, :] @ W_O^h``."""
        raise StorylensError(f"{type(self).__name__}: no output projection weights to weigh attention by")

    def projection_weights(self, layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block ``layer``'s query (``part`` ``"q"``), key (``"k"``) or value (``"v"``) projection per head:
        ``[n, d_model, head_size]`` weights and ``[n, head_size]`` biases (None: it has none), ``n`` the query
        heads for ``"q"`` and the key/value heads for ``"k"`` and ``"v"``, so that head ``h``'s query at a
        position is ``x @ W[h] + b[h]``, ``x`` the block's normalised input (before rotary positions:
        TransformerLens's ``W_Q``, ``W_K``, ``W_V`` of one block)."""
        raise StorylensError(f"{type(self).__name__}: no query, key and value weights to read")

    def token_embedding(self) -> torch.Tensor:
        """``[vocab, d_model]``: the token embedding (``W_E``)."""
        getter = getattr(self.module, "get_input_embeddings", None)
        embedding = getter() if callable(getter) else None
        if not isinstance(getattr(embedding, "weight", None), torch.Tensor):
            raise StorylensError(f"{type(self.module).__name__}: cannot find its token embedding")
        return cast(torch.Tensor, embedding.weight)  # type: ignore[union-attr]

    def position_embedding(self) -> torch.Tensor | None:
        """``[window, d_model]``: learned absolute positions added to the tokens (``W_pos``); None where the
        model has none (rotary or no positions)."""
        base = getattr(self.module, "transformer", None) or getattr(self.module, "base_model", None) or self.module
        wpe = getattr(base, "wpe", None) or getattr(base, "embed_positions", None)
        weight = getattr(wpe, "weight", None)
        return weight if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None

    def attention_norm(self, layer: int) -> nn.Module | None:
        """The normalisation block ``layer``'s attention reads its input through (None: not found)."""
        blocks = self.blocks()
        block = blocks[layer] if blocks is not None else None
        for name in ("ln_1", "input_layernorm", "attention_norm", "ln_attn"):
            norm = getattr(block, name, None)
            if isinstance(norm, nn.Module):
                return norm
        return None

    def moving_unsupported(self) -> str | None:
        """Why this model's value vectors or output weights cannot be read (None: they can), so that
        the norm-weighted columns are left empty rather than a run failing."""
        try:
            self.head_output_weights(0)
        except StorylensError as e:
            return str(e)
        return None

    def can_stream(self) -> bool:
        """Whether this model's attention can hand its probabilities over a chunk of query rows at a
        time (:meth:`streaming`); where not, ``hook_pattern`` gives whole maps."""
        return False

    def streaming(self, consumer: RowConsumer, riding: bool = False) -> AbstractContextManager:
        """A context inside which every block hands its attention probabilities to ``consumer`` a
        chunk of query rows at a time and keeps no whole map (:func:`storylens.lm.attention.streaming`;
        ``riding``: on a forward outside inference mode that runs for its own ends, handing it the fused
        kernel's output); only where :meth:`can_stream`."""
        raise StorylensError(f"{type(self).__name__}: its attention cannot stream")

    def fused(self) -> AbstractContextManager:
        """A context inside which a block called on its own (:meth:`blocks`) runs the attention
        :meth:`forward` runs with ``record_attention=False``: the fused kernel, forming no map."""
        return contextlib.nullcontext()

    # --- running
    def forward(
        self, ids: torch.Tensor, *, record_attention: bool = False, logits: bool | torch.Tensor = True
    ) -> torch.Tensor | None:
        """Run ``ids [batch, tokens]`` (stories padded at the end). ``record_attention=True`` makes
        every ``hook_pattern`` fire; ``logits=False`` may skip the output head; ``logits`` a tensor ``at``
        ``[batch]`` of positions: the output head runs at one position a row, ``at[i]`` of row ``i`` (a metric
        read at one place: the head is a product over the whole vocabulary). Returns the logits ``[batch,
        tokens, vocab]`` (``[batch, 1, vocab]`` with ``at``) or None."""
        raise NotImplementedError

    @contextlib.contextmanager
    def continuing(self, prefix: torch.Tensor) -> Iterator[bool]:
        """Inside: every :meth:`forward` runs its ``ids`` as the tokens after ``prefix`` ``[batch, p]``, whose keys
        and values are made here once (no graph; call it outside hooks): positions, hook tensors and ``logits``'s
        positions count from the first token after it, and a batch of ``n`` times its rows reads it tiled, as
        ``ids.repeat(n, 1)`` tiles. What a shared start of many runs costs once (edge patching's pairs share the
        tokens before the first one they differ in). Yields False where the model keeps no cache here, and
        forwards then run their ``ids`` alone."""
        state = self._prefill(prefix) if prefix.shape[1] else None
        old, self._after = self._after, state
        try:
            yield state is not None
        finally:
            self._after = old

    def _prefill(self, prefix: torch.Tensor) -> Any:
        """:meth:`continuing`'s keys and values of ``prefix``, per block ``(key, value)`` with the batch first;
        None: not kept here."""
        return None

    def _tiled_start(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Inside :meth:`continuing`: its keys and values per block, tiled to a forward of ``batch`` rows (for a
        fresh cache of that forward)."""
        rows = self._after[0][0].shape[0]
        if batch % rows:
            raise StorylensError(f"a forward of {batch} rows continues a prefix of {rows}: not a whole number of times")
        n = batch // rows
        return [(k.repeat(n, 1, 1, 1), v.repeat(n, 1, 1, 1)) for k, v in self._after]

    def blocks(self) -> list[nn.Module] | None:
        """The decoder blocks in order, each called once per forward pass with what the block
        before it returned; None where unknown (then :meth:`skip_blocks` skips nothing)."""
        return None

    @contextlib.contextmanager
    def keep_block_outputs(self, layers: Iterable[int]) -> Iterator[dict[int, Any]]:
        """``with lm.keep_block_outputs([3]) as kept:`` after a forward pass inside, ``kept[3]`` is
        what block 3 returned (for :meth:`skip_blocks`); nothing is kept where :meth:`blocks` is None."""
        kept: dict[int, Any] = {}
        blocks = self.blocks() or []
        handles: list[RemovableHandle] = []

        def keeper(layer: int) -> Callable[..., None]:
            def keep(module: nn.Module, inputs: tuple, output: Any) -> None:
                kept[layer] = output

            return keep

        try:
            for layer in sorted(set(layers)) if blocks else ():
                handles.append(blocks[layer].register_forward_hook(keeper(layer)))
            yield kept
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def skip_blocks(self, layer: int, output: Any) -> Iterator[None]:
        """Inside: blocks ``0 .. layer - 1`` do not run, so a forward pass starts at block ``layer``
        from ``output``, what block ``layer - 1`` returned (:meth:`keep_block_outputs`) for the same
        ids; their hooks do not fire. Only right for those ids, and only while nothing before block
        ``layer`` is changed (a head switched off there)."""
        blocks = self.blocks()
        skipped = blocks[:layer] if blocks is not None and layer > 0 else []
        saved = [b.__dict__.get("forward") for b in skipped]

        def passed(*args: Any, **kwargs: Any) -> Any:  # read only by the next skipped block, which ignores it
            return output

        def carried(*args: Any, **kwargs: Any) -> Any:  # a copy: block ``layer`` may change its input in place
            if isinstance(output, torch.Tensor):
                return output.clone()
            if isinstance(output, tuple):
                return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in output)
            return output

        try:
            for i, b in enumerate(skipped):  # an instance attribute: nn.Module.__call__ runs it instead
                b.forward = carried if i == len(skipped) - 1 else passed
            yield
        finally:
            for b, old in zip(skipped, saved, strict=True):
                if old is None:
                    b.__dict__.pop("forward", None)
                else:
                    b.forward = old

    def projection_modules(self, layer: int) -> list[tuple[nn.Module, tuple[str, ...]]]:
        """Block ``layer``'s query, key and value projections, each with the parts its output holds (``("q",)``
        for a projection of its own, ``("q", "k", "v")`` for one that makes all three: GPT-2's ``c_attn``, GPT-NeoX's
        ``query_key_value``); empty where they are not known."""
        return []

    @contextlib.contextmanager
    def unrun_projections(self, layers: Iterable[int], inputs: dict[int, torch.Tensor]) -> Iterator[set[int]]:
        """Inside: the query, key and value projections of each block of ``layers`` do not run; each returns an
        uninitialised tensor of its output's shape and keeps its input (the normalised block input) in
        ``inputs[layer]``, for its hooks (``hook_q``, ``hook_k``, ``hook_v``, which still fire) to fill every head
        of. Yields the blocks so treated: those whose projections are known (:meth:`projection_modules`)."""
        found: dict[nn.Module, tuple[int, int]] = {}  # module -> (block, its output's width)
        done = set()
        for layer in layers:
            modules = self.projection_modules(layer)
            if not modules or any("forward" in m.__dict__ for m, _ in modules):
                continue
            for module, parts in modules:
                weights = [self.projection_weights(layer, p)[0] for p in parts]  # [n, d_model, head_size] each
                found[module] = (layer, sum(w.shape[0] * w.shape[2] for w in weights))
            done.add(layer)

        def unrun(layer: int, width: int) -> Callable[..., torch.Tensor]:
            def forward(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
                inputs[layer] = x
                return x.new_empty(*x.shape[:-1], width)

            return forward

        try:
            for module, (layer, width) in found.items():  # an instance attribute: nn.Module.__call__ runs it instead
                module.forward = unrun(layer, width)
            yield done
        finally:
            for module in found:
                module.__dict__.pop("forward", None)

    @contextlib.contextmanager
    def given_mlp_outputs(self, outputs: dict[int, torch.Tensor]) -> Iterator[None]:
        """Inside: the MLP of each block in ``outputs`` returns that tensor ``[batch, pos, d_model]`` instead of
        running (its own hooks, ``hook_mlp_out`` among them, still fire); a block whose MLP is not its ``mlp``
        module runs it."""
        blocks = self.blocks() or []
        mlps = {layer: getattr(blocks[layer], "mlp", None) for layer in outputs if layer < len(blocks)}
        given = {i: m for i, m in mlps.items() if isinstance(m, torch.nn.Module) and "forward" not in m.__dict__}
        try:
            for layer, m in given.items():  # an instance attribute: nn.Module.__call__ runs it instead
                m.forward = (lambda out: lambda *args, **kwargs: out)(outputs[layer])
            yield
        finally:
            for m in given.values():
                m.__dict__.pop("forward", None)

    def patterns(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Every block's pattern ``[batch, head, query, key]`` for ``ids`` (one call, all kept)."""
        patterns: dict[int, torch.Tensor] = {}

        def keep(pattern: torch.Tensor, hook: Hook) -> None:
            patterns[hook.layer] = pattern.detach()

        with self.hooks([(f"blocks.{i}.attn.hook_pattern", keep) for i in range(self.n_layer)]):
            self.forward(ids, record_attention=True, logits=False)
        return [patterns[i] for i in range(self.n_layer)]

    def generate_stream(self, idx: torch.Tensor, max_new_tokens: int, **kw: Any) -> Iterator[GenerationStep]:
        raise NotImplementedError
