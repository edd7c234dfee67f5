"""Generation with its attention recorded: watch the model read while it writes.

:func:`record_generation` runs KV-cached generation with ``record_attention=True``. Each step
computes only the newest token's query, so each step yields that token's attention row over every
key so far (per block, per head); the prompt's own rows come from the first step's forward pass.
Together they fill a whole ``[block, head, query, key]`` map, row by row in the order the model
produced them, which :func:`storylens.viz.replay_widget` replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import StorylensError
from .tokenizer import eot_id


@dataclass
class RecordedGeneration:
    ids: list[int]  # the marker, the prompt's tokens, then the new tokens
    prompt_len: int  # how many of ``ids`` were given (the marker included)
    attention: torch.Tensor  # [block, head, query, key]; row q recorded when token q was read
    stopped_at_marker: bool  # generation ended on the end-of-story marker (not part of ids)


@torch.no_grad()
def record_generation(model, prompt: str, max_new_tokens: int = 100, *, temperature: float = 0.8,
                      top_k: int | None = 40, seed: int = 0, stop_at_marker: bool = True) -> RecordedGeneration:
    """Generate from ``prompt`` (opened by the end-of-story marker) with the KV cache, recording
    the attention of every token as it is read."""
    tok = model.tokenizer
    marker = eot_id(tok)
    ids = [marker] + tok.encode(prompt).ids
    window = model.config.block_size
    if max_new_tokens < 1:
        raise StorylensError("max_new_tokens: record at least one new token")
    if len(ids) + max_new_tokens > window:  # the same refusal as storylens generate
        raise StorylensError(f"prompt ({len(ids)} tokens with the opening marker) + {max_new_tokens} new tokens "
                             f"passes the {window}-token window; ask for fewer tokens")
    idx = torch.tensor([ids])
    # the prompt's rows: one forward pass with the flag on (the same pass generation starts with)
    prompt_maps = model(idx, record_attention=True, compute_logits=False).attentions
    L, H = model.config.n_layer, model.config.n_head
    total = len(ids) + max_new_tokens
    att = torch.zeros(L, H, total, total, dtype=prompt_maps[0].dtype)
    for b, a in enumerate(prompt_maps):
        att[b, :, : len(ids), : len(ids)] = a[0]
    gen = torch.Generator().manual_seed(seed)
    new: list[int] = []
    stopped = False
    # One step more than the tokens kept: step i reads the token sampled at step i - 1 (its row is
    # recorded then) and samples the next; the extra step's sample is dropped.
    n_steps = min(max_new_tokens + 1, window - len(ids))
    steps = model.generate_stream(idx, n_steps, temperature=temperature, top_k=top_k, generator=gen,
                                  record_attention=True, eos_id=None)
    for i, step in enumerate(steps):
        q = len(ids) - 1 + i  # the query this step read: the prompt's last token, then each new one
        for b, row in enumerate(step.attention):
            att[b, :, q, : q + 1] = row
        if len(new) == max_new_tokens:
            break
        if stop_at_marker and step.token == marker:
            stopped = True
            break
        new.append(step.token)
    else:
        if new and n_steps <= max_new_tokens:  # the window had no room for the extra step
            seq = torch.tensor([ids + new])
            last = model(seq, record_attention=True, compute_logits=False).attentions
            q = len(ids) + len(new) - 1
            for b, a in enumerate(last):
                att[b, :, q, : q + 1] = a[0, :, q, : q + 1]
    n = len(ids) + len(new)
    return RecordedGeneration(ids=ids + new, prompt_len=len(ids), attention=att[:, :, :n, :n].contiguous(),
                              stopped_at_marker=stopped)
