"""The lesson's inputs, wherever the learner is: the quiz and the leakage check.

With the corpus at hand (``../shared`` or ``--stories``) the quiz is its last 200 stories and the
leakage check is recomputed against the training stories; without it, the quiz and the leakage
check that ship in the model folder (``quiz.txt.gz``, ``leakage.json``) are used, so the lesson
runs after a plain install. A model that ships no quiz of its own (a transformers model, say) is
measured on the lesson's quiz, the one shipped with storylens; its leakage check is then not run
(the shipped check is about Tiny Storyteller's training stories).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from storylens.core.errors import StorylensError
from storylens.data.leakage import LeakageReport, check_leakage
from storylens.data.sources import file_kind, open_source
from storylens.data.stories import (
    GET_DATA,
    N_QUIZ,
    QUIZ_FILE,
    default_corpus_path,
    load_split,
    read_stories,
    shipped_leakage,
    shipped_quiz,
)
from storylens.model.hub import SHIPPED_MODEL

if TYPE_CHECKING:
    from storylens.lm import ModelLike


@dataclass(frozen=True)
class LessonData:
    quiz: list[str]
    quiz_source: str
    train: list[str] | None  # None: no corpus here (the report then shows the stored leakage check)
    stored_leakage: dict | None
    shipped_with_storylens: bool = False  # the lesson's quiz, used because the model ships none of its own


def lesson_data(
    folder=None, stories=None, quiz_path=None, *, quiz_option: str | None = None, text_field: str = "text"
) -> LessonData:
    """What the lesson measures: the quiz (a file, the corpus's, or the one the model ships) and,
    when the corpus is at hand, the training stories.

    With the corpus present and the model shipping a quiz, the two must be the same stories (the
    model's quiz is what it never trained on); a different corpus is refused with one line. With
    no corpus here and no quiz in ``folder`` (any model that ships none), the lesson's quiz shipped
    with storylens is used (:func:`lesson_quiz_data`). A ``stories`` named but unreadable is an
    error whose line offers the shipped quiz and, where the command has one (``quiz_option``, e.g.
    ``"--quiz"``), the option that measures other stories. ``quiz_path`` may be a text file, JSON
    lines, Parquet or a saved dataset (the story in ``text_field``), read as ``storylens score`` reads them.
    """
    shipped = shipped_quiz(folder)
    corpus = None
    try:
        corpus = load_split(stories)
    except StorylensError as e:
        if stories is not None:  # a corpus asked for by name must be there
            own = f"pass {quiz_option} FILE to measure stories of your own, or " if quiz_option else ""
            raise StorylensError(f"{e}; or {own}leave out --stories to use the quiz shipped with storylens") from None
    stored = shipped_leakage(folder)
    if quiz_path is not None:
        # JSON lines, Parquet or a saved dataset through their own readers; text as the corpus is read
        structured = Path(quiz_path).is_dir() or file_kind(quiz_path) != "text"
        quiz = list(open_source(quiz_path, text_field=text_field)) if structured else read_stories(quiz_path)
        if not quiz:
            raise StorylensError(f"{quiz_path}: no stories")
        return LessonData(quiz, Path(quiz_path).name, corpus.train if corpus else None, None)
    if corpus is not None:
        if shipped is not None and corpus.quiz != shipped:
            raise StorylensError(
                f"{stories or default_corpus_path()}: its last {N_QUIZ} stories are not the quiz this model "
                f"ships ({Path(folder) / QUIZ_FILE}); pass --quiz FILE to score other stories"
            )
        return LessonData(corpus.quiz, f"the corpus's last {N_QUIZ} stories", corpus.train, stored)
    if shipped is not None:
        return LessonData(shipped, f"the {len(shipped)} quiz stories shipped with the model", None, stored)
    return lesson_quiz_data()


def lesson_quiz_data() -> LessonData:
    """The lesson's own quiz, shipped with storylens (Tiny Storyteller's folder), for a model that
    ships none: no training stories and no stored leakage check (that check is Tiny Storyteller's)."""

    quiz = shipped_quiz(SHIPPED_MODEL)
    if quiz is None:  # a broken install: the package data is missing
        raise StorylensError(
            f"no corpus here and no quiz shipped with storylens ({QUIZ_FILE} is missing from "
            f"its Tiny Storyteller folder); pass --quiz FILE, or {GET_DATA}"
        )
    return LessonData(
        quiz,
        f"the lesson's {len(quiz)} quiz stories, shipped with storylens: no corpus here, "
        "and the model ships no quiz of its own",
        None,
        None,
        shipped_with_storylens=True,
    )


def lesson_quiz(model: ModelLike | None = None) -> tuple[list[str], str]:
    """The lesson's quiz for ``model`` (default: the shipped one): ``(stories, where from)``."""
    data = lesson_data(getattr(model, "source_folder", None))
    return data.quiz, data.quiz_source


def leakage_for(data: LessonData, word: str = "Momo"):
    """The leakage check: recomputed when the training stories are here, else the stored one."""

    if data.train is not None:
        return check_leakage(data.quiz, data.train, word=word)
    if data.stored_leakage is None:
        raise StorylensError(f"no corpus here to check the quiz for leakage; {GET_DATA}")
    return LeakageReport.from_dict(data.stored_leakage)


def lesson_leakage(model: ModelLike | None = None, word: str = "Momo"):
    """The leakage check for ``model``'s quiz (see :func:`leakage_for`)."""
    return leakage_for(lesson_data(getattr(model, "source_folder", None)), word)
