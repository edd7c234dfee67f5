"""Measure the heads: names and main characters, streaming head scores, quiz leakage,
and past the lesson: ablation, position control, pronouns."""

from .ablation import ablate_heads, generation_divergence, head_output_means, name_ablation_table
from .accumulate import MeanAccumulator
from .leakage import LeakageReport, check_leakage, exact_duplicates, stories_mentioning
from .names import MainCharacter, find_main_characters, main_character, name_vocabulary
from .position import position_control_scores
from .pronouns import pronoun_attention
from .scores import SCORE_COLUMNS, HeadScore, HeadScoreAccumulator, HeadScores, score_heads

__all__ = [
    "SCORE_COLUMNS",
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
