"""storylens: read a causal language model's attention, plot it, and score every head over stories."""

__version__ = "0.1.0"

from storylens.core.errors import StorylensError
from storylens.core.heads import Head, head_label, parse_head_label
from storylens.lm import AttentionLM, load_lm, wrap
from storylens.model.gpt import GPT, GPTConfig, KVCache
from storylens.model.hub import load_model
from storylens.recording import attention_widget, story_attention

__all__ = [
    "GPT",
    "AttentionLM",
    "GPTConfig",
    "Head",
    "KVCache",
    "StorylensError",
    "attention_widget",
    "head_label",
    "load_lm",
    "load_model",
    "parse_head_label",
    "story_attention",
    "wrap",
]
