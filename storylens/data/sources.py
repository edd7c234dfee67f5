"""Where stories come from, streamed one at a time: any corpus, in flat memory.

* a text file, plain or gzip, with a line holding only ``<|endoftext|>`` after each story (the
  TinyStories format; ``tinystories`` / ``tinystories-valid`` name the downloaded splits);
* JSON lines (``.jsonl``, ``.jsonl.gz``, ``.ndjson``): one object per line, the story in
  ``text_field``;
* Parquet (``.parquet``): the column ``text_field``, read a record batch at a time;
* a Hugging Face dataset: a folder written by ``datasets.Dataset.save_to_disk``, or a hub name
  (``hf:roneneldan/TinyStories``; read from the local cache, or streamed from the hub only with
  ``allow_download``), its ``split`` and ``text_field``.

A :class:`StorySource` can be iterated more than once (the name vocabulary is a first pass over the
stories scored). Empty stories are dropped; ``limit`` keeps the first that many. Every problem is a
one-line :class:`~storylens.core.errors.StorylensError` naming the source.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from storylens.core.errors import StorylensError, UsageError, install_hint
from storylens.core.offline import hub_offline
from storylens.data.stories import (
    MAX_STORY_MB_ENV,
    iter_stories,
    max_corpus_bytes,
    max_story_bytes,
    resolve_corpus,
    text_lines,
    too_much_text,
)

KINDS = ("text", "jsonl", "parquet", "hf")


@dataclass(frozen=True)
class StorySource:
    kind: str  # one of KINDS
    location: str  # a path, or a hub dataset name
    text_field: str = "text"
    limit: int | None = None
    split: str = "train"
    allow_download: bool = False
    split_given: bool = False  # --split was asked for (a saved dataset without splits refuses it)

    def __iter__(self) -> Iterator[str]:
        stories = (s for s in _READERS[self.kind](self) if s.strip())
        return islice(stories, self.limit) if self.limit is not None else stories

    def describe(self) -> str:
        extra = f", field {self.text_field!r}" if self.kind != "text" else ""
        extra += f", split {self.split!r}" if self.kind == "hf" and (self.split_given or self.has_splits()) else ""
        extra += f", first {self.limit:,}" if self.limit is not None else ""
        return f"{self.location} ({self.kind}{extra})"

    def has_splits(self) -> bool:
        """A hub dataset or a saved ``DatasetDict`` has splits; a saved single dataset has none."""
        return self.kind == "hf" and not (Path(self.location) / "dataset_info.json").is_file()

    def fingerprint(self) -> dict:
        """What identifies the stories: checked when a run resumes from a checkpoint."""
        out = {
            "kind": self.kind,
            "location": self.location,
            "text_field": self.text_field,
            "limit": self.limit,
            "split": self.split if self.has_splits() else None,
        }
        p = Path(self.location)
        if p.exists():
            st = p.stat()
            out.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
        return out


def open_source(
    source: str | os.PathLike,
    *,
    text_field: str = "text",
    limit: int | None = None,
    split: str | None = None,
    allow_download: bool = False,
) -> StorySource:
    """A :class:`StorySource` for ``source`` (see the module docstring), checked to exist.
    ``split`` (default ``train``) is for Hugging Face datasets only; asked of any other source it
    is refused rather than ignored."""
    if limit is not None and not 1 <= limit <= sys.maxsize:
        raise UsageError(f"--limit: must be between 1 and {sys.maxsize:,} (got {limit:,})")
    if not str(source):
        raise UsageError("--stories: empty; give a stories file, a dataset folder or hf:OWNER/NAME")
    given, split = split is not None, split or "train"
    s = str(source)
    if s.startswith("hf:"):
        return StorySource("hf", s[3:], text_field, limit, split, allow_download, given)
    path = resolve_corpus(Path(s))
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return StorySource("hf", str(path), text_field, limit, split, allow_download, given)
        raise StorylensError(f"{path}: a folder, not a stories file (nor a saved Hugging Face dataset)")
    if not path.exists():
        raise StorylensError(f"{path}: no such file (a hub dataset is named hf:OWNER/NAME)")
    if not path.is_file():
        raise StorylensError(f"{path}: not a regular file")
    kind = file_kind(path)
    if given:
        raise UsageError(f"--split: only for a Hugging Face dataset; {path} is a {kind} file with no splits")
    return StorySource(kind, str(path), text_field, limit, split, allow_download)


def file_kind(path: str | os.PathLike) -> str:
    """``jsonl``, ``parquet`` or ``text``, by the file's name."""
    name = Path(path).name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz", ".json", ".json.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


# ---------------------------------------------------------------- readers


def _read_text(src: StorySource) -> Iterator[str]:
    return iter_stories(text_lines(src.location), source=src.location)


def _field(row, src: StorySource, where: str) -> str:
    if not isinstance(row, dict) or src.text_field not in row:
        raise StorylensError(f"{src.location}: {where} has no field {src.text_field!r} (choose one with --text-field)")
    text = row[src.text_field]
    if not isinstance(text, str):
        raise StorylensError(f"{src.location}: {where}: field {src.text_field!r} is {type(text).__name__}, not text")
    return text


class _Budget:
    """The bytes a source has given so far, against ``$STORYLENS_MAX_CORPUS_MB`` (the whole corpus)
    and ``$STORYLENS_MAX_STORY_MB`` (one story): the same limits as the text reader's."""

    def __init__(self, src: StorySource):
        self.src, self.total = src, 0
        self.corpus, self.story = max_corpus_bytes(), max_story_bytes()

    def take(self, text: str, where: str) -> str:
        size = len(text.encode("utf-8", "surrogatepass"))
        self.total += size
        if size > self.story:
            raise StorylensError(
                f"{self.src.location}: {where}: a story of {size / 2**20:,.1f} MB, longer than "
                f"{self.story / 2**20:,.0f} MB (raise ${MAX_STORY_MB_ENV} for longer stories)"
            )
        if self.total > self.corpus:
            raise too_much_text(self.src.location, self.corpus)
        return text


def _read_jsonl(src: StorySource) -> Iterator[str]:
    for number, line in enumerate(text_lines(src.location), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise StorylensError(f"{src.location}: line {number} is not JSON ({e})") from None
        except RecursionError:
            raise StorylensError(f"{src.location}: line {number} is JSON nested too deeply to read") from None
        yield _field(row, src, f"line {number}")


def _read_parquet(src: StorySource) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise StorylensError(f"{src.location}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        f = pq.ParquetFile(src.location)
        if src.text_field not in f.schema_arrow.names:
            raise StorylensError(
                f"{src.location}: no column {src.text_field!r} (columns: "
                f"{', '.join(f.schema_arrow.names)}; choose one with --text-field)"
            )
        budget, number = _Budget(src), 0
        for batch in f.iter_batches(batch_size=64, columns=[src.text_field]):
            for text in batch.column(0).to_pylist():
                number += 1
                if text is not None and not isinstance(text, str):
                    raise StorylensError(
                        f"{src.location}: column {src.text_field!r} holds {type(text).__name__}, not text"
                    )
                yield budget.take(text or "", f"row {number}")
    except StorylensError:
        raise
    except Exception as e:  # pyarrow's errors for a damaged file
        raise StorylensError(
            f"{src.location}: not a readable Parquet file ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        ) from None


def _read_hf(src: StorySource) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise StorylensError(
            f"{src.location}: a Hugging Face dataset needs the datasets package: {install_hint('hf')}"
        ) from None

    datasets.disable_progress_bars()
    try:
        if Path(src.location).is_dir():
            ds = datasets.load_from_disk(src.location)
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise StorylensError(f"{src.location}: no split {src.split!r} (splits: {', '.join(ds)})")
                ds = ds[src.split]
            elif src.split_given:
                raise StorylensError(f"{src.location}: a single saved dataset with no splits; drop --split {src.split}")
        else:
            with hub_offline(not src.allow_download):
                # streamed from the hub when downloads are allowed; else the local cache (memory-mapped)
                ds = datasets.load_dataset(src.location, split=src.split, streaming=src.allow_download)
    except StorylensError:
        raise
    except Exception as e:  # datasets raises many types for "not cached" / "no network"
        hint = (
            ""
            if src.allow_download
            else " (not in the local cache; storylens stays offline unless asked: --allow-download)"
        )
        raise StorylensError(
            f"{src.location}: cannot open the dataset{hint} ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        ) from None
    budget = _Budget(src)
    for number, row in enumerate(ds, 1):
        yield budget.take(_field(row, src, f"row {number}"), f"row {number}")


_READERS = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf}


# ---------------------------------------------------------------- chunks


def chunked(stories: Iterable, size: int, start: int = 0) -> Iterator[tuple[int, list]]:
    """``(index of the first, items)`` for consecutive pieces of ``size`` items of any iterable,
    indices counted from ``start``."""
    it = iter(stories)
    while True:
        piece = list(islice(it, size))
        if not piece:
            return
        yield start, piece
        start += len(piece)


def chunk_spans(start: int, total: int, chunk_stories: int, tasks: int) -> list[list[int]]:
    """The first story of every chunk from ``start`` to ``total``, in at most ``tasks`` runs of
    consecutive chunks (one per reader), as even as whole chunks allow."""
    firsts = list(range(start, total, chunk_stories))
    tasks = max(1, min(tasks, len(firsts)))
    size, extra = divmod(len(firsts), tasks)
    out, i = [], 0
    for t in range(tasks):
        n = size + (t < extra)
        out.append(firsts[i : i + n])
        i += n
    return out


def read_chunk_run(source, firsts: list[int], total: int, chunk_stories: int) -> Iterator[tuple[int, list[str]]]:
    """The chunks that start at ``firsts`` (consecutive, from :func:`chunk_spans`), read from
    ``source`` where this runs: each ``(index of its first story, its stories)``, cut exactly as
    :func:`chunked` cuts the whole source."""
    stop = min(firsts[-1] + chunk_stories, total)
    return chunked(islice(iter(source), firsts[0], stop), chunk_stories, firsts[0])
