"""The lesson's inputs, wherever the learner is: the quiz and the leakage check.

With the corpus at hand (``../shared`` or ``--stories``) the quiz is its last 200 stories and the
leakage check is recomputed against the training stories; without it, the quiz and the leakage
check that ship in the model folder (``quiz.txt.gz``, ``leakage.json``) are used, so the lesson
runs after a plain install. A model that ships no quiz of its own (a transformers model, say) is
measured on the lesson's quiz, the one shipped with storylens; its leakage check is then not run
(the shipped check is about Tiny Storyteller's training stories).

:class:`ProgressLines` is the progress a long loop shows when no tqdm bar can (stderr is not a
terminal: a log, a notebook's captured output, CI): a line every few seconds with an estimate of
the time left.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .data import (GET_DATA, N_QUIZ, QUIZ_FILE, default_corpus_path, load_split, read_stories, shipped_leakage,
                   shipped_quiz)
from .errors import StorylensError
from .sources import file_kind, open_source


@dataclass(frozen=True)
class LessonData:
    quiz: list[str]
    quiz_source: str
    train: list[str] | None  # None: no corpus here (the report then shows the stored leakage check)
    stored_leakage: dict | None
    shipped_with_storylens: bool = False  # the lesson's quiz, used because the model ships none of its own


def lesson_data(folder=None, stories=None, quiz_path=None, *, quiz_option: str | None = None,
                text_field: str = "text") -> LessonData:
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
                f"ships ({Path(folder) / QUIZ_FILE}); pass --quiz FILE to score other stories")
        return LessonData(corpus.quiz, f"the corpus's last {N_QUIZ} stories", corpus.train, stored)
    if shipped is not None:
        return LessonData(shipped, f"the {len(shipped)} quiz stories shipped with the model", None, stored)
    return lesson_quiz_data()


def lesson_quiz_data() -> LessonData:
    """The lesson's own quiz, shipped with storylens (Tiny Storyteller's folder), for a model that
    ships none: no training stories and no stored leakage check (that check is Tiny Storyteller's)."""
    from .hub import SHIPPED_MODEL

    quiz = shipped_quiz(SHIPPED_MODEL)
    if quiz is None:  # a broken install: the package data is missing
        raise StorylensError(f"no corpus here and no quiz shipped with storylens ({QUIZ_FILE} is missing from "
                             f"its Tiny Storyteller folder); pass --quiz FILE, or {GET_DATA}")
    return LessonData(quiz, f"the lesson's {len(quiz)} quiz stories, shipped with storylens: no corpus here, "
                            "and the model ships no quiz of its own", None, None, shipped_with_storylens=True)


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


# ---------------------------------------------------------------- progress off a terminal

PROGRESS_EVERY_ENV = "STORYLENS_PROGRESS_SECONDS"  # seconds between progress lines (default 10)
PROGRESS_EVERY = 10.0
_COMMAND: contextvars.ContextVar[str | None] = contextvars.ContextVar("storylens_command", default=None)


@contextlib.contextmanager
def progress_command(name: str):
    """Progress lines inside the ``with`` block name the command: ``storylens: report: ...``."""
    token = _COMMAND.set(name)
    try:
        yield
    finally:
        _COMMAND.reset(token)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


class ProgressLines:
    """``storylens: report: scoring 120/200 stories, about 30 s left`` on stderr every ``every``
    seconds (default ``$STORYLENS_PROGRESS_SECONDS``, else 10), only where no tqdm bar shows:
    ``enabled`` (the caller's progress switch) and the stream is not a terminal. Call
    :meth:`update` with the stories just done; a loop shorter than ``every`` prints nothing. It is
    also a measure for :func:`storylens.analysis.record.record` (``begin``/``block``/``end``), so
    a recording pass counts its batches without a loop of its own."""

    def __init__(self, what: str, total: int | None, *, unit: str = "stories", enabled: bool = True,
                 every: float | None = None, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(enabled) and not (isatty is not None and isatty())
        if every is None:
            raw = os.environ.get(PROGRESS_EVERY_ENV)
            try:
                every = float(raw) if raw else PROGRESS_EVERY
            except ValueError:
                raise StorylensError(f"${PROGRESS_EVERY_ENV}: seconds between progress lines, a number "
                                     f"(got {raw!r})") from None
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.done = 0
        self.start = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        command = _COMMAND.get()
        line = f"storylens: {command + ': ' if command else ''}{self.what} {self.done}"
        if self.total:
            line += f"/{self.total} {self.unit}"
            if 0 < self.done < self.total:
                left = (now - self.start) / self.done * (self.total - self.done)
                line += f", about {_duration(left)} left"
        else:
            line += f" {self.unit}"
        print(line, file=self.stream, flush=True)

    # a measure (storylens.analysis.record): counts each batch's stories, reads no attention
    def begin(self, batch) -> None:
        self._batch = len(batch.ids)

    def block(self, layer: int, pattern) -> None:
        pass

    def end(self) -> None:
        self.update(self._batch)
