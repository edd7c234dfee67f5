"""One interface to any causal LM: storylens's GPT or a transformers model, with the same hook names
(``blocks.{l}.attn.hook_pattern``), hooks called ``fn(tensor, hook)``, each block's attention as a
pattern ``[batch, head, query, key]``, and loading that refuses what is not what it claims.

``hooks`` the interface and its hook points; ``native`` and ``transformers_lm`` the two kinds of model;
``loader`` opening one from a folder; ``attention`` storylens's attention inside a transformers model;
``configs`` a config checked before anything is built; ``generate`` and ``perplexity`` what any model does."""

from storylens.core.moved import moved_attribute
from storylens.lm.hooks import AttentionLM, Hook, HookFn, HookSite
from storylens.lm.loader import DTYPES, ModelLike, is_transformers_folder, load_lm, resolve_device, resolve_dtype, wrap
from storylens.lm.native import NativeLM
from storylens.lm.transformers_lm import TransformersLM

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


def __getattr__(name: str):
    return moved_attribute(__name__, name)  # storylens.lm.interface, for one release
