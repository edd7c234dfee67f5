"""What a run was made with, typed once for ``storylens score`` and ``storylens report``: the model
and the stories scored. Both summaries (``summary.json``) hold these same types under the same names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from storylens.core.plain import Plain
from storylens.lm import AttentionLM, NativeLM


@dataclass
class ModelInfo(Plain):
    name: str  # what the model was loaded as (a folder or a hub id)
    parameters: int
    blocks: int
    heads: int
    window: int
    display_name: str  # the name for people: a folder's own name, never its path
    lesson_comparison: bool  # the lesson's figures are shown beside this model's (storylens's own models)

    @property
    def n_heads(self) -> int:
        return self.blocks * self.heads

    @property
    def described(self) -> str:
        """The model for people: ``NAME (B blocks x H heads)``."""
        return f"{self.display_name} ({self.blocks} blocks x {self.heads} heads)"


@dataclass
class StoriesInfo(Plain):
    """The stories scored and how many of each kind (``storylens score``'s ``stories``; the report's
    ``quiz`` adds its own)."""

    source: str
    stories: int
    cut_to_window: int
    with_main_character: int
    name_scored: int


def display_name(lm: AttentionLM) -> str:
    """The model's name for people: a folder's own name (never the path to it), else the hub id."""
    if lm.source_folder is not None and Path(str(lm.name)) == Path(lm.source_folder):
        return Path(lm.source_folder).resolve().name or str(lm.name)
    name = str(lm.name)
    return Path(name).name if os.path.isabs(name) else name


def model_info(lm: AttentionLM) -> ModelInfo:
    return ModelInfo(
        name=str(lm.name),
        parameters=sum(p.numel() for p in lm.module.parameters()),
        blocks=lm.n_layer,
        heads=lm.n_head,
        window=lm.window,
        display_name=display_name(lm),
        # the lesson's figures are about Tiny Storyteller: compared only for storylens's own models
        lesson_comparison=isinstance(lm, NativeLM),
    )
