"""Leakage between quiz and training stories, on hand-built corpora."""

import pytest

from storylens.data.leakage import (
    check_leakage,
    exact_duplicates,
    run_hashes,
    run_share,
    stories_mentioning,
    word_runs,
)

TRAIN = [
    "a b c d e f g h i j",
    "Momo is here today.",
    "the cat sat",
]
QUIZ = [
    "a b c d e f g h x y",  # 3 runs of 8: only "a .. h" is in training -> 1/3
    "the cat sat",  # duplicate, and too short for a run
    "MOMO's day was fun and long and good",  # 8 words, one run, not in training -> 0
    "Momotaro is not Momo the monkey at all no",  # mentions Momo (the second word)
    "a b c d e f g h i j",  # duplicate; both of its runs are in training -> 1
]


def test_word_runs():
    assert list(word_runs("a b c", n=2)) == [("a", "b"), ("b", "c")]
    assert list(word_runs("a b", n=3)) == []
    assert list(word_runs("Time, time", n=2, lowercase=True)) == [("time,", "time")]


def test_exact_duplicates():
    assert exact_duplicates(QUIZ, TRAIN) == [1, 4]
    assert exact_duplicates(["the cat sat "], TRAIN) == []  # exact text, character for character


def test_mentioning_whole_word_any_case():
    assert stories_mentioning(QUIZ) == [2, 3]
    assert stories_mentioning(["Momotaro ran.", "kimomo"]) == []
    assert stories_mentioning(QUIZ, word="cat") == [1]


def test_run_shares_by_hand():
    r = check_leakage(QUIZ, TRAIN)
    assert r.shares == pytest.approx([1 / 3, None, 0.0, 0.0, 1.0])
    assert r.n_too_short == 1
    assert r.run_share_mean == pytest.approx((1 / 3 + 0 + 0 + 1) / 4)
    assert r.run_share_max == 1.0 and r.run_share_argmax == 4
    assert (r.n_duplicates, r.n_mentioning, r.n_quiz, r.n_train) == (2, 2, 5, 3)
    assert r.summary().n_duplicates == 2


def test_runs_do_not_cross_story_boundaries():
    train = ["a b c d", "e f g h"]  # joined they would hold "a .. h"
    assert run_share("a b c d e f g h", run_hashes(train)) == 0.0


def test_repeated_runs_count_once_per_position():
    train = ["x x x x x x x x"]
    assert run_share("x x x x x x x x x y", run_hashes(train)) == pytest.approx(2 / 3)


def test_case_is_kept_unless_asked():
    assert check_leakage(["A b c d e f g h"], ["a b c d e f g h"]).run_share_mean == 0.0
    assert check_leakage(["A b c d e f g h"], ["a b c d e f g h"], lowercase=True).run_share_mean == 1.0


def test_shorter_runs_and_no_scored_story():
    r = check_leakage(["a b c"], ["a b x"], n=2)
    assert r.shares == (0.5,)
    r = check_leakage(["a b"], ["a b"], n=8)
    assert r.run_share_mean is None and r.run_share_max is None and r.run_share_argmax is None
    with pytest.raises(ValueError):
        check_leakage(["a"], ["a"], n=0)


def test_real_split_sanity(corpus_split):
    r = check_leakage(corpus_split.quiz, corpus_split.train)
    assert r.n_quiz == 200 and r.n_train == len(corpus_split.train)
    assert 0 <= r.run_share_mean <= r.run_share_max <= 1
