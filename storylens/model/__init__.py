"""Tiny Storyteller, storylens's own model: the GPT (one file, one flag between fused and explicit
attention, hook points, KV cache), its byte-level BPE tokenizer, sampling, model folders and the
hub, training and its checkpoints."""

from storylens.model.gpt import GPT, GPTConfig, KVCache
from storylens.model.hub import TinyStoryteller, load_model

__all__ = ["GPT", "GPTConfig", "KVCache", "TinyStoryteller", "load_model"]
