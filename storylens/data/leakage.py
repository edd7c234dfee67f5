"""Did the quiz leak into training? Duplicates, a give-away word, shared 8-word runs.

Choices the lesson leaves open:

* **Exact duplicate**: a quiz story whose text equals a training story's text
  character for character (:func:`storylens.data.read_stories` already strips both ends).
* **Mentions a word**: the word appears as a whole word (not inside a longer word;
  ``Momo's`` counts), ignoring case.
* **Words** for runs are the story split on whitespace (``str.split``), case and
  punctuation kept: ``time,`` and ``time`` differ. ``lowercase=True`` folds case.
* An **8-word run** of a story is any 8 consecutive words of that story alone (runs
  never cross from one story into the next). A quiz story's **share** is the fraction
  of its runs (counted with repeats, one per start position) that occur in at least one
  training story. Stories shorter than 8 words have no share and are left out of the
  mean and the maximum (counted in :attr:`LeakageReport.n_too_short`).

Training runs are kept as a set of 64-bit hashes of the word tuples, not the tuples:
memory stays small on big corpora. A false match needs a 64-bit collision: with about
10^6 training runs and 10^4 quiz runs the chance of even one is below 10^-8.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

from storylens.core.errors import StorylensError
from storylens.core.plain import Plain
from storylens.core.text import checked_stories, not_stories

RUN_WORDS = 8  # the leakage check's shared word runs: 8 words


def words(text: str, lowercase: bool = False) -> list[str]:
    return (text.lower() if lowercase else text).split()


def word_runs(text: str, n: int = RUN_WORDS, lowercase: bool = False) -> Iterator[tuple[str, ...]]:
    """Every ``n`` consecutive words of ``text``, in order (none if it has fewer)."""
    w = words(text, lowercase)
    return zip(*(w[i:] for i in range(n)))


def run_hashes(stories: Iterable[str], n: int = RUN_WORDS, lowercase: bool = False) -> set[int]:
    """Hashes of every ``n``-word run of every story."""
    out: set[int] = set()
    for text in stories:
        out.update(map(hash, word_runs(text, n, lowercase)))
    return out


def run_share(text: str, train_runs: set[int], n: int = RUN_WORDS, lowercase: bool = False) -> float | None:
    """Share of the story's ``n``-word runs found in ``train_runs``; None below ``n`` words."""
    hashes = [hash(r) for r in word_runs(text, n, lowercase)]
    if not hashes:
        return None
    return sum(h in train_runs for h in hashes) / len(hashes)


def exact_duplicates(quiz: Sequence[str], train: Iterable[str]) -> list[int]:
    """Indices of quiz stories identical to some training story."""
    seen = set(train)
    return [i for i, s in enumerate(quiz) if s in seen]


def stories_mentioning(stories: Sequence[str], word: str = "Momo") -> list[int]:
    """Indices of stories that contain ``word`` as a whole word, ignoring case."""
    pattern = re.compile(rf"(?<![^\W_]){re.escape(word)}(?![^\W_])", re.IGNORECASE)
    return [i for i, s in enumerate(stories) if pattern.search(s)]


@dataclass(frozen=True)
class LeakageReport:
    n_quiz: int
    n_train: int
    duplicates: tuple[int, ...]  # quiz indices identical to a training story
    word: str
    mentioning: tuple[int, ...]  # quiz indices mentioning `word`
    run_words: int  # n of the n-word runs
    shares: tuple[float | None, ...]  # per quiz story; None below run_words words
    run_share_mean: float | None  # over quiz stories with a share
    run_share_max: float | None
    run_share_argmax: int | None  # quiz index of the maximum (the first, on a tie)

    @property
    def n_duplicates(self) -> int:
        return len(self.duplicates)

    @property
    def n_mentioning(self) -> int:
        return len(self.mentioning)

    @property
    def n_too_short(self) -> int:
        return sum(s is None for s in self.shares)

    def to_dict(self) -> dict:
        """Every field (per-story lists included), JSON-ready; :meth:`from_dict` reads it back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LeakageReport:
        fields = {k: d[k] for k in cls.__dataclass_fields__}
        for k in ("duplicates", "mentioning", "shares"):
            fields[k] = tuple(fields[k])
        return cls(**fields)

    def summary(self) -> LeakageStats:
        """The headline numbers (no per-story lists): what a report's ``summary.json`` holds."""
        return LeakageStats(
            n_quiz=self.n_quiz,
            n_train=self.n_train,
            n_duplicates=self.n_duplicates,
            word=self.word,
            n_mentioning=self.n_mentioning,
            run_words=self.run_words,
            run_share_mean=self.run_share_mean,
            run_share_max=self.run_share_max,
            run_share_argmax=self.run_share_argmax,
            n_too_short=self.n_too_short,
        )


@dataclass(frozen=True)
class LeakageStats(Plain):
    """:meth:`LeakageReport.summary`: the leakage check's headline numbers."""

    n_quiz: int
    n_train: int
    n_duplicates: int
    word: str
    n_mentioning: int
    run_words: int
    run_share_mean: float | None
    run_share_max: float | None
    run_share_argmax: int | None
    n_too_short: int


def check_leakage(
    quiz: Sequence[str],
    train: Sequence[str],
    *,
    word: str = "Momo",
    n: int = RUN_WORDS,
    lowercase: bool = False,
) -> LeakageReport:
    """Duplicates, stories mentioning ``word``, and shared ``n``-word runs (see module doc)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    quiz = checked_stories(quiz, "quiz")
    if problem := not_stories(train, "train"):
        raise StorylensError(problem)
    train_runs = run_hashes(train, n, lowercase)
    shares = tuple(run_share(s, train_runs, n, lowercase) for s in quiz)
    scored = [(s, i) for i, s in enumerate(shares) if s is not None]
    top = max(scored, key=lambda si: (si[0], -si[1])) if scored else None
    return LeakageReport(
        n_quiz=len(quiz),
        n_train=len(train),
        duplicates=tuple(exact_duplicates(quiz, train)),
        word=word,
        mentioning=tuple(stories_mentioning(quiz, word)),
        run_words=n,
        shares=shares,
        run_share_mean=sum(s for s, _ in scored) / len(scored) if scored else None,
        run_share_max=top[0] if top else None,
        run_share_argmax=top[1] if top else None,
    )
