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


MAX_CORPUS_MB_ENV = "STORYLENS_MAX_CORPUS_MB"
DEFAULT_MAX_CORPUS_MB = 1024  # a corpus read whole is held in memory: refuse more than this, unless raised


def max_corpus_bytes() -> int:
    raw = os.environ.get(MAX_CORPUS_MB_ENV)
    try:
        mb = float(raw) if raw else DEFAULT_MAX_CORPUS_MB
    except ValueError:
        raise StorylensError(f"${MAX_CORPUS_MB_ENV}={raw!r}: not a number of megabytes") from None
    return int(mb * 2**20)


def describe_non_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a stories file, or None if it is a regular file."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "stories file not found"
    except OSError as e:
        return f"cannot read ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a folder, not a stories file"
    if stat.S_ISFIFO(mode):
        return "is a named pipe (FIFO), not a stories file"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a stories file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a stories file"
    return "is not a regular file"


def read_corpus_bytes(path: Path, limit: int | None = None) -> bytes:
    """The file's bytes, gunzipped if it is gzip, streamed so that at most ``limit`` bytes are
    ever held (a gzip bomb is refused after ``limit`` bytes, not after it fills the memory)."""
    limit = max_corpus_bytes() if limit is None else limit
    chunks, size = [], 0
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            stream = gzip.GzipFile(fileobj=f) if gz else f
            while True:
                chunk = stream.read(1 << 20)
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise StorylensError(
                        f"{path}: more than {limit / 2**20:,.0f} MB of text{' once unzipped' if gz else ''}; "
                        f"refusing to hold it in memory (raise ${MAX_CORPUS_MB_ENV} if it is really a corpus)")
                chunks.append(chunk)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise StorylensError(f"{path}: corrupt gzip file ({e})") from None
    except OSError as e:
        raise StorylensError(f"{path}: cannot read ({e.strerror or e})") from None
    return b"".join(chunks)


def read_stories(path: str | os.PathLike | None = None) -> list[str]:
    """Read every story, stripped at both ends, in file order.

    Raises :class:`StorylensError` naming the file for a missing, corrupt, oversized or
    non-UTF-8 file, and for a path that is a folder, a pipe or a device.
    """
    path = Path(path) if path is not None else default_corpus_path()
    why = describe_non_file(path)
    if why == "stories file not found":
        raise StorylensError(f"{path}: {why} (pass --stories FILE or set ${ENV_STORIES})")
    if why:
        raise StorylensError(f"{path}: {why}")
    raw = read_corpus_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StorylensError(
            f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})"
        ) from None
    return split_stories(text)


_EDGE = " \t\r\n"  # what is trimmed around a story or a marker line: ASCII whitespace only


def split_stories(text: str) -> list[str]:
    """Split on lines holding only the end-of-story marker; drop empty pieces.

    Lines end at ``\n`` only (``\r\n`` too): unlike ``str.splitlines``, U+2028, U+0085 or a form
    feed inside a story stay part of it, so a story is kept exactly as stored.
    """
    stories, current = [], []
    for line in text.split("\n"):
        if line.strip(_EDGE) == EOT:
            stories.append("\n".join(current).strip(_EDGE))
            current = []
        else:
            current.append(line)
    stories.append("\n".join(current).strip(_EDGE))
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
