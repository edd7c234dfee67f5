"""storylens's own GPT (the Tiny Storyteller) behind the :class:`~storylens.lm.hooks.AttentionLM` interface."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from tokenizers import Tokenizer
from torch import nn
from torch.utils.hooks import RemovableHandle

from storylens.core.errors import StorylensError
from storylens.lm.hooks import AttentionLM, HookFn
from storylens.model.gpt import GPT, GenerationStep, KVCache
from storylens.model.tokenizer import eot_id

if TYPE_CHECKING:
    pass


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

    def projection_weights(self, layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn = self.module.transformer.h[layer].attn
        proj = cast(nn.Linear, getattr(attn, {"q": "query", "k": "key", "v": "value"}[part]))
        w = proj.weight.T.reshape(proj.in_features, self.n_head, -1).transpose(0, 1)  # [head, d_model, head_size]
        return w, None if proj.bias is None else proj.bias.reshape(self.n_head, -1)

    def projection_modules(self, layer: int) -> list[tuple[nn.Module, tuple[str, ...]]]:
        attn = self.module.get_submodule(f"transformer.h.{layer}.attn")
        return [(attn.get_submodule(name), (part,)) for name, part in (("query", "q"), ("key", "k"), ("value", "v"))]

    def token_embedding(self) -> torch.Tensor:
        return self.module.transformer.wte.weight

    def add_hook(self, name: str, fn: HookFn) -> RemovableHandle:
        self._parse_hook(name)
        return self.module.hook_points()[name].add_hook(fn)

    def forward(
        self, ids: torch.Tensor, *, record_attention: bool = False, logits: bool | torch.Tensor = True
    ) -> torch.Tensor | None:
        at = logits if isinstance(logits, torch.Tensor) else None
        cache = None
        if self._after is not None:  # continuing(): a fresh cache holding the prefix, tiled to this batch
            cache = KVCache.empty(self.n_layer)
            for i, (k, v) in enumerate(self._tiled_start(len(ids))):
                cache.update(i, k, v)
        out = self.module(
            ids,
            record_attention=record_attention,
            keep_patterns=False,
            compute_logits=logits is not False,
            at=at,
            kv_cache=cache,
        )
        return out.logits

    def _prefill(self, prefix: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every block's keys and values of ``prefix`` ``[batch, head, p, head size]`` (the model's own cache)."""
        cache = KVCache.empty(self.n_layer, capacity=prefix.shape[1])
        with torch.no_grad():
            self.module(prefix, keep_patterns=False, compute_logits=False, kv_cache=cache)
        return [(k, v) for k, v in zip(cache.key, cache.value) if k is not None and v is not None]

    def blocks(self) -> list[nn.Module] | None:
        return list(self.module.transformer.h)

    def generate_stream(self, idx: torch.Tensor, max_new_tokens: int, **kw: Any) -> Iterator[GenerationStep]:
        return self.module.generate_stream(idx, max_new_tokens, **kw)
