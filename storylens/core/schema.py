"""Versioned outputs: every JSON file a run writes (heads.json, examples.json, summary.json, patch.json) carries
``schema_version``, and the package holds a JSON Schema for each (``storylens/schemas``).

A reader checks the version first (:func:`check_version`): a file without one (written before
versions) or with another gets one line saying so, not a KeyError further down. The version goes up
when a key is renamed, removed or changes meaning; a new head-table column does not change it (the
heads schema takes any column, and :func:`heads_schema` names the columns a run must have).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

import jsonschema

from storylens.core.errors import StorylensError
from storylens.core.files import MAX_RESULT_BYTES, parse_json, read_text

SCHEMA_KEY = "schema_version"
SCHEMA_VERSION = 1
SCHEMAS = (
    "heads",
    "examples",
    "summary-score",
    "summary-report",
    "patch",
    "circuit",
    "timeline-entry",
    "why",
    "writes",
)


def versioned(doc: dict) -> dict:
    """``doc`` with ``schema_version`` as its first key."""
    return {SCHEMA_KEY: SCHEMA_VERSION, **doc}


def check_version(doc: object, where: str) -> None:
    """One StorylensError line unless ``doc`` (a parsed JSON file, ``where`` naming it) is a JSON
    object of this storylens's schema version."""
    if not isinstance(doc, dict):
        raise StorylensError(f"{where}: not a storylens output (a JSON {type(doc).__name__}, not an object)")
    if SCHEMA_KEY not in doc:
        raise StorylensError(
            f"{where}: written by an older storylens (no {SCHEMA_KEY}; this one reads version "
            f"{SCHEMA_VERSION}): run it again with this storylens"
        )
    version = doc[SCHEMA_KEY]
    if type(version) is not int:  # True and 1.0 equal 1 in Python, and neither is a version
        raise StorylensError(f"{where}: {SCHEMA_KEY} must be the number {SCHEMA_VERSION} (got {version!r})")
    if version != SCHEMA_VERSION:
        raise StorylensError(
            f"{where}: {SCHEMA_KEY} {version}, but this storylens reads version {SCHEMA_VERSION}: "
            "read it with the storylens that wrote it, or run it again with this one"
        )


def schema(name: str) -> dict:
    """The JSON Schema ``name`` (one of :data:`SCHEMAS`) from the package."""
    if name not in SCHEMAS:
        raise KeyError(f"{name!r}: no such schema ({', '.join(SCHEMAS)})")
    return json.loads(files("storylens.schemas").joinpath(f"{name}.schema.json").read_text(encoding="utf-8"))


def heads_schema(columns: Sequence[str]) -> dict:
    """The heads.json schema with every row holding ``columns`` (a run's score columns, e.g. the
    names of :func:`storylens.looking.detectors.table_columns` less the flag) as numbers or null, and
    the column list naming exactly those plus the flag."""
    doc = schema("heads")
    row = doc["$defs"]["row"]
    row["required"] = [*row["required"], *columns]
    row["properties"] = {**row["properties"], **{c: {"type": ["number", "null"]} for c in columns}}
    names = [*columns, "dormant"]
    doc["properties"]["columns"]["prefixItems"] = [
        {"type": "object", "properties": {"name": {"const": c}}} for c in names
    ]
    doc["properties"]["columns"]["minItems"] = doc["properties"]["columns"]["maxItems"] = len(names)
    return doc


def _parse(path: Path, unreadable: str) -> object:
    """The JSON of a result file (:func:`storylens.core.files.read_json`: a regular file of at most
    MAX_RESULT_BYTES; NaN, Infinity and nesting too deep to read are refused)."""
    tail = f"; {unreadable}" if unreadable else ""
    try:
        text = read_text(path, MAX_RESULT_BYTES, unreadable)
    except OSError as e:
        raise StorylensError(f"{path}: cannot read ({e.strerror}{tail})") from None
    try:
        return parse_json(text)
    except ValueError as e:
        raise StorylensError(f"{path}: not JSON ({e})") from None


def check_schema(doc: object, sch: dict, where: str) -> None:
    """One StorylensError line unless ``doc`` matches the JSON Schema ``sch`` (the first error that matters most,
    with where in the file it is)."""
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(sch).iter_errors(doc))
    if error is not None:
        at = "".join(f"[{p!r}]" for p in error.absolute_path) or "the top level"
        message = error.message if len(error.message) <= 200 else error.message[:200] + "..."
        raise StorylensError(f"{where}: not a valid {sch.get('title', 'storylens output')} (at {at}: {message})")


def read_versioned(path: Path, unreadable: str = "", sch: dict | str | None = None) -> dict:
    """A JSON file of this storylens's schema version, or one StorylensError line naming it (``unreadable``: what
    to add where the file cannot be read, e.g. ``"not a folder storylens patch wrote"``). Given a schema (a name
    from :data:`SCHEMAS` or the schema itself), the file must match it: read back as strictly as it is written."""
    doc = _parse(path, unreadable)
    check_version(doc, str(path))
    if sch is not None:
        check_schema(doc, schema(sch) if isinstance(sch, str) else sch, str(path))
    assert isinstance(doc, dict)
    return doc


def check_grid(labels: Sequence[tuple[str, int, int]], n_layer: int, n_head: int, where: str, base: int = 0) -> None:
    """One StorylensError line unless ``labels`` (each head's ``L{b}H{h}`` label, block and head counted from
    ``base``) are every head of an ``n_layer`` x ``n_head`` model once, block-major, each label its position's."""
    if len(labels) != n_layer * n_head:
        raise StorylensError(
            f"{where}: {len(labels)} heads, not the {n_layer * n_head} of {n_layer} blocks x {n_head} heads"
        )
    for i, (label, layer, head) in enumerate(labels):
        want = (i // n_head + base, i % n_head + base)
        if (layer, head) != want:
            raise StorylensError(f"{where}: head {i + 1} is block {layer}, head {head}; expected {want[0]}, {want[1]}")
        if label != f"L{want[0] - base + 1}H{want[1] - base + 1}":
            raise StorylensError(f"{where}: the head at block {layer}, head {head} is labelled {label!r}")
