"""What a head writes toward the name, and from where it read it: a write-aware score (the idea of LOCOS,
arXiv 2607.01002: find heads by what they write toward the answer, not only by where they look).

Head ``h`` of block ``l`` writes ``o_t = sum_j alpha_tj f_j`` at query ``t``, ``f_j = v_j W_O^h`` key ``j``'s value
through the head's slice of the output projection (no bias; with grouped key/value heads, the value of the
group head ``h`` reads). Read out as direct logit attribution reads it (:mod:`storylens.effects.attribution`):
on the next token's unembedding less the vocabulary's mean, times the final norm's gain (centred for a
LayerNorm), over the final norm's scale at ``t`` frozen at the run's value. Each key's part of it is
``c_tj = alpha_tj (f_j . u_t) / s_t``: what the head writes toward the next token *from* key ``j``.

The queries are the tokens just before a later mention of the main character (``t + 1`` starts a mention that
is not the first: the model must produce the name and an earlier mention is there to copy from). Per head:

``write_name``
    the mean over those queries of ``sum_j c_tj`` over the name's earlier tokens ``j <= t``: the logit the head
    adds to the name *read from the name* (a head that copies the name scores high; one that only looks there,
    writing nothing toward it, does not).
``write_total``
    the same queries' ``sum_j c_tj`` over every key: the head's whole direct push toward the name (DLA at these
    positions; ``write_name`` is the part of it read from the name).

Both pooled per query over stories with the ratio estimator's standard error
(:class:`~storylens.engine.accumulate.RatioAccumulator`: streamed, mergeable). One forward pass per batch records
each block's pattern and values; a block's terms are formed for the chosen queries only (``queries x heads x
keys x d_head`` products), so the pass costs about a recording forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from storylens.core.batching import length_batches
from storylens.core.errors import StorylensError
from storylens.core.heads import Head
from storylens.core.modes import eval_mode
from storylens.effects.attribution import readout_rows
from storylens.engine.accumulate import RatioAccumulator
from storylens.engine.encode import EncodedStory, batch_of
from storylens.engine.readout import norm_scale, readout
from storylens.lm import AttentionLM, Hook
from storylens.lm.hooks import HookFn

WRITE_COLUMNS = ("write_name", "write_name_se", "write_total", "write_total_se")


@dataclass(frozen=True)
class WriteScores:
    """Per head ``[layer, head]`` float64: :data:`WRITE_COLUMNS` (see the module docstring), over ``queries``
    name predictions in ``stories`` stories."""

    name: torch.Tensor
    name_se: torch.Tensor
    total: torch.Tensor
    total_se: torch.Tensor
    queries: int
    stories: int

    def columns(self) -> dict[str, torch.Tensor]:
        return dict(zip(WRITE_COLUMNS, (self.name, self.name_se, self.total, self.total_se)))

    def top(self, k: int) -> list[Head]:
        """The ``k`` heads that write most toward the name from the name (largest ``write_name`` first)."""
        return top_heads(self.name, k)


def top_heads(values: torch.Tensor, k: int) -> list[Head]:
    """The ``k`` heads with the largest ``values [layer, head]``, largest first (ties in block-major order)."""
    H = values.shape[1]
    order = torch.argsort(values.flatten(), descending=True, stable=True)[:k]
    return [Head(int(i) // H, int(i) % H) for i in order]


def name_queries(story: EncodedStory) -> list[int]:
    """The positions ``t`` whose next token starts a later mention of the main character (not the first)."""
    return [p - 1 for p in story.mention_starts[1:] if 1 <= p < len(story.ids)]


class _Block:
    """One batch's terms, block by block, from ``hook_v`` then ``hook_pattern`` (the values come first in
    every block: the pattern's hook takes them). ``b, t [N]``: the chosen queries; ``rows [N, d_model]``:
    their next token's readout direction (before the frozen scale)."""

    def __init__(self, lm: AttentionLM, b: torch.Tensor, t: torch.Tensor, rows: torch.Tensor, name: torch.Tensor):
        self.lm, self.b, self.t, self.rows = lm, b, t, rows
        keys = torch.arange(name.shape[1], device=name.device)
        self.from_name = (name[b] & (keys[None, :] <= t[:, None])).to(rows.dtype)  # [N, T]: earlier name tokens
        self.values: dict[int, torch.Tensor] = {}
        self.name: dict[int, torch.Tensor] = {}  # layer -> [N, H]
        self.total: dict[int, torch.Tensor] = {}

    def value(self, v: torch.Tensor, hook: Hook) -> None:
        self.values[hook.layer] = v.detach()[self.b]  # [N, T, G, d]

    def pattern(self, pattern: torch.Tensor, hook: Hook) -> None:
        layer = hook.layer
        v = self.values.pop(layer, None)
        if v is None:
            raise StorylensError(f"{self.lm.name}: block {layer}'s values were not seen before its pattern")
        N, T, G, d = v.shape
        w_o = self.lm.head_output_weights(layer)  # [H, d, d_model]
        H = w_o.shape[0]
        back = (self.rows @ w_o.to(self.rows).reshape(H * d, -1).T).view(N, G, H // G, d)  # u_t through W_O^h
        f = torch.einsum("ntgd,ngrd->ngrt", v.to(self.rows), back).reshape(N, H, T)  # f_j . u_t  [N, H, T]
        c = pattern.detach()[self.b, :, self.t, :T].to(self.rows) * f  # alpha_tj (f_j . u_t)  [N, H, T]
        self.total[layer] = c.sum(-1)
        self.name[layer] = (c * self.from_name[:, None, :]).sum(-1)


def _batch_terms(lm: AttentionLM, stories: Sequence[EncodedStory], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(name [B, L, H], total [B, L, H], queries [B])``: one batch's per-story sums of the two columns."""
    read = readout(lm)
    if read is None:
        raise StorylensError(f"{lm.name}: its final norm and unembedding cannot be read, so no write can be scored")
    batch = batch_of(stories, lm.marker_id, lm.device)
    mask = torch.zeros(batch.ids.shape, dtype=torch.bool)
    for i, s in enumerate(stories):
        mask[i, name_queries(s)] = True
    b, t = (x.to(lm.device) for x in mask.nonzero(as_tuple=True))
    rows = readout_rows(read, batch.ids[b, t + 1].cpu()).to(lm.device, dtype)  # [N, d_model]
    block = _Block(lm, b, t, rows, batch.name_mask)
    held: dict[str, torch.Tensor] = {}
    handle = read.norm.register_forward_pre_hook(lambda m, args: held.update(x=args[0].detach()))
    hooks: list[tuple[str, HookFn]] = [(f"blocks.{i}.attn.hook_v", block.value) for i in range(lm.n_layer)]
    hooks += [(f"blocks.{i}.attn.hook_pattern", block.pattern) for i in range(lm.n_layer)]
    try:
        with lm.hooks(hooks), torch.inference_mode():
            lm.forward(batch.ids, record_attention=True)  # with the logits: the final norm runs
    finally:
        handle.remove()
    if "x" not in held or len(block.total) != lm.n_layer:
        raise StorylensError(f"{lm.name}: the pass did not reach every block's pattern and the final norm")
    scale = norm_scale(read, held["x"][b, t]).to(dtype)  # [N]
    B, L = len(stories), lm.n_layer
    out = []
    for part in (block.name, block.total):
        per_query = torch.stack([part[i] for i in range(L)], 1) / scale[:, None, None]  # [N, L, H]
        sums = torch.zeros(B, L, per_query.shape[-1], dtype=torch.float64, device=per_query.device)
        out.append(sums.index_add_(0, b, per_query.to(torch.float64)).cpu())
    return out[0], out[1], mask.sum(1)


def write_scores(
    lm: AttentionLM,
    stories: Sequence[EncodedStory],
    *,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> WriteScores:
    """:class:`WriteScores` over ``stories`` (encoded, e.g. the quiz's): one forward per batch. Stories with no
    later mention of a main character add nothing. Terms in float64 for a float64 model, else float32 (a
    term is a sum of ``d_model + d_head`` products; the sums over queries are float64)."""
    dtype = torch.float64 if lm.dtype == torch.float64 else torch.float32
    kept = [s for s in stories if name_queries(s)]
    if not kept:
        raise StorylensError("stories: none mentions its main character twice inside the window")
    name, total = RatioAccumulator((lm.n_layer, lm.n_head)), RatioAccumulator((lm.n_layer, lm.n_head))
    with eval_mode(lm.module):
        for idx in length_batches([len(s.ids) for s in kept], batch_size, None):
            chunk = [kept[i] for i in idx]
            n_sum, t_sum, n = _batch_terms(lm, chunk, dtype)
            name.add(n_sum, n)
            total.add(t_sum, n)
            if progress is not None:
                progress(len(chunk))
    (nm, nse), (tm, tse) = name.result(), total.result()
    return WriteScores(nm, nse, tm, tse, int(name.n), name.count)
