"""Record one story's attention for the figures and the widget: the model runs here, the drawing in
:mod:`storylens.viz` (which never runs a model)."""

from __future__ import annotations

import torch

from .lm import wrap
from .tokenizer import EncodedStory


def story_attention(model, text: str, window: int | None = None, tokenizer=None):
    """Encode one story as the lesson does (``[marker] + story``, cut to the window) and record its
    attention. ``model``: storylens's GPT, an :class:`~storylens.lm.AttentionLM`, or a transformers
    causal LM with its ``tokenizer``.

    Returns ``(tokens, attention, encoded)``: display texts, a ``[block, head, query, key]`` numpy
    array (float64) and the :class:`~storylens.tokenizer.EncodedStory`."""
    from .viz.tokens import to_numpy_attention, token_texts

    lm = wrap(model, tokenizer)
    window = window or lm.window
    ids = lm.encode(text)
    enc = EncodedStory(ids=ids[:window], cut=len(ids) > window, full_length=len(ids))
    with torch.inference_mode():
        maps = lm.attention(torch.tensor([enc.ids], dtype=torch.long, device=lm.device))
    return token_texts(lm.tokenizer, enc.ids), to_numpy_attention(maps), enc


def attention_widget(model, text: str, title: str | None = None, *, window: int | None = None,
                     tokenizer=None, **kw):
    """Record ``text`` (see :func:`story_attention`) and build the clickable
    :class:`~storylens.viz.AttentionWidget` for it."""
    from .viz import AttentionWidget

    tokens, att, enc = story_attention(model, text, window=window, tokenizer=tokenizer)
    return AttentionWidget.from_recording(text, tokens, att, enc, title, **kw)
