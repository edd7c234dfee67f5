"""Byte-level BPE (Hugging Face ``tokenizers``), trained on the training stories only.

The end-of-story marker ``<|endoftext|>`` is token 0. In the training stream it follows
every story, so it also opens the next; a single story fed to the model is
``[marker] + story``, cut to the window (:func:`encode_story`).

Story text is text: the characters ``<|endoftext|>`` written inside a story, a JSON field or a
prompt are encoded as the bytes they are, never as the marker token (:func:`text_only`). Only
storylens itself puts the marker in, between stories; so the marker detector counts real
markers only, and a story cannot forge one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from storylens.core.errors import StorylensError
from storylens.core.files import MAX_SMALL_BYTES, checked_file
from storylens.data.stories import EOT

DEFAULT_VOCAB = 4096


def train_tokenizer(stories: Iterable[str], vocab_size: int = DEFAULT_VOCAB) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stories, trainer=trainer)
    return text_only(tok)


def text_only(tok: Tokenizer) -> Tokenizer:
    """``tok``, set to encode special tokens' text as plain text (``encode_special_tokens``)."""
    if not tok.encode_special_tokens:
        tok.encode_special_tokens = True
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    path = Path(path)
    if not path.exists():
        raise StorylensError(f"{path}: tokenizer file not found")
    checked_file(path, MAX_SMALL_BYTES)  # a regular file of a tokenizer's size (a FIFO would block the read)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise StorylensError(f"{path}: not a valid tokenizer.json ({e})") from None
    if tok.token_to_id(EOT) is None:
        raise StorylensError(f"{path}: tokenizer has no {EOT} token")
    return text_only(tok)


def eot_id(tok: Tokenizer) -> int:
    i = tok.token_to_id(EOT)
    if i is None:
        raise StorylensError(f"tokenizer: has no end-of-story marker {EOT}")
    return i


@dataclass(frozen=True)
class StoryIds:
    """One story as the model reads it: its ids cut to the window."""

    ids: list[int]  # [marker] + story tokens, at most `window` of them
    cut: bool  # True when the story did not fit and was cut
    full_length: int  # tokens before cutting (marker included)


def encode_story(tok: Tokenizer, text: str, window: int = 256) -> StoryIds:
    ids = [eot_id(tok)] + text_only(tok).encode(text).ids
    return StoryIds(ids=ids[:window], cut=len(ids) > window, full_length=len(ids))


def encode_stream(tok: Tokenizer, stories: Iterable[str]) -> list[int]:
    """The training stream: ``<eot> s1 <eot> s2 ... <eot> sN <eot>``."""
    e = eot_id(tok)
    out = [e]
    for enc in text_only(tok).encode_batch(list(stories)):
        out.extend(enc.ids)
        out.append(e)
    return out
