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
one-line :class:`~storylens.errors.StorylensError` naming the source.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

from .data import iter_stories, resolve_corpus
from .errors import StorylensError

KINDS = ("text", "jsonl", "parquet", "hf")


@dataclass(frozen=True)
class StorySource:
    kind: str  # one of KINDS
    location: str  # a path, or a hub dataset name
    text_field: str = "text"
    limit: int | None = None
    split: str = "train"
    allow_download: bool = False

    def __iter__(self) -> Iterator[str]:
        stories = (s for s in _READERS[self.kind](self) if s.strip())
        return islice(stories, self.limit) if self.limit is not None else stories

    def describe(self) -> str:
        extra = f", field {self.text_field!r}" if self.kind != "text" else ""
        extra += f", split {self.split!r}" if self.kind == "hf" else ""
        extra += f", first {self.limit:,}" if self.limit is not None else ""
        return f"{self.location} ({self.kind}{extra})"

    def fingerprint(self) -> dict:
        """What identifies the stories: checked when a run resumes from a checkpoint."""
        out = {"kind": self.kind, "location": self.location, "text_field": self.text_field, "limit": self.limit,
               "split": self.split}
        p = Path(self.location)
        if p.exists():
            st = p.stat()
            out.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
        return out


def open_source(source: str | os.PathLike, *, text_field: str = "text", limit: int | None = None,
                split: str = "train", allow_download: bool = False) -> StorySource:
    """A :class:`StorySource` for ``source`` (see the module docstring), checked to exist."""
    if limit is not None and limit < 1:
        raise StorylensError(f"--limit: must be at least 1 (got {limit})")
    s = str(source)
    if s.startswith("hf:"):
        return StorySource("hf", s[3:], text_field, limit, split, allow_download)
    path = resolve_corpus(Path(s))
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return StorySource("hf", str(path), text_field, limit, split, allow_download)
        raise StorylensError(f"{path}: a folder, not a stories file (nor a saved Hugging Face dataset)")
    if not path.exists():
        raise StorylensError(f"{path}: no such file (a hub dataset is named hf:OWNER/NAME)")
    if not path.is_file():
        raise StorylensError(f"{path}: not a regular file")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz", ".json", ".json.gz")):
        kind = "jsonl"
    elif name.endswith(".parquet"):
        kind = "parquet"
    else:
        kind = "text"
    return StorySource(kind, str(path), text_field, limit, split, allow_download)


# ---------------------------------------------------------------- readers


def _binary_lines(path: str):
    """Lines of a plain or gzip file, as bytes, streamed; one-line errors for a bad gzip or read."""
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            yield from (gzip.GzipFile(fileobj=f) if gz else f)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise StorylensError(f"{path}: corrupt gzip file ({e})") from None
    except OSError as e:
        raise StorylensError(f"{path}: cannot read ({e.strerror or e})") from None


def _text_lines(path: str):
    for number, raw in enumerate(_binary_lines(path), 1):
        try:
            yield raw.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError:
            raise StorylensError(f"{path}: not UTF-8 text (line {number})") from None


def _read_text(src: StorySource) -> Iterator[str]:
    return iter_stories(_text_lines(src.location))


def _field(row, src: StorySource, where: str) -> str:
    if not isinstance(row, dict) or src.text_field not in row:
        raise StorylensError(f"{src.location}: {where} has no field {src.text_field!r} (choose one with --text-field)")
    text = row[src.text_field]
    if not isinstance(text, str):
        raise StorylensError(f"{src.location}: {where}: field {src.text_field!r} is {type(text).__name__}, not text")
    return text


def _read_jsonl(src: StorySource) -> Iterator[str]:
    for number, line in enumerate(_text_lines(src.location), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise StorylensError(f"{src.location}: line {number} is not JSON ({e})") from None
        yield _field(row, src, f"line {number}")


def _read_parquet(src: StorySource) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise StorylensError(f"{src.location}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        f = pq.ParquetFile(src.location)
        if src.text_field not in f.schema_arrow.names:
            raise StorylensError(f"{src.location}: no column {src.text_field!r} (columns: "
                                 f"{', '.join(f.schema_arrow.names)}; choose one with --text-field)")
        for batch in f.iter_batches(batch_size=1024, columns=[src.text_field]):
            for text in batch.column(0).to_pylist():
                if text is not None and not isinstance(text, str):
                    raise StorylensError(f"{src.location}: column {src.text_field!r} holds "
                                         f"{type(text).__name__}, not text")
                yield text or ""
    except StorylensError:
        raise
    except Exception as e:  # pyarrow's errors for a damaged file
        raise StorylensError(f"{src.location}: not a readable Parquet file ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:160]})") from None


def _read_hf(src: StorySource) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise StorylensError(f"{src.location}: a Hugging Face dataset needs the datasets package: "
                             "pip install 'storylens[hf]'") from None
    from .hub import hub_offline

    datasets.disable_progress_bars()
    try:
        if Path(src.location).is_dir():
            ds = datasets.load_from_disk(src.location)
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise StorylensError(f"{src.location}: no split {src.split!r} (splits: {', '.join(ds)})")
                ds = ds[src.split]
        else:
            with hub_offline(not src.allow_download):
                # streamed from the hub when downloads are allowed; else the local cache (memory-mapped)
                ds = datasets.load_dataset(src.location, split=src.split, streaming=src.allow_download)
    except StorylensError:
        raise
    except Exception as e:  # datasets raises many types for "not cached" / "no network"
        hint = "" if src.allow_download else " (not in the local cache; storylens stays offline unless asked: --allow-download)"
        raise StorylensError(f"{src.location}: cannot open the dataset{hint} ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:160]})") from None
    for number, row in enumerate(ds, 1):
        yield _field(row, src, f"row {number}")


_READERS = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf}
