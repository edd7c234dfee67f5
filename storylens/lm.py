"""A causal language model whose attention storylens can read: one small interface, two kinds.

* :class:`NativeLM` wraps storylens's own :class:`~storylens.model.GPT` (the Tiny Storyteller);
* :class:`TransformersLM` wraps any transformers ``AutoModelForCausalLM`` (GPT-2, GPT-Neo,
  Llama-style, ...) run with eager attention, which hands back its attention probabilities.

Both give the same handful of things: sizes (``n_layer``, ``n_head``, ``window``), the tokenizer
(a ``tokenizers.Tokenizer``: stories are encoded without special tokens and opened by
``marker_id``, the end-of-story marker / beginning-of-sequence token), a forward pass, and
named hook points in TransformerLens's spirit, through torch's own hooks:

``blocks.{l}.attn.hook_pattern``
    ``[batch, head, query, key]`` attention probabilities of block ``l`` (0-based), read the
    moment they exist (on the native model only on its explicit path: ``patterns=True``).
``blocks.{l}.attn.hook_z``
    ``[batch, query, head, head_size]``: each head's output before the output projection.
    A hook that returns a tensor replaces it (how heads are switched off).

:func:`load_lm` opens a storylens model folder, a transformers model folder, or (with
``allow_download``) a hub id; :func:`wrap` wraps a model already in memory.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from .errors import StorylensError
from .model import GPT, GenerationStep, sample_next

HookFn = Callable[[torch.Tensor], "torch.Tensor | None"]
_HOOK_NAME = re.compile(r"^blocks\.(\d+)\.attn\.(hook_pattern|hook_z)$")


class AttentionLM:
    """The interface (see the module docstring). Subclasses set the attributes in ``__init__``."""

    module: nn.Module
    tokenizer: "object"  # tokenizers.Tokenizer
    marker_id: int
    n_layer: int
    n_head: int
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
        """``tokenizers.Encoding`` per text (ids and character offsets), no special tokens."""
        return self.tokenizer.encode_batch(list(texts), add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """``[marker] + text's tokens``: how storylens feeds every story and prompt."""
        return [self.marker_id] + self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    # --- hooks
    def hook_names(self) -> list[str]:
        return [f"blocks.{i}.attn.{k}" for i in range(self.n_layer) for k in ("hook_pattern", "hook_z")]

    def _parse_hook(self, name: str) -> tuple[int, str]:
        m = _HOOK_NAME.match(name)
        if not m or not 0 <= int(m.group(1)) < self.n_layer:
            raise StorylensError(f"hook {name!r}: no such hook point (blocks.0 .. blocks.{self.n_layer - 1}, "
                                 "attn.hook_pattern or attn.hook_z)")
        return int(m.group(1)), m.group(2)

    def add_hook(self, name: str, fn: HookFn):
        """Call ``fn(tensor)`` at hook point ``name`` on every forward pass; returns a handle with
        ``.remove()``."""
        raise NotImplementedError

    @contextlib.contextmanager
    def hooks(self, hooks: list[tuple[str, HookFn]]) -> Iterator[None]:
        """``with lm.hooks([(name, fn), ...]):`` the hooks live for the ``with`` block only."""
        handles = []
        try:
            for name, fn in hooks:
                handles.append(self.add_hook(name, fn))
            yield
        finally:
            for h in handles:
                h.remove()

    # --- running
    def forward(self, ids: torch.Tensor, *, patterns: bool = False, logits: bool = True) -> torch.Tensor | None:
        """Run ``ids [batch, tokens]`` (stories padded at the end). ``patterns=True`` makes every
        ``hook_pattern`` fire; ``logits=False`` may skip the output head. Returns the logits
        ``[batch, tokens, vocab]`` or None."""
        raise NotImplementedError

    def attention(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Every block's ``[batch, head, query, key]`` map for ``ids`` (one call, all kept)."""
        maps: list[torch.Tensor | None] = [None] * self.n_layer

        def keep(layer):
            def fn(t):
                maps[layer] = t.detach()
            return fn

        with self.hooks([(f"blocks.{i}.attn.hook_pattern", keep(i)) for i in range(self.n_layer)]):
            self.forward(ids, patterns=True, logits=False)
        return maps  # type: ignore[return-value]

    def generate_stream(self, idx: torch.Tensor, max_new_tokens: int, **kw) -> Iterator[GenerationStep]:
        raise NotImplementedError


# ---------------------------------------------------------------- storylens's own GPT


class NativeLM(AttentionLM):
    def __init__(self, model: GPT, tokenizer=None, name: str = "Tiny Storyteller"):
        from .tokenizer import eot_id

        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise StorylensError("model: has no tokenizer (load it with storylens.hub.load_model, or pass one)")
        self.module, self.tokenizer = model, tokenizer
        self.marker_id = eot_id(tokenizer)
        cfg = model.config
        self.n_layer, self.n_head, self.window, self.vocab_size = cfg.n_layer, cfg.n_head, cfg.block_size, cfg.vocab_size
        self.name = name
        self.source_folder = getattr(model, "source_folder", None)

    def add_hook(self, name, fn):
        self._parse_hook(name)
        return self.module.hook_points()[name].register_forward_hook(lambda m, i, o: fn(o))

    def forward(self, ids, *, patterns=False, logits=True):
        out = self.module(ids, record_attention=patterns, keep_attention=False, compute_logits=logits)
        return out.logits

    def generate_stream(self, idx, max_new_tokens, **kw):
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


class TransformersLM(AttentionLM):
    """A transformers causal LM, run with eager attention (the implementation that forms the
    probabilities). Sizes come from its config; the marker is its BOS token (else EOS)."""

    def __init__(self, model: nn.Module, tokenizer, name: str | None = None):
        cfg = model.config
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")
        else:
            cfg._attn_implementation = "eager"
        self.module = model
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "encode_batch"):
            raise StorylensError(f"{type(tokenizer).__name__}: storylens needs a fast (tokenizers) tokenizer")
        self.tokenizer = backend
        marker = getattr(tokenizer, "bos_token_id", None)
        if marker is None:
            marker = getattr(tokenizer, "eos_token_id", None)
        if marker is None:
            raise StorylensError("tokenizer: has neither a beginning-of-sequence nor an end-of-sequence token "
                                 "to open each story with")
        self.marker_id = int(marker)
        self.layers = _decoder_layers(model)
        self.n_layer = len(self.layers)
        self.n_head = int(cfg.num_attention_heads)
        self.window = int(getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 2048)
        self.vocab_size = int(cfg.vocab_size)
        self.name = name or getattr(cfg, "_name_or_path", None) or type(model).__name__
        self._attn = [_attention_of(layer) for layer in self.layers]
        self._proj = [_output_projection(a) for a in self._attn]

    def add_hook(self, name, fn):
        layer, kind = self._parse_hook(name)
        if kind == "hook_pattern":
            def read(module, inputs, output):
                weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
                if weights is None:
                    raise StorylensError(f"{type(module).__name__}: returned no attention weights "
                                         "(storylens needs eager attention)")
                fn(weights)
            return self._attn[layer].register_forward_hook(read)

        H = self.n_head

        def z(module, args):
            x = args[0]
            B, T, C = x.shape
            out = fn(x.view(B, T, H, C // H))
            if out is not None:
                return (out.reshape(B, T, C),) + tuple(args[1:])
        return self._proj[layer].register_forward_pre_hook(z)

    def forward(self, ids, *, patterns=False, logits=True):
        if not logits:  # the decoder only: no output head (for a 50k vocabulary, the largest tensor by far)
            getattr(self.module, "base_model", self.module)(input_ids=ids, use_cache=False)
            return None
        return self.module(input_ids=ids, use_cache=False).logits

    def generate_stream(self, idx, max_new_tokens, *, temperature=1.0, top_k=None, generator=None,
                        use_kv_cache=True, record_attention=False, eos_id=None):
        """Sample token by token with transformers' own KV cache (``past_key_values``)."""
        if idx.shape[1] + max_new_tokens > self.window:
            raise ValueError(f"{idx.shape[1] + max_new_tokens} tokens do not fit the {self.window}-token window")
        cache, feed, seq, done = None, idx.to(self.device), idx.to(self.device), 0
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                rows: list[torch.Tensor] = []
                handles = [self.add_hook(f"blocks.{i}.attn.hook_pattern", lambda t: rows.append(t[0, :, -1]))
                           for i in range(self.n_layer)] if record_attention else []
                try:
                    if use_kv_cache:
                        out = self.module(input_ids=feed, past_key_values=cache, use_cache=True)
                        cache = out.past_key_values
                    else:
                        out = self.module(input_ids=seq, use_cache=False)
                finally:
                    for h in handles:
                        h.remove()
                done += feed.shape[1] if use_kv_cache else seq.shape[1]
                logits = out.logits[:, -1].float()
                token = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
                yield GenerationStep(int(token), logits[0], rows if record_attention else None, done)
                if eos_id is not None and int(token) == eos_id:
                    return
                feed = token.view(1, 1).to(self.device)
                seq = torch.cat([seq, feed], dim=1)


# ---------------------------------------------------------------- loading


def wrap(model, tokenizer=None, name: str | None = None) -> AttentionLM:
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
    import json

    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def load_lm(source: str | os.PathLike | None = None, *, allow_download: bool = False,
            dtype: torch.dtype | None = None) -> AttentionLM:
    """Open ``source``: a storylens model folder (default: the shipped Tiny Storyteller), a
    transformers model folder, or a hub id (only with ``allow_download``, unless cached)."""
    from .hub import hub_offline, load_model

    if source is not None and (Path(source) / "config.json").is_file() and is_transformers_folder(Path(source)):
        return _load_transformers(str(source), allow_download=False, dtype=dtype)
    if source is not None and not Path(source).exists():
        try:
            with hub_offline(not allow_download):
                return _load_transformers(str(source), allow_download=allow_download, dtype=dtype)
        except StorylensError:
            pass  # not a transformers model on the hub: try storylens's own loader (and its message)
    model = load_model(source, allow_download=allow_download)
    if dtype is not None:
        model = model.to(dtype)
    return NativeLM(model)


def _load_transformers(source: str, *, allow_download: bool, dtype) -> TransformersLM:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise StorylensError(f"{source}: a transformers model needs the transformers package: "
                             "pip install 'storylens[hf]'") from None
    hf_logging.disable_progress_bar()
    kw = {"local_files_only": not allow_download}
    try:
        tok = AutoTokenizer.from_pretrained(source, **kw)
        model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", **kw)
    except (OSError, ValueError, KeyError) as e:
        raise StorylensError(f"{source}: cannot load as a transformers causal LM "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    model.eval()
    if dtype is not None:
        model = model.to(dtype)
    lm = TransformersLM(model, tok, name=source)
    if Path(source).is_dir():
        lm.source_folder = Path(source)
    return lm
