"""The lesson's own inputs and figures (Lesson 02: attention), in one place.

Every module that shows or compares a lesson figure reads it from here. Definitions that a
measure needs (the previous-token span, a main character's mentions, the pronouns, the
leakage check's run length, the end-of-story marker) live beside the measure; the shipped
model's own sizes live in its config."""

from __future__ import annotations

FIRST_STORIES = 100  # the lesson quotes two previous-token figures on the first 100 quiz stories
PREV_HEAD_LEVEL = 0.5  # "a previous-token head puts more than half its attention on the previous token"
TOP_HEADS = 6  # the lesson's tables show the top six heads
DIVERGENCE_PROMPT = "Once upon a time, there was a little girl named Lily. Lily"
