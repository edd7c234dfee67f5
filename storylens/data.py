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

from .constants import EOT, N_QUIZ  # noqa: F401  (the lesson's numbers live in constants)
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


def resolve_corpus(path: str | os.PathLike) -> Path:
    """A file path as given, or a TinyStories name (``tinystories``, ``tinystories-valid``) looked
    up in the local Hugging Face cache, where ``storylens data download`` puts it (never fetched here)."""
    name = str(path)
    if name not in HUB_NAMES:
        return Path(path)
    from huggingface_hub import try_to_load_from_cache

    split = HUB_NAMES[name]
    found = try_to_load_from_cache(HUB_DATASET, HUB_FILES[split], repo_type="dataset")
    if not isinstance(found, str):
        raise StorylensError(f"{name}: the TinyStories {split} split is not downloaded here; "
                             f"get it with: storylens data download --split {split}")
    return Path(found)


def download_tinystories(split: str = "train") -> Path:
    """Fetch one TinyStories text file from the Hugging Face Hub into the user's cache (with a
    progress bar); only ever called by ``storylens data download``."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging

    if split not in HUB_FILES:
        raise StorylensError(f"--split: one of {', '.join(HUB_FILES)} (got {split!r})")
    level = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # its retry warnings would bury the one line that matters
    try:
        return Path(hf_hub_download(HUB_DATASET, HUB_FILES[split], repo_type="dataset"))
    except Exception as e:  # the hub client raises many types for "no network"
        raise StorylensError(f"{HUB_DATASET}: could not download {HUB_FILES[split]} "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
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
    if limit is not None:
        return _first_stories(path, limit)
    raw = read_corpus_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StorylensError(
            f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})"
        ) from None
    return split_stories(text)


def _first_stories(path: Path, limit: int) -> list[str]:
    """The first ``limit`` stories, read line by line (a 2 GB file costs only what it holds)."""
    from itertools import islice

    if limit < 1:
        raise StorylensError(f"--first: must be at least 1 (got {limit})")

    def lines(stream):
        for number, raw in enumerate(stream, 1):
            try:
                yield raw.decode("utf-8").rstrip("\n")
            except UnicodeDecodeError:
                raise StorylensError(f"{path}: not UTF-8 text (line {number})") from None

    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            return list(islice(iter_stories(lines(gzip.GzipFile(fileobj=f) if gz else f)), limit))
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise StorylensError(f"{path}: corrupt gzip file ({e})") from None
    except OSError as e:
        raise StorylensError(f"{path}: cannot read ({e.strerror or e})") from None


def format_stories(stories) -> str:
    """The corpus format: every story followed by a line holding only the marker."""
    return "".join(f"{s}\n{EOT}\n" for s in stories)


def quiz_file_bytes(stories) -> bytes:
    """The shipped quiz file: gzip with no timestamp, so the same stories give the same bytes."""
    return gzip.compress(format_stories(stories).encode("utf-8"), compresslevel=9, mtime=0)


_EDGE = " \t\r\n"  # what is trimmed around a story or a marker line: ASCII whitespace only


def iter_stories(lines):
    """Stories from lines (without their ``\n``): a line holding only the end-of-story marker ends
    a story; each story is trimmed of ASCII whitespace at both ends; empty pieces are dropped."""
    current: list[str] = []
    for line in lines:
        if line.strip(_EDGE) == EOT:
            story = "\n".join(current).strip(_EDGE)
            current = []
            if story:
                yield story
        else:
            current.append(line)
    story = "\n".join(current).strip(_EDGE)
    if story:
        yield story


def split_stories(text: str) -> list[str]:
    """Split on lines holding only the end-of-story marker; drop empty pieces.

    Lines end at ``\n`` only (``\r\n`` too): unlike ``str.splitlines``, U+2028, U+0085 or a form
    feed inside a story stay part of it, so a story is kept exactly as stored.
    """
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
    import json

    path = Path(folder) / LEAKAGE_FILE if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StorylensError(f"{path}: unreadable ({e})") from None
