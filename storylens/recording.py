"""Record one story's attention for the figures and the widget: the model runs here, the drawing in
:mod:`storylens.viz` (which never runs a model)."""

from __future__ import annotations

import torch

from storylens.core.errors import StorylensError
from storylens.lm import ModelLike, wrap
from storylens.model.tokenizer import StoryIds
from storylens.viz import AttentionWidget
from storylens.viz.tokens import to_numpy_attention, token_texts

# What one story's recording for the figures and the widget may hold: every head's [query, key]
# map, in float32 (torch) and float64 (numpy), 12 bytes an entry. A story longer than fits is cut.
FIGURE_BUDGET_BYTES = 256 * 2**20
MIN_FIGURE_TOKENS = 16


def figure_tokens(n_layer: int, n_head: int, budget: int = FIGURE_BUDGET_BYTES) -> int:
    """The longest story (tokens, marker included) whose every map fits ``budget`` bytes."""
    return int((budget / (12 * n_layer * n_head)) ** 0.5)


def story_attention(
    model: ModelLike, text: str, window: int | None = None, tokenizer=None, *, budget: int | None = None
):
    """Encode one story as the lesson does (``[marker] + story``, cut to the window) and record its
    attention. ``model``: storylens's GPT, an :class:`~storylens.lm.AttentionLM`, or a transformers
    causal LM with its ``tokenizer``. The story is also cut to the tokens whose patterns fit ``budget``
    bytes (:func:`figure_tokens`: all 256 on Tiny Storyteller; 287 on a 270-head model), so
    drawing one story never holds gigabytes; a model too large to draw 16 tokens is refused.

    Returns ``(tokens, patterns, encoded)``: display texts, a ``[block, head, query, key]`` numpy
    array (float64) and the :class:`~storylens.model.tokenizer.StoryIds`."""

    lm = wrap(model, tokenizer)
    budget = FIGURE_BUDGET_BYTES if budget is None else budget
    fits = figure_tokens(lm.n_layer, lm.n_head, budget)
    if fits < MIN_FIGURE_TOKENS:
        raise StorylensError(
            f"{lm.name}: {lm.n_layer} x {lm.n_head} heads are too many to draw one story's patterns "
            f"within {budget / 2**20:,.0f} MB (only {fits} tokens would fit)"
        )
    window = min(window or lm.window, fits)
    ids = lm.encode(text)
    enc = StoryIds(ids=ids[:window], cut=len(ids) > window, full_length=len(ids))
    with torch.inference_mode():
        patterns = lm.patterns(torch.tensor([enc.ids], dtype=torch.long, device=lm.device))
    return token_texts(lm.tokenizer, enc.ids), to_numpy_attention(patterns), enc


def attention_widget(
    model: ModelLike,
    text: str,
    title: str | None = None,
    *,
    window: int | None = None,
    tokenizer=None,
    memory_budget: int | None = None,
    **kw,
):
    """Record ``text`` (see :func:`story_attention`; ``memory_budget`` is its ``budget``: raise it
    to show more tokens of a large model) and build the clickable
    :class:`~storylens.viz.AttentionWidget` for it."""

    tokens, patterns, enc = story_attention(model, text, window=window, tokenizer=tokenizer, budget=memory_budget)
    return AttentionWidget.from_recording(text, tokens, patterns, enc, title, **kw)
