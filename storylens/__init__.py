"""storylens: read a causal language model's attention, plot it, and score every head over stories."""

__version__ = "0.1.0"

from storylens.core.errors import StorylensError  # noqa: F401
from storylens.core.heads import Head, head_label, parse_head_label  # noqa: F401
from storylens.lm import AttentionLM, load_lm, wrap  # noqa: F401
from storylens.model.gpt import GPT, GPTConfig, KVCache  # noqa: F401
from storylens.recording import attention_widget, story_attention  # noqa: F401
