"""Generation with its attention recorded: watch the model read while it writes.

:func:`record_generation` runs KV-cached generation with ``record_attention=True``. Each step
computes only the newest token's query, so each step yields that token's attention row over every
key so far (per block, per head); the prompt's own rows come from the first step's forward pass.
Together they fill a whole ``[block, head, query, key]`` map, row by row in the order the model
produced them, which :func:`storylens.viz.replay_widget` replays.

:func:`stream_text` turns generated tokens into text as they arrive (``tokenizers``'
``DecodeStream``): a character split across byte-level tokens is written once it is whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from tokenizers.decoders import DecodeStream

from storylens.core.errors import StorylensError
from storylens.lm.hooks import AttentionLM
from storylens.lm.loader import ModelLike, wrap


@dataclass
class RecordedGeneration:
    ids: list[int]  # the marker, the prompt's tokens, then the new tokens
    prompt_len: int  # how many of ``ids`` were given (the marker included)
    patterns: torch.Tensor  # [block, head, query, key]; row q recorded when token q was read
    stopped_at_marker: bool  # generation ended on the end-of-story marker (not part of ids)


@torch.no_grad()
def record_generation(
    model: ModelLike,
    prompt: str,
    max_new_tokens: int = 100,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    stop_at_marker: bool = True,
) -> RecordedGeneration:
    """Generate from ``prompt`` (opened by the end-of-story marker) with the KV cache, recording
    the attention of every token as it is read. ``model``: storylens's GPT, an
    :class:`~storylens.lm.AttentionLM` or a transformers causal LM (the latter with eager attention)."""

    lm = wrap(model)
    marker = lm.marker_id
    ids = lm.encode(prompt)
    window = lm.window
    _check_room(len(ids), max_new_tokens, window)
    device = lm.device
    idx = torch.tensor([ids], device=device)
    patterns = _prompt_rows(lm, idx, len(ids) + max_new_tokens)
    gen = torch.Generator(device=device).manual_seed(seed)  # sampling draws on the model's device
    new: list[int] = []
    stopped = False
    # One step more than the tokens kept: step i reads the token sampled at step i - 1 (its row is
    # recorded then) and samples the next; the extra step's sample is dropped.
    n_steps = min(max_new_tokens + 1, window - len(ids))
    steps = lm.generate_stream(
        idx, n_steps, temperature=temperature, top_k=top_k, generator=gen, record_attention=True, eos_id=None
    )
    for i, step in enumerate(steps):
        q = len(ids) - 1 + i  # the query this step read: the prompt's last token, then each new one
        for b, row in enumerate(step.pattern_rows or ()):
            # a sliding-window cache (Mistral, Gemma 2 local layers) holds only the latest keys: the row's last
            # key is the query itself, and every key before the row's start lies outside the window (weight 0)
            patterns[b, :, q, q + 1 - row.shape[-1] : q + 1] = row
        if len(new) == max_new_tokens:
            break
        if stop_at_marker and step.token == marker:
            stopped = True
            break
        new.append(step.token)
    else:
        if new and n_steps <= max_new_tokens:  # the window had no room for the extra step
            _last_row(lm, ids + new, patterns)
    n = len(ids) + len(new)
    return RecordedGeneration(
        ids=ids + new, prompt_len=len(ids), patterns=patterns[:, :, :n, :n].contiguous(), stopped_at_marker=stopped
    )


def _check_room(n_prompt: int, max_new_tokens: int, window: int) -> None:
    """Refuse a recording of no new token, or of more tokens than the window holds (``n_prompt``:
    the prompt's tokens with the opening marker)."""
    if max_new_tokens < 1:
        raise StorylensError("max_new_tokens: record at least one new token")
    if n_prompt + max_new_tokens > window:  # the same refusal as storylens generate
        raise StorylensError(
            f"prompt ({n_prompt} tokens with the opening marker) + {max_new_tokens} new tokens "
            f"passes the {window}-token window; ask for fewer tokens"
        )


def _prompt_rows(lm: AttentionLM, idx: torch.Tensor, total: int) -> torch.Tensor:
    """A zero ``[block, head, total, total]`` map holding the prompt ``idx``'s rows: one forward pass
    with the flag on (the same pass generation starts with)."""
    prompt_patterns = lm.patterns(idx)
    n = idx.shape[1]
    patterns = torch.zeros(lm.n_layer, lm.n_head, total, total, dtype=prompt_patterns[0].dtype, device=lm.device)
    for b, p in enumerate(prompt_patterns):
        patterns[b, :, :n, :n] = p[0]
    return patterns


def _last_row(lm: AttentionLM, ids: list[int], patterns: torch.Tensor) -> None:
    """Record the last of ``ids``' rows into ``patterns`` with one forward pass over them all (where
    the window had no room for the step that would have read it)."""
    last = lm.patterns(torch.tensor([ids], device=lm.device))
    q = len(ids) - 1
    for b, p in enumerate(last):
        patterns[b, :, q, : q + 1] = p[0, :, q, : q + 1]


def stream_text(tokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """The text of ``tokens`` (a ``tokenizers.Tokenizer``'s ids, e.g. generated one at a time),
    piece by piece as soon as each piece is whole: a character split across byte-level tokens
    waits for its last token. Joined, the pieces are ``tokenizer.decode(tokens)`` (special
    tokens skipped, as ``decode`` does); a character still unfinished when the tokens end is
    written as ``decode`` writes it."""
    stream = DecodeStream(skip_special_tokens=True)
    ids: list[int] = []
    shown = 0
    for token in tokens:
        ids.append(int(token))
        piece = stream.step(tokenizer, int(token))
        if piece:
            shown += len(piece)
            yield piece
    if ids:  # the tail DecodeStream still holds (an unfinished character): decode's replacement
        rest = tokenizer.decode(ids)[shown:]
        if rest:
            yield rest
