"""The TinyStories corpus, the lesson's quiz split, and how one story is encoded.

The corpus is one UTF-8 text (optionally gzip-compressed) where every story is
followed by a line holding only ``<|endoftext|>``. The split is by file order:
the **last 200 stories are the quiz**, the rest are for training.
"""

from __future__ import annotations

import gzip
import os
import stat
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

# huggingface_hub loads its parts on first use: the cache lookup and the download below load its HTTP
# client when first called, not when a reader of stories imports this module
import huggingface_hub
import huggingface_hub.utils

from storylens.core.errors import StorylensError, UsageError
from storylens.core.files import checked_file, read_json

EOT = "<|endoftext|>"  # the end-of-story marker; every story is fed as [marker] + story
N_QUIZ = 200  # the last 200 stories of the corpus are the quiz

QUIZ_FILE = "quiz.txt.gz"  # the 200 quiz stories, shipped in the model folder
LEAKAGE_FILE = "leakage.json"  # the leakage check computed when the model was trained
# TinyStories on the Hugging Face Hub (fetched only by `storylens data download`)
HUB_DATASET = "roneneldan/TinyStories"
HUB_FILES = {"train": "TinyStories-train.txt", "valid": "TinyStories-valid.txt"}
HUB_NAMES = {"tinystories": "train", "tinystories-train": "train", "tinystories-valid": "valid"}
GET_DATA = "get TinyStories with: storylens data download (then --stories tinystories)"
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
        Path(__file__).resolve().parents[3] / _REL_CORPUS,
    ]
    for c in candidates:
        if c.is_file():
            return c
    return candidates[0]


MAX_CORPUS_MB_ENV = "STORYLENS_MAX_CORPUS_MB"
DEFAULT_MAX_CORPUS_MB = 1024  # text read from one corpus (after unzipping): refuse more than this, unless raised
MAX_STORY_MB_ENV = "STORYLENS_MAX_STORY_MB"
DEFAULT_MAX_STORY_MB = 4  # one line, one story: a story of 4 MB is about a million tokens


def _megabytes(env: str, default: float) -> int:
    raw = os.environ.get(env)
    try:
        mb = float(raw) if raw else default
    except ValueError:
        raise UsageError(f"${env}={raw!r}: not a number of megabytes") from None
    if not mb > 0 or mb == float("inf"):
        raise UsageError(f"${env}={raw!r}: must be a positive number of megabytes")
    return int(mb * 2**20)


def max_corpus_bytes() -> int:
    return _megabytes(MAX_CORPUS_MB_ENV, DEFAULT_MAX_CORPUS_MB)


def max_story_bytes() -> int:
    return _megabytes(MAX_STORY_MB_ENV, DEFAULT_MAX_STORY_MB)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f}" if n >= 2**20 else f"{n / 2**20:,.2f}"


def too_much_text(where, limit: int, unzipped: bool = False) -> StorylensError:
    """The one line for a corpus past ``$STORYLENS_MAX_CORPUS_MB`` (every reader raises it)."""
    return StorylensError(
        f"{where}: more than {_mb(limit)} MB of text{' once unzipped' if unzipped else ''}; "
        f"refusing to read more (raise ${MAX_CORPUS_MB_ENV} if it is really a corpus)"
    )


def text_lines(path: str | os.PathLike) -> Iterator[str]:
    """The lines of a UTF-8 text file, plain or gzip, streamed, without their line endings.

    Universal newlines (``\n``, ``\r\n`` and a lone ``\r`` all end a line; U+2028, U+0085 or a
    form feed do not), a UTF-8 byte-order mark at the start dropped. Every byte is counted: more
    than ``$STORYLENS_MAX_CORPUS_MB`` of text, or one line longer than ``$STORYLENS_MAX_STORY_MB``,
    is refused while streaming, so a gzip bomb or a file with no line breaks never fills the
    memory. Every problem is one :class:`StorylensError` naming the file (and the line)."""
    corpus_limit, line_limit = max_corpus_bytes(), max_story_bytes()
    number, total = 0, 0
    try:
        checked_file(Path(path), None)  # a FIFO would block the read (and cannot be read twice)
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            stream = gzip.GzipFile(fileobj=f) if gz else f
            while True:
                raw = stream.readline(line_limit + 2)  # a line, its \r\n, and one byte more to know
                if not raw:
                    return
                number += 1
                total += len(raw)
                if total > corpus_limit:
                    raise too_much_text(path, corpus_limit, unzipped=gz)
                body = raw.rstrip(b"\n").rstrip(b"\r") if raw.endswith(b"\n") else raw
                if len(body) > line_limit:
                    raise StorylensError(
                        f"{path}: line {number:,} is longer than {_mb(line_limit)} MB; a line or a story "
                        f"is at most that (raise ${MAX_STORY_MB_ENV} for longer ones)"
                    )
                try:
                    line = body.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise StorylensError(
                        f"{path}: not UTF-8 text (line {number:,}, byte {e.start + 1}: {body[e.start : e.start + 1]!r})"
                    ) from None
                if number == 1:
                    line = line.removeprefix("\ufeff")
                if "\r" in line:  # a lone carriage return ends a line too (old Mac files)
                    yield from line.split("\r")
                else:
                    yield line
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise StorylensError(f"{path}: corrupt gzip file ({e})") from None
    except OSError as e:
        raise StorylensError(f"{path}: cannot read ({e.strerror or e})") from None


def describe_non_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a stories file, or None if it is a regular file."""
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


def resolve_corpus(path: str | os.PathLike) -> Path:
    """A file path as given, or a TinyStories name (``tinystories``, ``tinystories-valid``) looked
    up in the local Hugging Face cache, where ``storylens data download`` puts it (never fetched here)."""
    name = str(path)
    if name not in HUB_NAMES:
        return Path(path)
    split = HUB_NAMES[name]
    found = huggingface_hub.try_to_load_from_cache(HUB_DATASET, HUB_FILES[split], repo_type="dataset")
    if not isinstance(found, str):
        raise StorylensError(
            f"{name}: the TinyStories {split} split is not downloaded here; "
            f"get it with: storylens data download --split {split}"
        )
    return Path(found)


def download_tinystories(split: str = "train") -> Path:
    """Fetch one TinyStories text file from the Hugging Face Hub into the user's cache (with a
    progress bar); only ever called by ``storylens data download``."""
    hub_logging = huggingface_hub.utils.logging
    if split not in HUB_FILES:
        raise UsageError(f"--split: one of {', '.join(HUB_FILES)} (got {split!r})")
    level = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # its retry warnings would bury the one line that matters
    try:
        return Path(huggingface_hub.hf_hub_download(HUB_DATASET, HUB_FILES[split], repo_type="dataset"))
    except Exception as e:  # the hub client raises many types for "no network"
        raise StorylensError(
            f"{HUB_DATASET}: could not download {HUB_FILES[split]} "
            f"({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        ) from None
    finally:
        hub_logging.set_verbosity(level)


def read_stories(path: str | os.PathLike | None = None, limit: int | None = None) -> list[str]:
    """Read every story, stripped at both ends, in file order.

    Raises :class:`StorylensError` naming the file for a missing, corrupt, oversized or
    non-UTF-8 file, and for a path that is a folder, a pipe or a device.
    """
    path = Path(path) if path is not None else default_corpus_path()
    path = resolve_corpus(path)
    why = describe_non_file(path)
    if why == "stories file not found":
        raise StorylensError(f"{path}: {why}; pass --stories FILE, set ${ENV_STORIES}, or {GET_DATA}")
    if why:
        raise StorylensError(f"{path}: {why}")
    if limit is not None and not 1 <= limit <= sys.maxsize:
        raise UsageError(f"--first: must be between 1 and {sys.maxsize:,} (got {limit:,})")
    return list(islice(iter_stories(text_lines(path), source=str(path)), limit))


def format_stories(stories) -> str:
    """The corpus format: every story followed by a line holding only the marker."""
    return "".join(f"{s}\n{EOT}\n" for s in stories)


def quiz_file_bytes(stories) -> bytes:
    """The shipped quiz file: gzip with no timestamp, so the same stories give the same bytes."""
    return gzip.compress(format_stories(stories).encode("utf-8"), compresslevel=9, mtime=0)


_EDGE = " \t\r\n"  # what is trimmed around a story or a marker line: ASCII whitespace only


def iter_stories(lines, source: str = "stories"):
    """Stories from lines (without their line endings): a line holding only the end-of-story
    marker (and spaces) ends a story; each story is trimmed of ASCII whitespace at both ends; empty
    pieces are dropped. A marker written inside a line is the story's text, not a separator (and
    never becomes the marker token: :func:`storylens.model.tokenizer.text_only`). A story longer than
    ``$STORYLENS_MAX_STORY_MB`` (a file with no marker lines, say) is refused, naming ``source``."""
    limit = max_story_bytes()
    current: list[str] = []
    size = 0
    for line in lines:
        if line.strip(_EDGE) == EOT:
            story = "\n".join(current).strip(_EDGE)
            current, size = [], 0
            if story:
                yield story
        else:
            current.append(line)
            size += len(line) + 1
            if size > limit:
                raise StorylensError(
                    f"{source}: a story longer than {_mb(limit)} MB (no line holding only {EOT} ends it; "
                    f"raise ${MAX_STORY_MB_ENV} for longer stories)"
                )
    story = "\n".join(current).strip(_EDGE)
    if story:
        yield story


def split_stories(text: str) -> list[str]:
    """Split on lines holding only the end-of-story marker; drop empty pieces.

    Lines end at ``\n``, ``\r\n`` or a lone ``\r`` (universal newlines); unlike ``str.splitlines``,
    U+2028, U+0085 or a form feed inside a story stay part of it, so a story is kept as written.
    A leading byte-order mark is dropped.
    """
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    return list(iter_stories(text.split("\n")))


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


def load_split(path: str | os.PathLike | None = None, n_quiz: int = N_QUIZ, first: int | None = None) -> Split:
    """The corpus split as the lesson does it; ``first`` keeps only the corpus's first stories
    (the lesson's recipe: the first 20,000 of TinyStories' train split, the last 200 of them the quiz)."""
    path = Path(path) if path is not None else default_corpus_path()
    return quiz_split(read_stories(path, limit=first), n_quiz=n_quiz, source=str(path))


# ---------------------------------------------------------------- the quiz shipped with a model


def shipped_quiz(folder: str | os.PathLike | None) -> list[str] | None:
    """The quiz stories a model folder ships (``quiz.txt.gz``), or None."""
    if folder is None or not (Path(folder) / QUIZ_FILE).is_file():
        return None
    return read_stories(Path(folder) / QUIZ_FILE)


def shipped_leakage(folder: str | os.PathLike | None) -> dict | None:
    """The leakage check stored with a model folder (``leakage.json``), or None."""
    path = Path(folder) / LEAKAGE_FILE if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return read_json(path)
    except (OSError, ValueError) as e:
        raise StorylensError(f"{path}: unreadable ({e})") from None
