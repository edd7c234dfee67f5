"""storylens: read a small GPT's attention, plot it, and score every head over held-out stories."""

__version__ = "0.1.0"

from .errors import StorylensError  # noqa: F401
from .model import GPT, GPTConfig, KVCache, head_label, parse_head_label  # noqa: F401
