"""Dataclasses that are JSON objects: what a run writes as ``summary.json`` and reads back. A float that was not
measured (NaN) is written as null and read back as NaN where its field is a float (None where it is optional).

A :class:`Plain` dataclass is written as its fields, in order, as keys (nested ones as objects,
tuples and lists as arrays) and read back by its field types: the result types of the analysis
and the summaries of ``storylens score`` and ``report`` are the same classes on both sides, so a
figure is named once.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T", bound="Plain")


def plain(value: Any) -> Any:
    """A value as JSON holds it: dataclasses as dicts, tuples and lists as lists."""
    if isinstance(value, Plain):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None  # a figure not measured is null in JSON (NaN is not JSON)
    return value


def build(tp: Any, value: Any) -> Any:
    """``value`` (read from JSON) as the type ``tp``: dataclasses from dicts, lists and tuples of
    them, dicts of them, optionals."""
    if value is None:
        return float("nan") if tp is float else None  # a float field written as null was not measured
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return build(next(a for a in args if a is not type(None)), value)
    if origin is list:
        return [build(args[0], v) for v in value]
    if origin is tuple:  # tuple[X, ...] or a fixed tuple[X, Y, Z]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(build(args[0], v) for v in value)
        return tuple(build(a, v) for a, v in zip(args, value))
    if origin is dict:
        return {k: build(args[1], v) for k, v in value.items()} if args else dict(value)
    if isinstance(tp, type) and issubclass(tp, Plain):
        return tp.from_dict(value)
    return value


class Plain:
    """A dataclass that is a JSON object: its fields, in order, as keys."""

    def to_dict(self) -> dict:
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[T], d: dict) -> T:
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: build(hints[f.name], d[f.name]) for f in fields(cls) if f.name in d})  # type: ignore[arg-type]
