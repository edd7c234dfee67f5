"""Tiny Storyteller: a GPT-2-style decoder, written to be read.

One file, in the spirit of nanoGPT's ``model.py``:

* ``GPTConfig``  - the numbers that fix the architecture;
* ``CausalSelfAttention`` - query, key and value as separate projections, and one
  flag (``record_attention``) that switches from PyTorch's fused kernel
  (``scaled_dot_product_attention``) to the explicit path that keeps the
  attention probabilities as ``[batch, head, query, key]``;
* ``KVCache`` - "Ella's shelf": the keys and values of every token already seen,
  so that generation computes only the newest token's query, key and value;
* ``GPT`` - embeddings, six blocks, tied output head, and ``generate`` (each new token through
  the same blocks, with the KV cache).

Heads are 0-indexed in tensors. People-facing labels count from 1 (``L5H3`` is
block index 4, head index 2): see :func:`storylens.core.heads.head_label`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.modules.module as _torch_module
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle

from storylens.core.errors import StorylensError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass
class GPTConfig:
    vocab_size: int = 4096
    block_size: int = 256  # the window: the most tokens the model can see at once
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 256  # d_model; head size is n_embd // n_head = 64
    dropout: float = 0.0  # residual and embedding dropout (training only)
    attn_dropout: float | None = None  # dropout on the attention probabilities; None: same as dropout
    bias: bool = True

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config fields: {sorted(unknown)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = d.get(name, getattr(cls, name))
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, not {v!r}")
        for name in ("dropout", "attn_dropout"):
            v = d.get(name, getattr(cls, name))
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1):
                raise ValueError(f"{name} must be a probability below 1, not {v!r}")
        if not isinstance(d.get("bias", True), bool):
            raise ValueError(f"bias must be true or false, not {d['bias']!r}")
        cfg = cls(**d)
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        return cfg

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a model of this config stores (the tied output head as the embedding),
        computed without building the model: a config can be checked against a weights file
        before any memory is spent on it."""
        C, V = self.n_embd, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {
            "transformer.wte.weight": (V, C),
            "transformer.wpe.weight": (self.block_size, C),
        }
        lin = {
            "attn.query": (C, C),
            "attn.key": (C, C),
            "attn.value": (C, C),
            "attn.c_proj": (C, C),
            "mlp.c_fc": (4 * C, C),
            "mlp.c_proj": (C, 4 * C),
        }
        for i in range(self.n_layer):
            p = f"transformer.h.{i}."
            for ln in ("ln_1", "ln_2"):
                shapes[p + ln + ".weight"] = (C,)
                if self.bias:
                    shapes[p + ln + ".bias"] = (C,)
            for name, shape in lin.items():
                shapes[p + name + ".weight"] = shape
                if self.bias:
                    shapes[p + name + ".bias"] = (shape[0],)
        shapes["transformer.ln_f.weight"] = (C,)
        if self.bias:
            shapes["transformer.ln_f.bias"] = (C,)
        return shapes


class KVCache:
    """Ella's shelf: per block, the keys and values of every token seen so far.

    ``key[i]`` and ``value[i]`` are ``[batch, head, tokens, head_size]`` for block i.
    Earlier tokens cannot see later ones, so a stored key or value never changes;
    each new token only appends its own (:meth:`update`). The shelf is allocated once
    for ``capacity`` tokens (generation knows how many it will make), so appending is a
    copy into place, not a new tensor per step; it grows by doubling if it runs out.
    ``kv_computed`` counts the token positions whose key and value were computed (once
    per position, all blocks)."""

    def __init__(self, n_layer: int, capacity: int | None = None):
        self.capacity = capacity
        self._key: list[torch.Tensor | None] = [None] * n_layer
        self._value: list[torch.Tensor | None] = [None] * n_layer
        self._len = [0] * n_layer
        self.kv_computed = 0

    @classmethod
    def empty(cls, n_layer: int, capacity: int | None = None) -> KVCache:
        return cls(n_layer, capacity)

    def length(self, layer: int) -> int:
        return self._len[layer]

    def __len__(self) -> int:
        return self._len[0] if self._len else 0

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys and values for ``layer``; return every key and value so far."""
        n, T = self._len[layer], key.shape[2]
        buf_k, buf_v = self._key[layer], self._value[layer]
        if buf_k is None or buf_v is None or n + T > buf_k.shape[2]:
            size = max(n + T, self.capacity or 0, 2 * buf_k.shape[2] if buf_k is not None else 0)
            B, H, _, D = key.shape
            new_k = key.new_empty(B, H, size, D)
            new_v = value.new_empty(B, H, size, D)
            if n and buf_k is not None and buf_v is not None:
                new_k[:, :, :n] = buf_k[:, :, :n]
                new_v[:, :, :n] = buf_v[:, :, :n]
            self._key[layer], self._value[layer] = buf_k, buf_v = new_k, new_v
        buf_k.narrow(2, n, T).copy_(key)
        buf_v.narrow(2, n, T).copy_(value)
        self._len[layer] = n + T
        return buf_k.narrow(2, 0, n + T), buf_v.narrow(2, 0, n + T)

    @property
    def key(self) -> list[torch.Tensor | None]:
        """Per block, the stored keys (views into the shelf: writing to them changes it)."""
        return [None if k is None else k[:, :, :n] for k, n in zip(self._key, self._len)]

    @property
    def value(self) -> list[torch.Tensor | None]:
        return [None if v is None else v[:, :, :n] for v, n in zip(self._value, self._len)]


def _plain(module: nn.Module) -> bool:
    """Whether calling ``module`` would run its ``forward`` and nothing else: no hook on it or on every module, not
    compiled, not traced (the test ``nn.Module``'s own call makes before it runs ``forward`` alone)."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or _torch_module._global_forward_hooks
        or _torch_module._global_forward_pre_hooks
        or _torch_module._global_backward_hooks
        or _torch_module._global_backward_pre_hooks
        or module._compiled_call_impl is not None
        or torch._C._get_tracing_state()
    )


class Direct(nn.Module):
    """A module whose call is its ``forward`` where nothing else would run (:func:`_plain`), without
    ``nn.Module``'s two layers of dispatch: a token of a KV-cached generation makes about a hundred module calls,
    each about as long as the arithmetic of a small layer. With a hook anywhere, torch's own call."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _plain(self):
            return self.forward(*args, **kwargs)
        return super().__call__(*args, **kwargs)


# torch's layers, called directly where nothing hooks them (the same modules, weights and names)
class Linear(Direct, nn.Linear):
    pass


class LayerNorm(Direct, nn.LayerNorm):
    pass


class Embedding(Direct, nn.Embedding):
    pass


class Dropout(Direct, nn.Dropout):
    pass


class GELU(Direct, nn.GELU):
    pass


class HookPoint(nn.Identity):
    """A named place in the forward pass where torch's own hooks can read an activation.

    It knows its TransformerLens name (``name``, e.g. ``"blocks.4.attn.hook_pattern"``) and its
    block (``layer``, from 0), so one hook function serves every block: :meth:`add_hook` calls
    ``fn(tensor, hook)`` with this point as ``hook`` (TransformerLens's convention), and a tensor
    ``fn`` returns replaces the activation. ``hook_pattern`` fires only on the explicit path
    (``record_attention=True``): the fused kernel never forms the probabilities."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.layer = int(name.split(".")[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The activation itself where no hook is on this point nor on every module (:func:`_plain`: nine points a
        block, each a call on every token of a KV-cached generation); else torch's call."""
        if _plain(self):
            return x
        return super().__call__(x)

    def add_hook(self, fn: Callable[[torch.Tensor, HookPoint], torch.Tensor | None]) -> RemovableHandle:
        """Call ``fn(tensor, self)`` on every forward pass; returns a handle with ``.remove()``."""
        return self.register_forward_hook(lambda module, args, output: fn(output, self))

    def extra_repr(self) -> str:
        return repr(self.name)


def causal_mask(T: int, Tk: int, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[T, Tk]`` additive mask: 0 where query ``past + i`` may see key j (j <= past + i),
    ``-inf`` for the future. Added to the scores, it makes the softmax give the future 0."""
    future = torch.ones(T, Tk, dtype=torch.bool, device=device).triu(past + 1)
    return torch.zeros(T, Tk, dtype=dtype, device=device).masked_fill_(future, float("-inf"))


@dataclass
class GPTOutput:
    logits: torch.Tensor | None  # [batch, tokens, vocab]
    loss: torch.Tensor | None = None
    # one pattern [batch, head, query, key] per block, when record_attention=True
    patterns: list[torch.Tensor] | None = None


class CausalSelfAttention(Direct):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.head_size = config.head_size
        self.query = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.key = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.value = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        p_att = config.dropout if config.attn_dropout is None else config.attn_dropout
        self.attn_dropout = Dropout(p_att)
        self.resid_dropout = Dropout(config.dropout)
        self.dropout = p_att
        # Named hook points (TransformerLens's names, torch's own forward hooks; a hook that returns a
        # tensor replaces the value): blocks.{l}.attn.hook_q, hook_k, hook_v, hook_pattern, hook_z, and
        # blocks.{l}.hook_attn_out (the block's own: resid_pre, mlp_out, resid_post are on Block).
        self.hook_q = HookPoint(f"blocks.{layer_idx}.attn.hook_q")  # [batch, query, head, head_size]
        self.hook_k = HookPoint(f"blocks.{layer_idx}.attn.hook_k")  # [batch, key, head, head_size]
        self.hook_v = HookPoint(f"blocks.{layer_idx}.attn.hook_v")  # [batch, key, head, head_size]: value vectors
        self.hook_pattern = HookPoint(f"blocks.{layer_idx}.attn.hook_pattern")  # [batch, head, query, key]
        self.hook_z = HookPoint(f"blocks.{layer_idx}.attn.hook_z")  # [batch, query, head, head_size], before c_proj
        self.hook_attn_out = HookPoint(f"blocks.{layer_idx}.hook_attn_out")  # [batch, query, n_embd], after c_proj

    def forward(
        self,
        x: torch.Tensor,
        record_attention: bool = False,
        kv_cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``mask``: the additive causal mask of the explicit path, ``[tokens, past + tokens]``
        (:func:`causal_mask`; :meth:`GPT.forward` builds it once for every block)."""
        B, T, C = x.shape
        query = self.hook_q(self.query(x).view(B, T, self.n_head, self.head_size)).transpose(1, 2)
        key = self.hook_k(self.key(x).view(B, T, self.n_head, self.head_size)).transpose(1, 2)
        value = self.hook_v(self.value(x).view(B, T, self.n_head, self.head_size)).transpose(1, 2)

        past = 0
        if kv_cache is not None:  # append this step's keys and values to the shelf, attend to all of them
            past = kv_cache.length(self.layer_idx)
            key, value = kv_cache.update(self.layer_idx, key, value)
        Tk = key.shape[2]

        pattern = None
        if record_attention:
            # The long way: score every earlier token, mask the future, softmax, blend.
            #   scores = query @ key^T / sqrt(head_size), the future set to -inf
            # done as one call (baddbmm adds the mask while it multiplies, and the query is scaled
            # first), so that only one [query, key] temporary is made per block.
            if mask is None:
                mask = causal_mask(T, Tk, past, query.dtype, x.device)
            mask = mask.to(query.dtype).expand(B * self.n_head, T, Tk)
            scaled_query = (query * (1.0 / math.sqrt(self.head_size))).reshape(B * self.n_head, T, self.head_size)
            scores = torch.baddbmm(mask, scaled_query, key.reshape(B * self.n_head, Tk, self.head_size).transpose(1, 2))
            pattern = scores.view(B, self.n_head, T, Tk).softmax(dim=-1)  # [batch, head, query, key]; rows sum to 1
            pattern = self.hook_pattern(pattern)
            y = self.attn_dropout(pattern) @ value
        else:
            # The fused kernel: same maths, no probabilities kept.
            drop = self.dropout if self.training else 0.0
            if past == 0:
                y = F.scaled_dot_product_attention(query, key, value, dropout_p=drop, is_causal=True)
            elif T == 1:  # one new token sees every key on the shelf: nothing to mask
                y = F.scaled_dot_product_attention(query, key, value, dropout_p=drop)
            else:
                allowed = torch.ones(T, Tk, dtype=torch.bool, device=x.device).tril(past)
                y = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=drop)

        z = self.hook_z(y.transpose(1, 2))  # [batch, query, head, head_size]
        y = z.contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.hook_attn_out(self.c_proj(y))), pattern


class MLP(Direct):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = GELU(approximate="tanh")  # GPT-2's gelu_new
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(Direct):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.hook_resid_pre = HookPoint(f"blocks.{layer_idx}.hook_resid_pre")  # [batch, tokens, n_embd]: the input
        self.hook_mlp_out = HookPoint(f"blocks.{layer_idx}.hook_mlp_out")  # [batch, tokens, n_embd]
        self.hook_resid_post = HookPoint(f"blocks.{layer_idx}.hook_resid_post")  # [batch, tokens, n_embd]: the output

    def forward(
        self,
        x: torch.Tensor,
        record_attention: bool = False,
        kv_cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
        attention_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [batch, tokens, n_embd]`` -> the residual stream after this block, and its pattern
        (``record_attention``). ``attention_only``: stop after the attention (its MLP would feed
        only later blocks and the logits) and return ``x`` as it came."""
        x = self.hook_resid_pre(x)
        a, pattern = self.attn(self.ln_1(x), record_attention=record_attention, kv_cache=kv_cache, mask=mask)
        if attention_only:
            return x, pattern
        x = x + a
        x = x + self.hook_mlp_out(self.mlp(self.ln_2(x)))
        return self.hook_resid_post(x), pattern


class Transformer(nn.ModuleDict):
    """GPT-2's ``transformer``: the modules by their GPT-2 names (the weights' names)."""

    wte: nn.Embedding  # token embedding, tied to the output head
    wpe: nn.Embedding  # position embedding
    drop: nn.Dropout
    h: nn.ModuleList  # the blocks
    ln_f: nn.LayerNorm


class GPT(Direct):
    tokenizer: Tokenizer | None = None  # attached by storylens.model.hub's loaders; None when built from a config
    source_folder: Path | None = None  # the folder it was loaded from, if any

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = Transformer(
            dict(
                wte=Embedding(config.vocab_size, config.n_embd),
                wpe=Embedding(config.block_size, config.n_embd),
                drop=Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input/output embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        # Each linear weight is kept as GPT-2's Conv1D keeps it, [in, out] in memory, and seen as nn.Linear's
        # [out, in] (a transposed view; saved files hold the usual [out, in]): one token's matrix-vector products,
        # a KV-cached generation's whole work, then read the weights along their rows, which a CPU's BLAS does
        # about twice as fast for the output head (benchmarks/bench_perf.py); batches run at the same speed.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Every distinct parameter (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def hook_points(self) -> dict[str, HookPoint]:
        """This model's hook points by their TransformerLens names, ``l`` from 0: ``blocks.{l}.hook_resid_pre``
        (the block's input ``[batch, tokens, n_embd]``), ``blocks.{l}.attn.hook_q`` / ``hook_k`` / ``hook_v``
        (``[batch, tokens, head, head_size]``: queries, keys, values), ``blocks.{l}.attn.hook_pattern``
        (``[batch, head, query, key]``, explicit path only), ``blocks.{l}.attn.hook_z`` (``[batch, query,
        head, head_size]``, before the output projection), ``blocks.{l}.hook_attn_out`` (after it,
        ``[batch, tokens, n_embd]``), ``blocks.{l}.hook_mlp_out`` and ``blocks.{l}.hook_resid_post``
        (the block's output)."""
        return {m.name: m for m in self.modules() if isinstance(m, HookPoint)}

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        record_attention: bool = False,
        kv_cache: KVCache | None = None,
        compute_logits: bool = True,
        keep_patterns: bool = True,
        at: torch.Tensor | None = None,
    ) -> GPTOutput:
        """``record_attention=True`` takes the explicit path, whose probabilities are returned as
        ``patterns`` (one ``[batch, head, query, key]`` per block) and passed to each block's
        ``attn.hook_pattern``; ``keep_patterns=False`` leaves them to the hooks only, so no pattern
        outlives its block (how :func:`storylens.analysis.score_heads` streams).
        ``compute_logits=False`` returns no logits and stops after the last block's attention:
        its MLP and the output head feed only the logits (for callers that read attention or the
        KV cache). ``at`` ``[batch]``: the logits at one position a row only, ``[batch, 1, vocab]``."""
        B, T = idx.shape
        past = len(kv_cache) if kv_cache is not None else 0
        if past + T > self.config.block_size:
            raise ValueError(f"{past + T} tokens do not fit the {self.config.block_size}-token window")
        pos = torch.arange(past, past + T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        # the explicit path's causal mask, built once for every block: [tokens, past + tokens]
        mask = causal_mask(T, past + T, past, x.dtype, idx.device) if record_attention else None
        patterns: list[torch.Tensor] | None = [] if record_attention and keep_patterns else None
        last = len(self.transformer.h) - 1
        for i, block in enumerate(self.transformer.h):
            # without logits, the last block's attention is all that is read from here on
            attention_only = not compute_logits and i == last
            x, pattern = block(x, record_attention, kv_cache, mask, attention_only=attention_only)
            if patterns is not None and pattern is not None:
                patterns.append(pattern)
        if kv_cache is not None:
            kv_cache.kv_computed += T
        if not compute_logits:
            return GPTOutput(logits=None, patterns=patterns)
        if at is not None:  # [batch, 1, n_embd]: one position a row (no loss: that needs every one)
            x = x[torch.arange(B, device=x.device), at.to(x.device)][:, None]
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return GPTOutput(logits=logits, loss=loss, patterns=patterns)

    @torch.inference_mode()
    def generate_stream(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        record_attention: bool = False,
        use_kv_cache: bool = True,
        eos_id: int | None = None,
    ) -> Iterator[GenerationStep]:
        """Yield one :class:`GenerationStep` per new token.

        ``idx`` is ``[1, prompt_tokens]``. Prompt plus new tokens must fit the window:
        this model has learned positions only up to ``block_size``, so instead of
        silently sliding (which would re-position every cached key) we refuse up front.
        With ``use_kv_cache=False`` every step recomputes the whole sequence
        (the reference the cache is checked against).
        """
        if idx.dim() != 2 or idx.shape[0] != 1 or idx.shape[1] == 0:
            raise ValueError("generate needs a non-empty prompt of shape [1, tokens]")
        total = idx.shape[1] + max_new_tokens
        if total > self.config.block_size:
            raise ValueError(
                f"prompt ({idx.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"passes the {self.config.block_size}-token window; ask for fewer tokens"
            )
        cache = KVCache.empty(self.config.n_layer, capacity=total) if use_kv_cache else None
        recomputed = 0
        seq = idx
        feed = idx  # the prompt first, then one new token at a time: the same blocks as any forward pass
        for _ in range(max_new_tokens):
            if cache is not None:
                out = self(feed, record_attention=record_attention, kv_cache=cache)
            else:
                out = self(seq, record_attention=record_attention)
                recomputed += seq.shape[1]
            assert out.logits is not None  # compute_logits is on
            logits = out.logits[:, -1, :]
            rows = None
            if out.patterns is not None:  # the newest query's row, per block: [head, key]
                rows = [p[0, :, -1, :] for p in out.patterns]
            token = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
            drawn = int(token)
            yield GenerationStep(
                token=drawn,
                logits=logits[0],
                pattern_rows=rows,
                kv_computed=cache.kv_computed if cache is not None else recomputed,
            )
            if eos_id is not None and drawn == eos_id:
                return
            feed = token.view(1, 1)
            if cache is None:  # recomputing: the whole sequence again
                seq = torch.cat([seq, feed], dim=1)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kw: Any) -> torch.Tensor:
        """Return the prompt followed by the generated tokens, ``[1, tokens]``."""
        new = [s.token for s in self.generate_stream(idx, max_new_tokens, **kw)]
        return torch.cat([idx, torch.tensor([new], dtype=idx.dtype, device=idx.device)], dim=1)


@dataclass
class GenerationStep:
    token: int
    logits: torch.Tensor  # [vocab] the logits this token was drawn from
    pattern_rows: list[torch.Tensor] | None  # per block, [head, key]: the new query's row of the pattern
    kv_computed: int  # key/value computations so far (cache) or positions recomputed so far


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token from ``[1, vocab]`` logits; temperature 0 means greedy.

    The largest logit is subtracted before dividing (in float64), so a tiny temperature gives
    ``0`` for the best token and ``-inf`` for the rest instead of ``inf - inf = nan``. The draw is
    by the inverse of the cumulative distribution, in float64: one uniform number ``u`` and the first
    token whose cumulative probability passes ``u`` (``torch.multinomial`` draws one exponential per
    token of the vocabulary: most of the time of a step of a small model). A token of probability 0
    (below the ``top_k``) is never drawn: the cumulative sum does not pass anything at it."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError("temperature must be a finite number >= 0")
    if temperature == 0:
        _check_finite(torch.isfinite(logits).all())
        return logits.argmax(dim=-1)
    logits = logits.double()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    cumulative = logits.softmax(dim=-1).cumsum(dim=-1)  # [1, vocab] float64, rising to about 1
    total = cumulative[:, -1:]
    _check_finite(torch.isfinite(total).all())  # NaN from a NaN or infinite score (one read, not one per token)
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=logits.device)
    # strictly below the total (u < 1, but its product with the total may round up to it): the token drawn is one
    # whose own probability is above 0
    at = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cumulative, at, right=True).view(-1)


def _check_finite(finite: torch.Tensor) -> None:
    """StorylensError unless ``finite`` (a bool tensor): the draw would be meaningless."""
    if not bool(finite):
        raise StorylensError(
            "generate: the model's next-token scores are NaN or infinite (a number overflows inside it)"
        )
