"""Any transformers ``AutoModelForCausalLM`` (GPT-2, GPT-Neo, Llama-style, ...) behind the
:class:`~storylens.lm.hooks.AttentionLM` interface, run with storylens's own attention
(:mod:`storylens.lm.attention`), which hands back its probabilities or streams them while a recording runs;
its blocks' attention, projections and residual stream found by structure, with hooks on them."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from storylens.core.errors import StorylensError
from storylens.lm.attention import CHUNK_BYTES, RowConsumer, attach
from storylens.lm.attention import NAME as ATTENTION
from storylens.lm.attention import fused as fused_attention
from storylens.lm.attention import register as register_attention
from storylens.lm.attention import streaming as stream_attention
from storylens.lm.hooks import AttentionLM, Hook, HookFn, HookSite
from storylens.model.gpt import GenerationStep, sample_next

if TYPE_CHECKING:
    pass


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


def _ids_fit(tokenizer: Any, marker: int, model: Any) -> None:
    """Every id the tokenizer can give (its vocabulary with the added tokens, and the opening marker) has a row in
    the model's token embedding; else one line, before any story is run (the embedding's IndexError, or a device
    assert on a GPU, otherwise). A larger embedding than the tokenizer (rows padded for speed) is fine."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    if not isinstance(rows, int):
        return
    top = max(tokenizer.get_vocab_size(with_added_tokens=True) - 1, marker)
    if top >= rows:
        raise StorylensError(
            f"tokenizer: gives ids up to {top:,}, but the model's token embedding has {rows:,} rows "
            "(a tokenizer of another model?)"
        )


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
        _ids_fit(backend, self.marker_id, model)
        self.layers = _decoder_layers(model)
        self.n_layer = len(self.layers)
        self.n_head = int(cfg.num_attention_heads)
        self.n_kv_head = int(getattr(cfg, "num_key_value_heads", None) or self.n_head)
        self.window = int(getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 2048)
        self.vocab_size = int(cfg.vocab_size)
        self.name = name or getattr(cfg, "_name_or_path", None) or type(model).__name__
        self._attn = [_attention_of(layer) for layer in self.layers]
        self._taps = attach(self._attn)  # each attention module's consumer (storylens.lm.attention)
        self._keeps: bool | None = None  # whether the model takes logits_to_keep (found on first use)
        self._proj = [_output_projection(a) for a in self._attn]
        self._value: list[tuple[nn.Module, str]] | None = None  # found when hook_v is first asked for

    def head_output_weights(self, layer: int) -> torch.Tensor:
        proj = self._proj[layer]
        w = cast(torch.Tensor, proj.weight)
        w = w if _is_conv1d(proj) else w.T  # [head * head_size, d_model]
        return w.reshape(self.n_head, -1, w.shape[1])

    def projection_weights(self, layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        module, kind = _projection(self._attn[layer], part)
        n = self.n_head if part == "q" or kind != "own" else self.n_kv_head
        w = cast(torch.Tensor, module.weight)
        w = w if _is_conv1d(module) else w.T  # [d_model, out]
        b = cast(torch.Tensor | None, getattr(module, "bias", None))
        d = w.shape[0]
        if kind == "qkv":  # GPT-2's c_attn: q | k | v side by side
            third = w.shape[1] // 3
            cut = slice("qkv".index(part) * third, ("qkv".index(part) + 1) * third)
            w, b = w[:, cut], None if b is None else b[cut]
        elif kind == "neox":  # per head: q, k, v
            i = "qkv".index(part)
            w = w.reshape(d, n, 3, -1)[:, :, i].reshape(d, -1)
            b = None if b is None else b.reshape(n, 3, -1)[:, i].reshape(-1)
        return w.reshape(d, n, -1).transpose(0, 1), None if b is None else b.reshape(n, -1)

    def projection_modules(self, layer: int) -> list[tuple[nn.Module, tuple[str, ...]]]:
        found: dict[nn.Module, tuple[str, ...]] = {}
        for part in "qkv":
            module, _ = _projection(self._attn[layer], part)
            found[module] = (*found.get(module, ()), part)
        return list(found.items())

    def can_stream(self) -> bool:
        return getattr(self.module.config, "_attn_implementation", None) == ATTENTION  # not switched since

    def streaming(self, consumer: RowConsumer, riding: bool = False) -> AbstractContextManager:
        if not self.can_stream():
            return super().streaming(consumer, riding)
        return stream_attention(self._taps, consumer, self.chunk_bytes, riding)

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

    def forward(
        self, ids: torch.Tensor, *, record_attention: bool = False, logits: bool | torch.Tensor = True
    ) -> torch.Tensor | None:
        with self._fused(not record_attention):
            if isinstance(logits, torch.Tensor):
                return self._logits_at(ids, logits)
            if not logits:  # the decoder only: no output head (for a 50k vocabulary, the largest tensor by far)
                getattr(self.module, "base_model", self.module)(input_ids=ids, **self._cache(len(ids)))
                return None
            return self.module(input_ids=ids, **self._cache(len(ids))).logits

    def _logits_at(self, ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """``[batch, 1, vocab]``: row ``i``'s logits at position ``at[i]``, the output head run at those positions
        only where the model takes transformers' ``logits_to_keep`` (else everywhere, then taken)."""
        keep = torch.unique(at)  # sorted
        if self._keeps is None:
            self._keeps = "logits_to_keep" in self._forward_params()
        extra = {"logits_to_keep": keep} if self._keeps else {}
        out = self.module(input_ids=ids, **self._cache(len(ids)), **extra).logits  # [batch, kept or tokens, vocab]
        rows = torch.arange(len(at), device=out.device)
        where = torch.searchsorted(keep, at) if out.shape[1] == len(keep) else at  # kept, or every position
        return out[rows, where.to(out.device)][:, None]

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

    def _forward_params(self) -> Mapping[str, inspect.Parameter]:
        """The model's ``forward``'s parameters (none where its signature cannot be read)."""
        try:
            return inspect.signature(self.module.forward).parameters
        except (TypeError, ValueError):
            return {}

    def _prefill(self, prefix: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every block's keys and values of ``prefix`` ``[batch, kv head, p, head size]``, by a run of the decoder
        (no output head) into transformers' own cache (its ``layers``, or in older transformers its
        ``key_cache`` and ``value_cache``); None where the cache holds them in neither form."""
        kw = self._new_cache()
        with torch.no_grad(), self._fused(True):
            getattr(self.module, "base_model", self.module)(input_ids=prefix, use_cache=True, **kw)
        (cache,) = kw.values()
        if hasattr(cache, "layers"):
            kv = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers]
        else:
            kv = list(zip(getattr(cache, "key_cache", []), getattr(cache, "value_cache", [])))
        if len(kv) != self.n_layer or not all(isinstance(t, torch.Tensor) for pair in kv for t in pair):
            return None
        return kv  # type: ignore[return-value]

    def _cache(self, batch: int) -> dict:
        """A forward's cache arguments: outside :meth:`continuing` none; inside a fresh ``DynamicCache`` holding its
        prefix, tiled to ``batch`` rows (the prefix's own tensors are never appended to)."""
        if self._after is None:
            return {"use_cache": False}
        kw = self._new_cache()
        (cache,) = kw.values()
        for i, (k, v) in enumerate(self._tiled_start(batch)):
            cache.update(k, v, i)
        return {"use_cache": True, **kw}

    def _new_cache(self) -> dict:
        """The keyword argument that hands the model an explicit, empty ``DynamicCache`` (filled in
        place): ``cache`` from transformers 5.24 (``past_key_values`` is deprecated there), else
        ``past_key_values``."""
        from transformers import DynamicCache

        name = "cache" if "cache" in self._forward_params() else "past_key_values"
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
