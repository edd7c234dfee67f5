"""Turn token ids into display text, and a model run into a plain attention array.

These are the only places in :mod:`storylens.viz` that touch the tokenizer or the
model; every figure and the widget take the resulting plain data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from storylens.data.stories import EOT

EOT_DISPLAY = "<eot>"

# Byte-level BPE writes a space as "Ġ" and a newline as "Ċ" in its vocabulary.
_BYTE_LEVEL_FIXES = {"Ġ": " ", "Ċ": "\n", "ĉ": "\t"}


def token_text(tok, token_id: int, eot_display: str = EOT_DISPLAY) -> str:
    """Display text of one token: decoded alone; the end-of-story marker as ``<eot>``.

    A byte-level token can be part of a UTF-8 character; decoding it alone then gives
    a replacement character, so we fall back to the vocabulary entry with its
    space and newline symbols turned back into a space and a newline.
    """
    raw = tok.id_to_token(int(token_id))
    if raw == EOT:
        return eot_display
    text = tok.decode([int(token_id)], skip_special_tokens=False)
    if "\ufffd" in text or (text == "" and raw):
        text = "".join(_BYTE_LEVEL_FIXES.get(c, c) for c in (raw or ""))
    return text


def token_texts(tok, ids: Sequence[int], eot_display: str = EOT_DISPLAY) -> list[str]:
    """:func:`token_text` for every id."""
    return [token_text(tok, i, eot_display) for i in ids]


def tick_label(text: str, limit: int = 12) -> str:
    """A compact one-line label for a token (axis ticks): trimmed, newline as ``↵``."""
    t = text.replace("\r", "").replace("\n", "↵").replace("\t", "⇥").strip(" ")
    if not t:
        t = "␣"
    if len(t) > limit:
        t = t[: limit - 1] + "…"
    return t


def to_numpy_attention(patterns) -> np.ndarray:
    """``[block, head, query, key]`` float array from what the model or a caller gives.

    Accepts a 4-D array or tensor, or a list with one pattern per block,
    ``[head, query, key]`` or ``[1, head, query, key]`` (``model(...).patterns``).
    """
    if isinstance(patterns, (list, tuple)):
        blocks = []
        for pattern in patterns:
            pattern = _as_numpy(pattern)
            if pattern.ndim == 4:
                if pattern.shape[0] != 1:
                    raise ValueError(f"expected a batch of one story, got batch size {pattern.shape[0]}")
                pattern = pattern[0]
            if pattern.ndim != 3:
                raise ValueError(f"each block's attention must be [head, query, key], got {pattern.shape}")
            blocks.append(pattern)
        arr = np.stack(blocks)
    else:
        arr = _as_numpy(patterns)
    if arr.ndim != 4:
        raise ValueError(f"attention must be [block, head, query, key], got shape {arr.shape}")
    if arr.shape[2] != arr.shape[3]:
        raise ValueError(f"attention must be square in query and key, got {arr.shape}")
    return arr.astype(np.float64, copy=False)


def _as_numpy(a) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor
        a = a.detach().to("cpu").float().numpy()
    return np.asarray(a, dtype=np.float64)
