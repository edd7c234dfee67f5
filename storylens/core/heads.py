"""One attention head: ``Head(layer, head)``, 0-indexed in code, ``L{layer}H{head}`` from 1 for people.

The lesson names heads ``L1H1`` .. ``L6H4``, counting blocks and heads from 1; tensors (and
TransformerLens, ``blocks.{layer}.attn.hook_pattern[batch, head, query, key]``) count from 0.
``Head(4, 2).label == "L5H3"`` and ``Head.parse("L5H3") == Head(4, 2)``: the one conversion,
used by every table, figure and JSON field.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

if TYPE_CHECKING:
    import numpy as np


class Head(NamedTuple):
    layer: int  # 0-based block index
    head: int  # 0-based head index within the block

    @property
    def label(self) -> str:
        return head_label(self.layer, self.head)

    @classmethod
    def parse(cls, label: str) -> Head:
        return cls(*parse_head_label(label))

    @classmethod
    def every(cls, n_layer: int, n_head: int) -> Iterator[Head]:
        """Every head, layer-major: ``Head(0, 0), Head(0, 1), ...``."""
        return (cls(layer, head) for layer in range(n_layer) for head in range(n_head))


def head_label(layer: int, head: int) -> str:
    """``head_label(4, 2) == "L5H3"``: block and head counted from 1, as the lesson does."""
    return f"L{layer + 1}H{head + 1}"


def parse_head_label(label: str) -> tuple[int, int]:
    """Inverse of :func:`head_label`: ``"L5H3" -> (4, 2)``."""
    s = label.strip().upper()
    if not s.startswith("L") or "H" not in s:
        raise ValueError(f"not a head label: {label!r} (expected e.g. L5H3)")
    b, h = s[1:].split("H", 1)
    if not (b.isdigit() and h.isdigit()) or int(b) < 1 or int(h) < 1:
        raise ValueError(f"not a head label: {label!r} (expected e.g. L5H3)")
    return int(b) - 1, int(h) - 1


HeadGrid: TypeAlias = (
    "np.ndarray | Sequence[Sequence[float | None]] | Mapping[str, float] | Sequence[tuple[str, float]]"
)
"""One score per head, as the heatmaps take it: a ``[block, head]`` grid (0-indexed; None: not
computed), a ``{"L5H3": value}`` mapping or ``("L5H3", value)`` pairs."""


def as_heads(heads: Iterable[Head | str | tuple[int, int]], n_layer: int, n_head: int) -> tuple[Head, ...]:
    """``[(4, 2), "L1H1"] -> (Head(0, 0), Head(4, 2))``: checked against the model's sizes, sorted,
    unique. Raises ``ValueError`` naming the head that does not exist."""
    out = set()
    for h in heads:
        layer, head = parse_head_label(h) if isinstance(h, str) else (int(h[0]), int(h[1]))
        if not (0 <= layer < n_layer and 0 <= head < n_head):
            name = h if isinstance(h, str) else head_label(layer, head)
            raise ValueError(f"head {name}: no such head (the model has L1H1 .. {head_label(n_layer - 1, n_head - 1)})")
        out.add(Head(layer, head))
    return tuple(sorted(out))
