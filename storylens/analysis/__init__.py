"""Measure the heads: stories encoded once, one recording pass feeding every measure, head
detectors as pure functions, names and main characters, quiz leakage, and past the lesson:
ablation, position control, pronouns. Computing only: no parsers, no HTML, no plotting, no loading."""

from storylens.analysis.ablation import ablate_heads, generation_divergence, head_output_means, name_ablation_table
from storylens.analysis.accumulate import MeanAccumulator
from storylens.analysis.detectors import (
    BUILTIN_DETECTORS,
    LESSON_DETECTORS,
    SCORE_COLUMNS,
    Column,
    Detector,
    pattern_detector,
    table_columns,
)
from storylens.analysis.encode import EncodedStory, encode_stories, iter_batches
from storylens.analysis.names import MainCharacter, find_main_characters, main_character, name_vocabulary
from storylens.analysis.perplexity import perplexity
from storylens.analysis.position import position_control_scores
from storylens.analysis.pronouns import pronoun_attention
from storylens.analysis.record import record
from storylens.analysis.scores import HeadScore, HeadScoreAccumulator, HeadScores, score_heads
from storylens.data.leakage import LeakageReport, check_leakage, exact_duplicates, stories_mentioning

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
