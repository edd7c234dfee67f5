"""The TinyStories corpus, the lesson's quiz split, and how one story is encoded.

The corpus is one UTF-8 text (optionally gzip-compressed) where every story is
followed by a line holding only ``<|endoftext|>``. The split is by file order:
the **last 200 stories are the quiz**, the rest are for training.
"""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import StorylensError

EOT = "<|endoftext|>"
N_QUIZ = 200
ENV_STORIES = "STORYLENS_STORIES"
_REL_CORPUS = Path("shared") / "data" / "tinystories" / "stories.txt.gz"


def default_corpus_path() -> Path:
    """``$STORYLENS_STORIES``, else ``../shared/data/tinystories/stories.txt.gz``.

    ``..`` is tried relative to the working directory and to the checkout holding this package.
    """
    env = os.environ.get(ENV_STORIES)
    if env:
        return Path(env)
    candidates = [
        Path.cwd().parent / _REL_CORPUS,
        Path.cwd() / ".." / _REL_CORPUS,
        Path(__file__).resolve().parents[2] / _REL_CORPUS,
    ]
    for c in candidates:
        if c.is_file():
            return c
    return candidates[0]


def read_stories(path: str | os.PathLike | None = None) -> list[str]:
    """Read every story, stripped at both ends, in file order.

    Raises :class:`StorylensError` naming the file for a missing, corrupt or non-UTF-8 file.
    """
    path = Path(path) if path is not None else default_corpus_path()
    if not path.is_file():
        raise StorylensError(
            f"{path}: stories file not found (pass --stories FILE or set ${ENV_STORIES})"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise StorylensError(f"{path}: corrupt gzip file ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StorylensError(
            f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})"
        ) from None
    return split_stories(text)


def split_stories(text: str) -> list[str]:
    """Split on lines holding only the end-of-story marker; drop empty pieces."""
    stories, current = [], []
    for line in text.splitlines():
        if line.strip() == EOT:
            stories.append("\n".join(current).strip())
            current = []
        else:
            current.append(line)
    stories.append("\n".join(current).strip())
    return [s for s in stories if s]


@dataclass(frozen=True)
class Split:
    train: list[str]
    quiz: list[str]


def quiz_split(stories: list[str], n_quiz: int = N_QUIZ, source: str = "stories") -> Split:
    """The lesson's split: the last ``n_quiz`` stories are the quiz, the rest train."""
    if len(stories) < n_quiz + 1:
        raise StorylensError(
            f"{source}: {len(stories)} stories; the quiz split needs at least {n_quiz + 1} "
            f"({n_quiz} quiz stories plus at least one to train on)"
        )
    return Split(train=stories[:-n_quiz], quiz=stories[-n_quiz:])


def load_split(path: str | os.PathLike | None = None, n_quiz: int = N_QUIZ) -> Split:
    path = Path(path) if path is not None else default_corpus_path()
    return quiz_split(read_stories(path), n_quiz=n_quiz, source=str(path))
