"""Measure the heads: names and main characters, streaming head scores, quiz leakage."""

from .accumulate import MeanAccumulator
from .leakage import LeakageReport, check_leakage, exact_duplicates, stories_mentioning
from .names import MainCharacter, find_main_characters, main_character, name_vocabulary
from .scores import SCORE_COLUMNS, HeadScore, HeadScoreAccumulator, HeadScores, score_heads

__all__ = [
    "SCORE_COLUMNS",
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
