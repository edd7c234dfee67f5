"""The measuring API in one place, as it was before the package was regrouped: ``score_heads`` and the head
table, the detectors, the recording pass, names and main characters, quiz leakage, ablation, position
control, pronouns. The code lives in the wings (``storylens.engine``, ``storylens.looking``,
``storylens.effects``, ``storylens.table``); nothing in storylens imports this module, which only gathers
their public names for users. Its old submodules (``storylens.analysis.scores`` and the rest) import for one
release with a DeprecationWarning (:mod:`storylens.core.moved`)."""

from storylens.core.moved import moved_attribute
from storylens.data.leakage import LeakageReport, check_leakage, exact_duplicates, stories_mentioning
from storylens.data.names import MainCharacter, find_main_characters, main_character, name_vocabulary
from storylens.effects.ablation import ablate_heads, generation_divergence, head_output_means
from storylens.engine.accumulate import MeanAccumulator
from storylens.engine.encode import EncodedStory, encode_stories, iter_batches
from storylens.engine.record import record
from storylens.lm.perplexity import perplexity
from storylens.looking.detectors import (
    BUILTIN_DETECTORS,
    LESSON_DETECTORS,
    SCORE_COLUMNS,
    Column,
    Detector,
    pattern_detector,
    table_columns,
)
from storylens.looking.position import position_control_scores
from storylens.looking.pronouns import pronoun_attention
from storylens.table.accumulator import HeadScoreAccumulator
from storylens.table.name_ablation import name_ablation_table
from storylens.table.scores import HeadScore, HeadScores, score_heads

__all__ = [
    "BUILTIN_DETECTORS",
    "LESSON_DETECTORS",
    "Column",
    "Detector",
    "EncodedStory",
    "encode_stories",
    "iter_batches",
    "pattern_detector",
    "perplexity",
    "record",
    "SCORE_COLUMNS",
    "table_columns",
    "ablate_heads",
    "generation_divergence",
    "head_output_means",
    "name_ablation_table",
    "position_control_scores",
    "pronoun_attention",
    "HeadScore",
    "HeadScoreAccumulator",
    "HeadScores",
    "LeakageReport",
    "MainCharacter",
    "MeanAccumulator",
    "check_leakage",
    "exact_duplicates",
    "find_main_characters",
    "main_character",
    "name_vocabulary",
    "score_heads",
    "stories_mentioning",
]


def __getattr__(name: str):
    return moved_attribute(__name__, name)  # an old submodule (storylens.analysis.scores, ...), for one release
