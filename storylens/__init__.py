"""storylens: read a causal language model's attention, plot it, and score every head over stories.

The names below are imported when first used (PEP 562), so a process that needs only part of
storylens (a Ray read task reading stories, say) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from storylens.core import moved

moved.install()  # the old module paths of the regroup, for one release (storylens.core.moved)

__version__ = "0.1.0"

_WHERE = {
    "StorylensError": "storylens.core.errors",
    "Head": "storylens.core.heads",
    "head_label": "storylens.core.heads",
    "parse_head_label": "storylens.core.heads",
    "AttentionLM": "storylens.lm",
    "load_lm": "storylens.lm",
    "wrap": "storylens.lm",
    "GPT": "storylens.model.gpt",
    "GPTConfig": "storylens.model.gpt",
    "KVCache": "storylens.model.gpt",
    "load_model": "storylens.model.hub",
    "load_heads": "storylens.lesson.results",
    "load_patch": "storylens.effects.patching",
    "load_circuit": "storylens.circuits.run",
    "score_heads": "storylens.table.scores",
    "attention_widget": "storylens.recording",
    "story_attention": "storylens.recording",
}

if TYPE_CHECKING:
    from storylens.circuits.run import load_circuit
    from storylens.core.errors import StorylensError
    from storylens.core.heads import Head, head_label, parse_head_label
    from storylens.effects.patching import load_patch
    from storylens.lesson.results import load_heads
    from storylens.lm import AttentionLM, load_lm, wrap
    from storylens.model.gpt import GPT, GPTConfig, KVCache
    from storylens.model.hub import load_model
    from storylens.recording import attention_widget, story_attention
    from storylens.table.scores import score_heads

__all__ = [
    "GPT",
    "AttentionLM",
    "GPTConfig",
    "Head",
    "KVCache",
    "StorylensError",
    "attention_widget",
    "head_label",
    "load_circuit",
    "load_heads",
    "load_patch",
    "load_lm",
    "load_model",
    "parse_head_label",
    "score_heads",
    "story_attention",
    "wrap",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'storylens' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
