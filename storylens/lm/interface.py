"""A causal language model whose attention storylens can read: one small interface, two kinds.

* :class:`NativeLM` wraps storylens's own :class:`~storylens.model.GPT` (the Tiny Storyteller);
* :class:`TransformersLM` wraps any transformers ``AutoModelForCausalLM`` (GPT-2, GPT-Neo,
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

:func:`load_lm` opens a storylens model folder, a transformers model folder, or (with
``allow_download``) a hub id; :func:`wrap` wraps a model already in memory.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast

import torch
from tokenizers import Tokenizer
from torch import nn
from torch.utils.hooks import RemovableHandle

from storylens.core.errors import StorylensError, UsageError, install_hint
from storylens.lm.attention import CHUNK_BYTES, RowConsumer, attach
from storylens.lm.attention import NAME as ATTENTION
from storylens.lm.attention import fused as fused_attention
from storylens.lm.attention import register as register_attention
from storylens.lm.attention import streaming as stream_attention
from storylens.lm.configs import CONFIG_ERRORS, check_no_custom_code, check_sizes
from storylens.model.gpt import GPT, GenerationStep, sample_next
from storylens.model.hub import hub_offline, load_model
from storylens.model.tokenizer import eot_id, text_only

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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
_M = TypeVar("_M", bound=nn.Module)
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

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def encode_batch(self, texts: list[str]):
        """``tokenizers.Encoding`` per text (ids and character offsets), no special tokens: a
        special token's text inside a story stays text (:func:`storylens.model.tokenizer.text_only`)."""
        return text_only(self.tokenizer).encode_batch(list(texts), add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """``[marker] + text's tokens``: how storylens feeds every story and prompt."""
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

    def streaming(self, consumer: RowConsumer) -> AbstractContextManager:
        """A context inside which every block hands its attention probabilities to ``consumer`` a
        chunk of query rows at a time and keeps no whole map (:func:`storylens.lm.attention.streaming`);
        only where :meth:`can_stream`."""
        raise StorylensError(f"{type(self).__name__}: its attention cannot stream")

    def fused(self) -> AbstractContextManager:
        """A context inside which a block called on its own (:meth:`blocks`) runs the attention
        :meth:`forward` runs with ``record_attention=False``: the fused kernel, forming no map."""
        return contextlib.nullcontext()

    # --- running
    def forward(self, ids: torch.Tensor, *, record_attention: bool = False, logits: bool = True) -> torch.Tensor | None:
        """Run ``ids [batch, tokens]`` (stories padded at the end). ``record_attention=True`` makes
        every ``hook_pattern`` fire; ``logits=False`` may skip the output head. Returns the logits
        ``[batch, tokens, vocab]`` or None."""
        raise NotImplementedError

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


# ---------------------------------------------------------------- storylens's own GPT


class NativeLM(AttentionLM):
    module: GPT

    def __init__(self, model: GPT, tokenizer: Tokenizer | None = None, name: str = "Tiny Storyteller"):

        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise StorylensError("model: has no tokenizer (load it with storylens.model.hub.load_model, or pass one)")
        self.module, self.tokenizer = model, tokenizer
        self.marker_id = eot_id(tokenizer)
        cfg = model.config
        self.n_layer, self.n_head, self.window, self.vocab_size = (
            cfg.n_layer,
            cfg.n_head,
            cfg.block_size,
            cfg.vocab_size,
        )
        self.n_kv_head = cfg.n_head
        self.name = name
        self.source_folder = getattr(model, "source_folder", None)

    def head_output_weights(self, layer: int) -> torch.Tensor:
        proj = cast(nn.Linear, self.module.get_submodule(f"transformer.h.{layer}.attn.c_proj"))
        w = proj.weight  # [d_model, head * head_size]: y = z @ w.T
        return w.T.reshape(self.n_head, -1, w.shape[0])

    def add_hook(self, name: str, fn: HookFn) -> RemovableHandle:
        self._parse_hook(name)
        return self.module.hook_points()[name].add_hook(fn)

    def forward(self, ids: torch.Tensor, *, record_attention: bool = False, logits: bool = True) -> torch.Tensor | None:
        out = self.module(ids, record_attention=record_attention, keep_patterns=False, compute_logits=logits)
        return out.logits

    def blocks(self) -> list[nn.Module] | None:
        return list(self.module.transformer.h)

    def generate_stream(self, idx: torch.Tensor, max_new_tokens: int, **kw: Any) -> Iterator[GenerationStep]:
        return self.module.generate_stream(idx, max_new_tokens, **kw)


# ---------------------------------------------------------------- transformers models


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "base_model", model)
    for attr in ("h", "layers", "blocks"):
        layers = getattr(base, attr, None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    raise StorylensError(f"{type(model).__name__}: cannot find its decoder layers (h, layers)")


def _attention_of(layer: nn.Module) -> nn.Module:
    for attr in ("self_attn", "attn", "attention"):
        m = getattr(layer, attr, None)
        if isinstance(m, nn.Module):
            return m
    raise StorylensError(f"{type(layer).__name__}: cannot find its attention module")


def _output_projection(attn: nn.Module) -> nn.Module:
    inner = getattr(attn, "attention", None)  # GPT-Neo: GPTNeoAttention wraps GPTNeoSelfAttention
    for m in (attn, inner):
        if m is None:
            continue
        for attr in ("o_proj", "c_proj", "out_proj", "dense"):
            p = getattr(m, attr, None)
            if isinstance(p, nn.Module):
                return p
    raise StorylensError(f"{type(attn).__name__}: cannot find its output projection (o_proj, c_proj, out_proj)")


def _projection(attn: nn.Module, part: str) -> tuple[nn.Module, str]:
    """The module whose output holds the queries (``part`` ``"q"``), keys (``"k"``) or values (``"v"``),
    and how they sit in it: ``"own"`` (a projection of its own: Llama-style, GPT-Neo), ``"qkv"``
    (GPT-2's ``c_attn``: queries, keys, values side by side) or ``"neox"`` (GPT-NeoX's
    ``query_key_value``: per head, q, k, v)."""
    inner = getattr(attn, "attention", None)  # GPT-Neo
    for m in (attn, inner):
        if m is None:
            continue
        for attr, kind in ((f"{part}_proj", "own"), ("c_attn", "qkv"), ("query_key_value", "neox")):
            p = getattr(m, attr, None)
            if isinstance(p, nn.Module):
                return p, kind
    raise StorylensError(
        f"{type(attn).__name__}: cannot find its {part} projection ({part}_proj, c_attn, query_key_value)"
    )


def _value_projection(attn: nn.Module) -> tuple[nn.Module, str]:
    """:func:`_projection` of the values, ``"own"`` called ``"v"``."""
    module, kind = _projection(attn, "v")
    return module, "v" if kind == "own" else kind


def _split_hook(fn: HookFn, site: HookSite, kind: str, part: str, n: int) -> Callable[..., torch.Tensor | None]:
    """A forward hook on a projection (:func:`_projection`) that hands ``fn`` its ``part`` as
    ``[batch, tokens, n, head_size]`` and puts back what ``fn`` returns (None: as it was)."""
    index = "qkv".index(part)

    def read(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor | None:
        B, T, C = out.shape
        if kind == "own":  # [B, T, n * d]
            got = fn(out.view(B, T, n, C // n), site)
            return None if got is None else got.reshape(B, T, C)
        if kind == "qkv":  # [B, T, 3 * n * d]: q | k | v
            third = C // 3
            got = fn(out[..., index * third : (index + 1) * third].view(B, T, n, third // n), site)
            if got is None:
                return None
            return torch.cat([out[..., : index * third], got.reshape(B, T, third), out[..., (index + 1) * third :]], -1)
        per_head = out.view(B, T, n, 3, C // (3 * n))  # neox: per head [q, k, v]
        got = fn(per_head[..., index, :], site)
        if got is None:
            return None
        return torch.stack([got if i == index else per_head[..., i, :] for i in range(3)], -2).reshape(B, T, C)

    return read


def _residual_hooks(layer: nn.Module, kind: str, fn: HookFn, site: HookSite) -> RemovableHandle:
    """``hook_resid_pre`` (the decoder layer's input, however it is passed) or ``hook_resid_post`` (its
    output: a tensor, or a tuple led by one) on decoder layer ``layer``."""
    if kind == "hook_resid_pre":

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            if args:
                got = fn(args[0], site)
                return None if got is None else ((got, *args[1:]), kwargs)
            got = fn(kwargs["hidden_states"], site)
            return None if got is None else (args, {**kwargs, "hidden_states": got})

        return layer.register_forward_pre_hook(pre, with_kwargs=True)

    def post(module: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, tuple):
            got = fn(out[0], site)
            return None if got is None else (got, *out[1:])
        return fn(out, site)

    return layer.register_forward_hook(post)


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D``: a linear layer that stores its weight as ``[in, out]`` (``y = x @ W + b``)."""
    return type(module).__name__ == "Conv1D"


class TransformersLM(AttentionLM):
    """A transformers causal LM, run with storylens's attention (else eager attention: both form the
    probabilities). Sizes come from its config; the marker is its BOS token (else EOS)."""

    module: Any  # a transformers PreTrainedModel (transformers is imported only when one is loaded)

    def __init__(self, model: Any, tokenizer: Any, name: str | None = None):
        cfg = model.config
        # storylens's grouped attention where the model dispatches through transformers' attention
        # interface (storylens.lm.attention), else transformers' eager attention: both form the
        # probabilities. GPT-2's reordered-and-upcast variant keeps its own eager code.
        self.attention = "eager"
        self.chunk_bytes = CHUNK_BYTES  # a streamed chunk of one block's scores (storylens.lm.attention)
        if (
            getattr(model, "_supports_attention_backend", False)
            and not getattr(cfg, "reorder_and_upcast_attn", False)
            and register_attention()
        ):
            self.attention = ATTENTION
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(self.attention)
        else:
            cfg._attn_implementation = self.attention
        self.module = model
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "encode_batch"):
            raise StorylensError(f"{type(tokenizer).__name__}: storylens needs a fast (tokenizers) tokenizer")
        self.tokenizer = backend
        if not backend.encode("Once upon a time", add_special_tokens=False).ids:  # transformers' empty stand-in
            raise StorylensError("tokenizer: encodes text as no tokens at all (is its tokenizer.json missing?)")
        marker = getattr(tokenizer, "bos_token_id", None)
        if marker is None:
            marker = getattr(tokenizer, "eos_token_id", None)
        if marker is None:
            raise StorylensError(
                "tokenizer: has neither a beginning-of-sequence nor an end-of-sequence token to open each story with"
            )
        self.marker_id = int(marker)
        self.layers = _decoder_layers(model)
        self.n_layer = len(self.layers)
        self.n_head = int(cfg.num_attention_heads)
        self.n_kv_head = int(getattr(cfg, "num_key_value_heads", None) or self.n_head)
        self.window = int(getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 2048)
        self.vocab_size = int(cfg.vocab_size)
        self.name = name or getattr(cfg, "_name_or_path", None) or type(model).__name__
        self._attn = [_attention_of(layer) for layer in self.layers]
        self._taps = attach(self._attn)  # each attention module's consumer (storylens.lm.attention)
        self._proj = [_output_projection(a) for a in self._attn]
        self._value: list[tuple[nn.Module, str]] | None = None  # found when hook_v is first asked for

    def head_output_weights(self, layer: int) -> torch.Tensor:
        proj = self._proj[layer]
        w = cast(torch.Tensor, proj.weight)
        w = w if _is_conv1d(proj) else w.T  # [head * head_size, d_model]
        return w.reshape(self.n_head, -1, w.shape[1])

    def can_stream(self) -> bool:
        return getattr(self.module.config, "_attn_implementation", None) == ATTENTION  # not switched since

    def streaming(self, consumer: RowConsumer) -> AbstractContextManager:
        if not self.can_stream():
            return super().streaming(consumer)
        return stream_attention(self._taps, consumer, self.chunk_bytes)

    def moving_unsupported(self) -> str | None:
        try:
            self._value = self._value or [_value_projection(a) for a in self._attn]
        except StorylensError as e:
            return str(e)
        return super().moving_unsupported()

    def _projection_hook(self, layer: int, part: str, site: HookSite, fn: HookFn) -> RemovableHandle:
        """``hook_q`` / ``hook_k`` / ``hook_v``: on the projection's output, before rotary embeddings
        (as TransformerLens's), ``[batch, tokens, heads, head_size]`` with the query heads for ``q`` and
        the key/value heads for ``k`` and ``v``."""
        module, kind = _projection(self._attn[layer], part)
        n = self.n_head if part == "q" or kind != "own" else self.n_kv_head
        return module.register_forward_hook(_split_hook(fn, site, kind, part, n))

    def add_hook(self, name: str, fn: HookFn) -> RemovableHandle:
        layer, kind = self._parse_hook(name)
        site = HookSite(name, layer)
        if kind in ("hook_q", "hook_k", "hook_v"):
            return self._projection_hook(layer, kind[-1], site, fn)
        if kind in ("hook_resid_pre", "hook_resid_post"):
            return _residual_hooks(self.layers[layer], kind, fn, site)
        if kind in ("hook_attn_out", "hook_mlp_out"):
            module = self._proj[layer] if kind == "hook_attn_out" else getattr(self.layers[layer], "mlp", None)
            if not isinstance(module, nn.Module):
                raise StorylensError(f"{type(self.layers[layer]).__name__}: cannot find its MLP (mlp) for {name}")
            return module.register_forward_hook(lambda m, args, out: fn(out, site))
        if kind == "hook_pattern":

            def read(module: nn.Module, inputs: tuple, output: Any) -> None:
                pattern = output[1] if isinstance(output, tuple) and len(output) > 1 else None
                if pattern is None:
                    raise StorylensError(
                        f"{type(module).__name__}: returned no attention weights (storylens needs its own or eager attention)"
                    )
                fn(pattern, site)

            return self._attn[layer].register_forward_hook(read)
        H = self.n_head

        def z(module: nn.Module, args: tuple) -> tuple | None:
            x = args[0]
            B, T, C = x.shape
            out = fn(x.view(B, T, H, C // H), site)
            return None if out is None else (out.reshape(B, T, C),) + tuple(args[1:])

        return self._proj[layer].register_forward_pre_hook(z)

    def forward(self, ids: torch.Tensor, *, record_attention: bool = False, logits: bool = True) -> torch.Tensor | None:
        with self._fused(not record_attention):
            if not logits:  # the decoder only: no output head (for a 50k vocabulary, the largest tensor by far)
                getattr(self.module, "base_model", self.module)(input_ids=ids, use_cache=False)
                return None
            return self.module(input_ids=ids, use_cache=False).logits

    def fused(self) -> AbstractContextManager:
        return self._fused(True)

    def _fused(self, wanted: bool) -> AbstractContextManager:
        """transformers' sdpa attention in every block whose probabilities nobody reads (no
        ``hook_pattern`` or other forward hook on its attention), where storylens's attention runs."""
        if not wanted or getattr(self.module.config, "_attn_implementation", None) != ATTENTION:
            return contextlib.nullcontext()
        return fused_attention([t for a, t in zip(self._attn, self._taps) if not a._forward_hooks])

    def blocks(self) -> list[nn.Module] | None:
        return list(self.layers)

    def _new_cache(self) -> dict:
        """The keyword argument that hands the model an explicit, empty ``DynamicCache`` (filled in
        place): ``cache`` from transformers 5.24 (``past_key_values`` is deprecated there), else
        ``past_key_values``."""
        from transformers import DynamicCache

        try:
            params: Mapping[str, inspect.Parameter] = inspect.signature(self.module.forward).parameters
        except (TypeError, ValueError):
            params = {}
        name = "cache" if "cache" in params else "past_key_values"
        try:
            cache = DynamicCache(config=self.module.config)  # per-layer kinds (sliding windows) from the config
        except TypeError:  # transformers before DynamicCache(config=)
            cache = DynamicCache()
        return {name: cache}

    def generate_stream(
        self,
        idx,
        max_new_tokens,
        *,
        temperature=1.0,
        top_k=None,
        generator=None,
        use_kv_cache=True,
        record_attention=False,
        eos_id=None,
    ):
        """Sample token by token with transformers' own KV cache (a ``DynamicCache``, passed explicitly)."""
        if idx.shape[1] + max_new_tokens > self.window:
            raise ValueError(f"{idx.shape[1] + max_new_tokens} tokens do not fit the {self.window}-token window")
        cache = self._new_cache() if use_kv_cache else {}
        feed, seq, done = idx.to(self.device), idx.to(self.device), 0
        last_rows: dict[int, torch.Tensor] = {}  # per block, this step's newest query's row [head, key]

        def keep_row(pattern: torch.Tensor, hook: Hook) -> None:
            last_rows[hook.layer] = pattern[0, :, -1]

        keep = [(f"blocks.{i}.attn.hook_pattern", keep_row) for i in range(self.n_layer)] if record_attention else []
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                with self.hooks(keep):  # only while the model runs: none is left in it between steps
                    if use_kv_cache:
                        out = self.module(input_ids=feed, use_cache=True, **cache)  # the cache fills in place
                    else:
                        out = self.module(input_ids=seq, use_cache=False)
                done += feed.shape[1] if use_kv_cache else seq.shape[1]
                logits = out.logits[:, -1].float()
                token = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
                rows = [last_rows.pop(i) for i in range(self.n_layer)] if record_attention else None
                yield GenerationStep(int(token), logits[0], rows, done)
                if eos_id is not None and int(token) == eos_id:
                    return
                feed = token.view(1, 1).to(self.device)
                seq = torch.cat([seq, feed], dim=1)


# ---------------------------------------------------------------- loading


ModelLike: TypeAlias = "GPT | PreTrainedModel | AttentionLM"
"""What the public entry points take as a model: storylens's GPT, a transformers causal LM or an
:class:`AttentionLM`; each calls :func:`wrap` once and hands the :class:`AttentionLM` on."""


def wrap(model: ModelLike, tokenizer=None, name: str | None = None) -> AttentionLM:
    """An :class:`AttentionLM` for a model in memory: storylens's GPT or a transformers causal LM
    (with its tokenizer). An :class:`AttentionLM` is returned as it is."""
    if isinstance(model, AttentionLM):
        return model
    if isinstance(model, GPT):
        return NativeLM(model, tokenizer, **({"name": name} if name else {}))
    if hasattr(model, "config") and isinstance(model, nn.Module):
        if tokenizer is None:
            raise StorylensError(f"{type(model).__name__}: pass its tokenizer (a transformers fast tokenizer)")
        return TransformersLM(model, tokenizer, name)
    raise StorylensError(f"{type(model).__name__}: not a causal language model storylens can read")


def is_transformers_folder(path: Path) -> bool:
    """A transformers model folder: a config.json with ``model_type`` (storylens's own has none)."""
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError, AttributeError):
        return False


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE = re.compile(r"^(cpu|mps|cuda(?::\d+)?)$")


def resolve_dtype(dtype, option: str = "dtype") -> torch.dtype | None:
    """``dtype`` as a torch dtype: a torch floating dtype or one of :data:`DTYPES`' names."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise UsageError(f"{option} {dtype}: not a dtype storylens runs in ({', '.join(DTYPES)})")


def resolve_device(device, option: str = "device") -> torch.device | None:
    """``device`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``) as a torch device, refused in one line when
    it is not a device at all (:class:`UsageError`) or not one this machine has."""
    if device is None:
        return None
    text = str(device)
    if not _DEVICE.match(text):
        raise UsageError(f"{option} {text}: not a device (cpu, cuda, cuda:N, mps)")
    if text.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise StorylensError(
                f"{option} {text}: not available on this machine (torch {torch.__version__} sees no CUDA device)"
            )
        index = int(text.split(":")[1]) if ":" in text else 0
        if index >= n:
            seen = "cuda:0" if n == 1 else f"cuda:0 .. cuda:{n - 1}"
            raise StorylensError(
                f"{option} {text}: not available on this machine (torch sees {n} CUDA "
                f"device{'s' if n > 1 else ''}: {seen})"
            )
    if text == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise StorylensError(
                f"{option} mps: not available on this machine "
                f"(torch {torch.__version__} has no usable MPS backend here)"
            )
    return torch.device(text)


class _NotFound(StorylensError):
    """Not a transformers model that can be found here: :func:`load_lm` then tries storylens's own loader."""


def load_lm(
    source: str | os.PathLike | None = None,
    *,
    allow_download: bool = False,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> AttentionLM:
    """Open ``source``: a storylens model folder (default: the shipped Tiny Storyteller), a
    transformers model folder, or a hub id (only with ``allow_download``, unless cached), in
    ``dtype`` (default: as stored) on ``device`` (default: the CPU).

    Refused in one line (:class:`StorylensError`): a model whose weights do not all match its
    config, hold NaN or infinite numbers, are pickled (only safetensors is read), that is not
    a causal language model, whose config or tokenizer config names custom code (never run), or
    whose config gives sizes that are no sizes or past this machine's memory or its weights
    (:mod:`storylens.lm.configs`, before anything is built)."""

    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    if source is not None and (Path(source) / "config.json").is_file() and is_transformers_folder(Path(source)):
        return _load_transformers(str(source), allow_download=False, dtype=dtype, device=device)
    if source is not None and not Path(source).exists():
        try:
            with hub_offline(not allow_download):
                return _load_transformers(str(source), allow_download=allow_download, dtype=dtype, device=device)
        except _NotFound:
            pass  # not a transformers model on the hub: try storylens's own loader (and its message)
    model = load_model(source, allow_download=allow_download)  # refuses NaN or infinite weights itself
    where = (model.source_folder or Path(str(source))) / "model.safetensors"
    model = _move(model, str(source or "the shipped model"), dtype, device)
    if dtype is not None:
        _check_finite(model, lambda k: str(where), cast=dtype)
    return NativeLM(model)


def _move(model: _M, source: str, dtype: torch.dtype | None, device: torch.device | None) -> _M:
    if dtype is None and device is None:
        return model
    try:
        if device is not None:
            model = model.to(device=device)
        return model if dtype is None else model.to(dtype=dtype)
    except (RuntimeError, TypeError) as e:  # float64 on MPS, out of device memory, ...
        what = " as ".join(str(x).replace("torch.", "") for x in (device, dtype) if x is not None)
        raise StorylensError(f"{source}: cannot run on {what} ({_one_line(e)[:200]})") from None


def _check_finite(model: nn.Module, where: Callable[[str], str], cast: torch.dtype | None = None) -> None:
    """Refuse a parameter holding NaN or infinite numbers (``cast``: the dtype it was just cast to,
    whose range it may have overflowed)."""
    with torch.no_grad():
        for k, p in model.named_parameters():  # a tied weight once
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                if cast is not None:
                    name = str(cast).replace("torch.", "")
                    raise StorylensError(
                        f"{where(k)}: {k} holds numbers beyond {name}'s range (infinite once "
                        "cast); run it in float32 or bfloat16"
                    )
                raise StorylensError(f"{where(k)}: {k} holds NaN or infinite numbers")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' loader chatter (its load report, progress bars, warnings) kept off stderr:
    storylens says what is wrong in its own single line."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")
_OTHER_WEIGHTS = ("*.h5", "*.msgpack", "*.gguf", "*.onnx")


def _check_weight_files(folder: Path) -> None:
    """Only safetensors is read: a folder with pickled (or other) weights and none in safetensors is
    refused before transformers sees it (unpickling a file runs code it holds)."""
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(f.name for pattern in _PICKLES for f in folder.glob(pattern))
    if pickles:
        raise StorylensError(
            f"{folder}: holds pickled weights ({', '.join(pickles[:3])}), which storylens never opens (unpickling "
            "runs code the file holds); storylens reads only safetensors weights: convert them where you trust "
            "the file (transformers' from_pretrained, then save_pretrained, writes model.safetensors)"
        )
    other = sorted(f.name for pattern in _OTHER_WEIGHTS for f in folder.glob(pattern))
    raise StorylensError(
        f"{folder}: no model.safetensors"
        + (f" (only {', '.join(other[:3])})" if other else "")
        + "; storylens reads only safetensors weights"
    )


def _check_causal(source: str, config) -> None:
    """A causal language model (decoder-only) by its config, before any weight is read."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise StorylensError(
            f"{source}: is a `{kind}` model, not a causal language model (transformers "
            f"{transformers.__version__} has no causal-LM class for `{kind}`)"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise StorylensError(
            f"{source}: is a `{kind}` model (sequence-to-sequence), not a causal language model; "
            "storylens reads decoder-only models (GPT-2, GPT-Neo, Llama, ...)"
        )
    if (
        kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(config, "is_decoder", False)
        and not getattr(config, "causal", False)
    ):
        raise StorylensError(
            f"{source}: is a `{kind}` model (encoder-only), not a causal language model; "
            "storylens reads decoder-only models (GPT-2, GPT-Neo, Llama, ...)"
        )


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _tied_names(model: nn.Module) -> set[str]:
    """The weights that are another weight (``lm_head.weight`` as the embedding): legitimately
    absent from the file."""
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers 5: the ties in force, target -> source
    if tied is None:  # transformers 4: the class's tieable names, tied when the config says so
        if not getattr(getattr(model, "config", None), "tie_word_embeddings", True):
            return set()
        tied = getattr(model, "_tied_weights_keys", None) or ()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def _check_loading_info(source: str, model: nn.Module, info: dict) -> None:
    """Every weight of the model from the file, nothing else, each the shape the config implies."""

    def matching(keys, patterns):
        return [k for k in keys if not any(re.search(p, k) for p in patterns or ())]

    missing = set(info.get("missing_keys") or ()) - _tied_names(model)
    missing = matching(missing, getattr(model, "_keys_to_ignore_on_load_missing", None))
    unexpected = matching(
        set(info.get("unexpected_keys") or ()), getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    )
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: _natural(m[0]))
    if not (missing or unexpected or mismatched):
        return

    def few(names):
        names = sorted(names, key=_natural)
        return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({few(unexpected)})")
    if mismatched:
        k, got, want = mismatched[0]
        parts.append(
            f"{len(mismatched)} of the wrong shape ({k}: {list(got)} in the file, "
            f"{list(want)} by config.json{', ...' if len(mismatched) > 1 else ''})"
        )
    raise StorylensError(f"{source}: weights do not match config.json: {'; '.join(parts)}")


def _weights_file(source: str) -> Callable[[str], str]:
    """The file a weight was read from (a sharded checkpoint's index names it), for messages."""
    folder = Path(source)
    if not folder.is_dir():
        return lambda k: source
    index = {}
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        pass
    return lambda k: str(folder / index.get(k, "model.safetensors"))


def _load_transformers(source: str, *, allow_download: bool, dtype, device) -> TransformersLM:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise StorylensError(
            f"{source}: a transformers model needs the transformers package: {install_hint('hf')}"
        ) from None
    # never custom code: transformers would ask on stdin, and run it on "y"
    kw = {"local_files_only": not allow_download, "trust_remote_code": False}
    folder = Path(source) if Path(source).is_dir() else None
    if folder is not None:
        _check_weight_files(folder)
    with _quiet_transformers():
        try:
            check_no_custom_code(source, {"local_files_only": not allow_download})
            config = AutoConfig.from_pretrained(source, **kw)
        except CONFIG_ERRORS as e:
            raise _NotFound(
                f"{source}: cannot load as a transformers causal LM ({type(e).__name__}: {_one_line(e)[:200]})"
            ) from None
        _check_causal(source, config)
        check_sizes(source, config, folder)  # before anything is built
        try:
            tok = AutoTokenizer.from_pretrained(source, **kw)
            # safetensors only (nothing is unpickled); a wrong shape is reported below, not raised
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                source,
                config=config,
                attn_implementation="eager",
                use_safetensors=True,
                ignore_mismatched_sizes=True,
                output_loading_info=True,
                **kw,
            )
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise StorylensError(
                f"{source}: cannot load as a transformers causal LM ({type(e).__name__}: {_one_line(e)[:200]})"
            ) from None
    model, info = loaded  # output_loading_info: (model, loading info)
    _check_loading_info(source, model, info)
    _check_finite(model, _weights_file(source))
    model.eval()
    model = _move(model, source, dtype, device)
    if dtype is not None:
        _check_finite(model, _weights_file(source), cast=dtype)
    try:
        lm = TransformersLM(model, tok, name=source)
    except StorylensError as e:
        raise StorylensError(f"{source}: {e}") from None
    if Path(source).is_dir():
        lm.source_folder = Path(source)
    return lm
