"""The lesson's inputs, wherever the learner is: the quiz and the leakage check.

With the corpus at hand (``../shared`` or ``--stories``) the quiz is its last 200 stories and the
leakage check is recomputed against the training stories; without it, the quiz and the leakage
check that ship in the model folder (``quiz.txt.gz``, ``leakage.json``) are used, so the lesson
runs after a plain ``pip install``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .data import (GET_DATA, N_QUIZ, QUIZ_FILE, default_corpus_path, load_split, read_stories, shipped_leakage,
                   shipped_quiz)
from .errors import StorylensError


@dataclass(frozen=True)
class LessonData:
    quiz: list[str]
    quiz_source: str
    train: list[str] | None  # None: no corpus here (the report then shows the stored leakage check)
    stored_leakage: dict | None


def lesson_data(folder=None, stories=None, quiz_path=None) -> LessonData:
    """What the lesson measures: the quiz (a file, the corpus's, or the one the model ships) and,
    when the corpus is at hand, the training stories.

    With the corpus present and the model shipping a quiz, the two must be the same stories (the
    model's quiz is what it never trained on); a different corpus is refused with one line.
    """
    shipped = shipped_quiz(folder)
    corpus = None
    try:
        corpus = load_split(stories)
    except StorylensError:
        if stories is not None or (shipped is None and quiz_path is None):
            raise
    stored = shipped_leakage(folder)
    if quiz_path is not None:
        quiz = read_stories(quiz_path)
        if not quiz:
            raise StorylensError(f"{quiz_path}: no stories")
        return LessonData(quiz, Path(quiz_path).name, corpus.train if corpus else None, None)
    if corpus is not None:
        if shipped is not None and corpus.quiz != shipped:
            raise StorylensError(
                f"{stories or default_corpus_path()}: its last {N_QUIZ} stories are not the quiz this model "
                f"ships ({Path(folder) / QUIZ_FILE}); pass --quiz FILE to score other stories")
        return LessonData(corpus.quiz, f"the corpus's last {N_QUIZ} stories", corpus.train, stored)
    return LessonData(shipped, f"the {len(shipped)} quiz stories shipped with the model", None, stored)


def lesson_quiz(model=None) -> tuple[list[str], str]:
    """The lesson's quiz for ``model`` (default: the shipped one): ``(stories, where from)``."""
    data = lesson_data(getattr(model, "source_folder", None))
    return data.quiz, data.quiz_source


def leakage_for(data: LessonData, word: str = "Momo"):
    """The leakage check: recomputed when the training stories are here, else the stored one."""
    from .analysis.leakage import LeakageReport, check_leakage

    if data.train is not None:
        return check_leakage(data.quiz, data.train, word=word)
    if data.stored_leakage is None:
        raise StorylensError(f"no corpus here to check the quiz for leakage; {GET_DATA}")
    return LeakageReport.from_dict(data.stored_leakage)


def lesson_leakage(model=None, word: str = "Momo"):
    """The leakage check for ``model``'s quiz (see :func:`leakage_for`)."""
    return leakage_for(lesson_data(getattr(model, "source_folder", None)), word)
