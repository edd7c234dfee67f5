"""The lesson's own inputs and figures (Lesson 02: attention), in one place.

Every module that shows or compares a lesson figure reads it from here: the report's page and
printout, the README's lesson table (:func:`storylens.lesson.report.lesson_table`), the numerical
checks' ``lesson`` column (:data:`storylens.lesson.checks.LESSON`) and the model card. Each figure
carries the lesson's own wording in its comment.
Definitions that a measure needs (the previous-token span, a main character's mentions, the
pronouns, the leakage check's run length, the end-of-story marker) live beside the measure; the
shipped model's own sizes live in its config."""

from __future__ import annotations

from dataclasses import dataclass

FIRST_STORIES = 100  # the lesson quotes two previous-token figures on the first 100 quiz stories
PREV_HEAD_LEVEL = 0.5  # "a previous-token head puts more than half its attention on the previous token"
MARKER_HEAD_LEVEL = 0.5  # "no head leans mostly on the end-of-story marker": more than half, as above
TOP_HEADS = 6  # the lesson's tables show the top six heads
DIVERGENCE_PROMPT = "Once upon a time, there was a little girl named Lily. Lily"


@dataclass(frozen=True)
class LessonFigures:
    """The figures Lesson 02 reports for its own Tiny Storyteller (compared only beside storylens's models)."""

    # "the 5.9-million-parameter Tiny Storyteller from Lesson 01"
    parameters_millions: float = 5.9
    # "quiz perplexity 9"
    quiz_perplexity: float = 9
    # "all 24 attention heads"; "four ways in each of his six blocks"
    heads: int = 24
    # "measure all of them over 200 unseen stories"
    quiz_stories: int = 200
    # "cut to the 256-token window"
    window: int = 256
    # "five of the 200 stories were cut to the 256-token window"
    cut_to_window: int = 5
    # "the 19,800 training stories"
    train_stories: int = 19_800
    # "none of the 200 is identical to a training story or mentions Momo"
    leakage_identical: int = 0
    leakage_word: str = "Momo"
    leakage_mentioning: int = 0
    # "a quiz story's 8-word runs found in the 19,800 training stories average 8.7% (maximum 30%)"
    run_words: int = 8
    run_share_mean: float = 0.087
    run_share_max: float = 0.30
    # "159 of the 200 stories have one; the other 41 are skipped"
    with_main_character: int = 159
    skipped: int = 41
    # "Against a baseline of what an even spread would give, 0.052"
    baseline: float = 0.052
    # "The winner is block 5, head 3 (L5H3), with 0.221 of its attention on the name, 4.3 times an even spread"
    top_head: str = "L5H3"
    top_name_mass: float = 0.221
    top_ratio: float = 4.3
    # "L4H4 and L6H2 are close behind"
    close_behind: tuple[str, ...] = ("L4H4", "L6H2")
    # "17 of the 24 heads put less on the name than an even spread would"
    below_baseline: int = 17
    # "previous-token heads, with more than half their attention on the word just before. The count is 0 of 24"
    prev_heads: int = 0
    # "The highest is L1H1 at 0.146"
    prev_highest_head: str = "L1H1"
    prev_highest: float = 0.146
    # "the best head reaches 0.369 of queries" (first 100 quiz stories)
    prev_argmax_first: float = 0.369
    # "L1H1 puts 0.140 on the word just before and 0.389 on the last four together (first 100 quiz stories)"
    prev_first_head: str = "L1H1"
    prev_first: float = 0.140
    prev4_first: float = 0.389
    # "No head leans mostly on the end-of-story marker ... the highest is 0.065"
    marker_heads: int = 0
    marker_highest: float = 0.065
    # "The two agree within 0.00002 in the raw output scores (logits)"
    fused_vs_explicit: float = 2e-5
    # "the shelf's answer matches recomputing everything within 0.0000003"
    kv_cache_vs_recompute: float = 3e-7
    # "Writing 200 tokens costs 200 key and value computations instead of 20,100"
    kv_tokens: int = 200
    kv_recompute: int = 20_100


LESSON_FIGURES = LessonFigures()
