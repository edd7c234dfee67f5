"""One interface to any causal LM: storylens's GPT or a transformers model, with the same hook names
(``blocks.{l}.attn.hook_pattern``), hooks called ``fn(tensor, hook)``, each block's attention as a
pattern ``[batch, head, query, key]``, and loading that refuses what is not what it claims."""

from storylens.lm.interface import (
    DTYPES,
    AttentionLM,
    Hook,
    HookFn,
    HookSite,
    ModelLike,
    NativeLM,
    TransformersLM,
    is_transformers_folder,
    load_lm,
    resolve_device,
    resolve_dtype,
    wrap,
)

__all__ = [
    "DTYPES",
    "AttentionLM",
    "Hook",
    "HookFn",
    "HookSite",
    "ModelLike",
    "NativeLM",
    "TransformersLM",
    "is_transformers_folder",
    "load_lm",
    "resolve_device",
    "resolve_dtype",
    "wrap",
]
