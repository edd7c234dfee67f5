"""The lesson's numbers, in one place (Lesson 02: attention). Every module that needs one imports it
from here; the shipped model's own sizes live in its config, not here."""

from __future__ import annotations

EOT = "<|endoftext|>"  # the end-of-story marker; every story is fed as [marker] + story
N_QUIZ = 200  # the last 200 stories of the corpus are the quiz
PREV_SPAN = 4  # prev4: attention on the last four positions together
FIRST_STORIES = 100  # the lesson quotes two previous-token figures on the first 100 quiz stories
PREV_HEAD_LEVEL = 0.5  # "a previous-token head puts more than half its attention on the previous token"
MIN_MENTIONS = 2  # a main character is a name mentioned at least twice
TOP_HEADS = 6  # the lesson's tables show the top six heads
PRONOUNS = frozenset({"he", "she", "him", "her", "his", "they"})
LEAKAGE_RUN_WORDS = 8  # the leakage check's shared word runs
DIVERGENCE_PROMPT = "Once upon a time, there was a little girl named Lily. Lily"
