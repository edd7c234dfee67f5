"""The Hugging Face clients (huggingface_hub, transformers, datasets) kept off the network unless asked."""

from __future__ import annotations

import os
from contextlib import contextmanager

# huggingface_hub reads its settings from the environment once, when this is first imported: so
# hub_offline sets the value the client reads (constants.HF_HUB_OFFLINE) itself, besides the variables
import huggingface_hub.constants as hc


@contextmanager
def hub_offline(offline: bool = True):
    """Run the block with the Hugging Face clients in offline mode (no DNS, no socket)."""
    if not offline:
        yield
        return
    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    saved = hc.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hc.HF_HUB_OFFLINE = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
