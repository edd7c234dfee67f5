"""A head's kept examples as data: :class:`Example`, and what every set of top examples does with what it
holds (:class:`ExampleStore`): merge, checkpoint and restore, read, write as JSON or a data frame. How the
examples are chosen as the recording feeds them: :mod:`storylens.looking.examples`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from storylens.core.frames import to_frame
from storylens.core.heads import head_label
from storylens.core.publish import write_text_atomic
from storylens.core.schema import versioned

KEY_BEFORE = 3  # key_tokens: the key's window is key - 3 .. key + 3
KEY_AFTER = 4
QUERY_AFTER = 3  # tokens: the query's window is query - context .. query + 2
WEIGHT_DECIMALS = 4  # (at most 12: rounded() needs 5^d under 2^29) weights: the query's attention over its window, rounded (enough to shade by)
PER_STORY = 2  # score and report: at most this many examples of one story per head and detector
EXAMPLE_FIELDS = (
    "story",
    "query",
    "value",
    "key",
    "key_weight",
    "tokens",
    "query_at",
    "key_tokens",
    "key_at",
    "weights",
    "key_weights",
)
STATE_KEYS = {"k", "context", "per_story", "shape", "detectors", "examples"}


@dataclass(frozen=True)
class Example:
    """One kept query of one head for one detector. Positions count the opening marker as 0.

    ``tokens`` are the story's ids from ``max(0, query - context)`` to ``min(length, query + 3)``
    (exclusive), the query at ``tokens[query_at]``; ``key_tokens`` the ids from ``max(0, key - 3)``
    to ``min(length, key + 4)``, the key at ``key_tokens[key_at]``. ``weights[i]`` is the attention
    the query gives ``tokens[i]``, for ``i`` up to and including ``query_at`` (the keys it can see),
    rounded to :data:`WEIGHT_DECIMALS` decimals; ``key_weights[i]`` the same for ``key_tokens[i]``,
    for the key window's positions up to the query (``key_weights[key_at] == round(key_weight)``)."""

    story: int  # the story's index in source order
    query: int  # query position
    value: float  # the detector's value at this query
    key: int  # the most-attended key position (ties: the earliest)
    key_weight: float  # the attention weight on that key
    tokens: tuple[int, ...]
    query_at: int
    key_tokens: tuple[int, ...]
    key_at: int
    weights: tuple[float, ...]
    key_weights: tuple[float, ...]

    @property
    def order(self) -> tuple[float, int, int]:
        """The sort key: best first is smallest."""
        return (-self.value, self.story, self.query)

    def to_state(self) -> dict:
        return {
            "story": self.story,
            "query": self.query,
            "value": self.value,
            "key": self.key,
            "key_weight": self.key_weight,
            "tokens": list(self.tokens),
            "query_at": self.query_at,
            "key_tokens": list(self.key_tokens),
            "key_at": self.key_at,
            "weights": list(self.weights),
            "key_weights": list(self.key_weights),
        }


def best_examples(examples, k: int, per_story: int | None = None) -> list:
    """The top ``k`` of ``examples`` under the order, each ``(story, query)`` once (its best), at
    most ``per_story`` of one story (None: any number)."""
    out: list[Example] = []
    seen: set[tuple[int, int]] = set()
    taken: dict[int, int] = {}
    for e in sorted(examples, key=lambda e: e.order):
        if (e.story, e.query) in seen or (per_story is not None and taken.get(e.story, 0) >= per_story):
            continue
        seen.add((e.story, e.query))
        taken[e.story] = taken.get(e.story, 0) + 1
        out.append(e)
        if len(out) == k:
            break
    return out


def key_seen(query: int, key: int, key_at: int, key_tokens: Sequence[int]) -> int:
    """How many of the key window's tokens the query sees: those up to the query itself."""
    return min(len(key_tokens), query - (key - key_at) + 1)


_Store = TypeVar("_Store", bound="ExampleStore")


class ExampleStore:
    """For every head and detector, the kept examples, best first (``_kept[detector][layer][head]``), and
    what is done with them once kept. :class:`~storylens.looking.examples.TopExamples` feeds them."""

    n_layer: int
    n_head: int
    k: int
    context: int
    per_story: int | None
    detectors: tuple[str, ...]
    _kept: dict[str, list[list[list[Example]]]]

    def _settle(self) -> None:
        """Make the kept lists current (a subclass that feeds them lazily overrides this)."""

    def _forget_fed(self) -> None:
        """Drop what was fed but not yet kept, and the kept lists' tensor copies (overridden with them)."""

    def _empty(self) -> list[list[list[Example]]]:
        return [[[] for _ in range(self.n_head)] for _ in range(self.n_layer)]

    # ---------------------------------------------------------------- combining and checkpoints

    def _same_kind(self, other: ExampleStore, what: str) -> None:
        mine = (self.n_layer, self.n_head, self.detectors, self.k, self.context, self.per_story)
        theirs = (other.n_layer, other.n_head, other.detectors, other.k, other.context, other.per_story)
        if mine != theirs:
            raise ValueError(
                f"{what}: other heads, detectors, k, context or per_story ({theirs[0]}x{theirs[1]} heads, "
                f"{', '.join(theirs[2])}, k={theirs[3]}, context={theirs[4]}, per_story={theirs[5]}) than this "
                f"one's ({mine[0]}x{mine[1]} heads, {', '.join(mine[2])}, k={mine[3]}, context={mine[4]}, "
                f"per_story={mine[5]})"
            )

    def merge(self: _Store, other: ExampleStore) -> _Store:
        """Keep the top k of the union of both (``other`` is left as it is); returns ``self``."""
        self._same_kind(other, "merge")
        self._settle()
        other._settle()
        self._forget_fed()  # the lists change: slots are made again from them when fed
        for name in self.detectors:
            for mine, theirs in zip(self._kept[name], other._kept[name]):
                for h in range(self.n_head):
                    if theirs[h]:
                        mine[h] = best_examples(mine[h] + theirs[h], self.k, self.per_story)
        return self

    def state(self) -> dict:
        """Everything kept, as plain data (ints, floats, strings, lists, dicts): a checkpoint, or
        what a worker sends to be merged. ``examples[detector][layer][head]`` lists the examples
        best first."""
        self._settle()
        return {
            "k": self.k,
            "context": self.context,
            "per_story": self.per_story,
            "shape": [self.n_layer, self.n_head],
            "detectors": list(self.detectors),
            "examples": {
                name: [[[e.to_state() for e in head] for head in layer] for layer in self._kept[name]]
                for name in self.detectors
            },
        }

    def load_state(self: _Store, state: dict) -> _Store:
        """Take the examples of :meth:`state` (the same heads, detectors, k and context), every
        field checked; a state that is not what :meth:`state` writes raises ValueError saying which
        part is wrong, and changes nothing. Returns ``self``."""
        if not isinstance(state, dict) or set(state) != STATE_KEYS:
            raise ValueError(not_a_state(state))
        given = (state["shape"], state["detectors"], state["k"], state["context"], state["per_story"])
        mine = ([self.n_layer, self.n_head], list(self.detectors), self.k, self.context, self.per_story)
        if given != mine or any(isinstance(x, bool) for x in (*given[0], given[2], given[3], given[4])):
            raise ValueError(
                f"examples state: shape {given[0]!r}, detectors {given[1]!r}, k {given[2]!r}, context {given[3]!r}, "
                f"per_story {given[4]!r}; expected {mine[0]}, {mine[1]}, {mine[2]}, {mine[3]}, {mine[4]}"
            )
        examples = state["examples"]
        if not isinstance(examples, dict) or set(examples) != set(self.detectors):
            got = ", ".join(map(str, examples)) if isinstance(examples, dict) else type(examples).__name__
            raise ValueError(
                f"examples state: examples are for {got or 'nothing'}; expected {', '.join(self.detectors)}"
            )
        loaded = {}
        for name in self.detectors:
            layers = examples[name]
            where = f"examples state: examples.{name}"
            if not isinstance(layers, list) or len(layers) != self.n_layer:
                raise ValueError(f"{where}: expected a list of {self.n_layer} layers")
            out = self._empty()
            for li, heads in enumerate(layers):
                if not isinstance(heads, list) or len(heads) != self.n_head:
                    raise ValueError(f"{where}[{li}]: expected a list of {self.n_head} heads")
                for hi, items in enumerate(heads):
                    out[li][hi] = self._check_list(items, f"{where}[{li}][{hi}]")
            loaded[name] = out
        self._kept = loaded
        self._forget_fed()
        return self

    def _check_list(self, items, where: str) -> list[Example]:
        if not isinstance(items, list) or len(items) > self.k:
            raise ValueError(f"{where}: expected a list of at most k={self.k} examples")
        out = [self._check_example(x, f"{where}[{i}]") for i, x in enumerate(items)]
        if out != best_examples(out, self.k, self.per_story):
            raise ValueError(
                f"{where}: the examples are not best first, or a (story, query) repeats, or a story passes per_story"
            )
        return out

    def _check_example(self, x, where: str) -> Example:
        if not isinstance(x, dict) or set(x) != set(EXAMPLE_FIELDS):
            raise ValueError(f"{where}: expected an example with fields {', '.join(EXAMPLE_FIELDS)}")

        def whole(field: str, low: int = 0) -> int:
            v = x[field]
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{where}.{field}: expected a whole number >= {low}, got {v!r}")
            return v

        def number(field: str) -> float:
            v = x[field]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}.{field}: expected a finite number, got {v!r}")
            return float(v)

        def weights(field: str, n: int) -> tuple[float, ...]:
            v = x[field]
            if (
                not isinstance(v, list)
                or len(v) != n
                or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1 for w in v)
            ):
                raise ValueError(f"{where}.{field}: expected {n} weights between 0 and 1, one per key seen")
            return tuple(float(w) for w in v)

        def ids(field: str) -> tuple[int, ...]:
            v = x[field]
            if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v):
                raise ValueError(f"{where}.{field}: expected a list of token ids")
            return tuple(v)

        story, query, key, query_at, key_at = (whole(f) for f in ("story", "query", "key", "query_at", "key_at"))
        tokens, key_tokens = ids("tokens"), ids("key_tokens")
        if query_at != query - max(0, query - self.context) or query_at >= len(tokens):
            raise ValueError(f"{where}.query_at: {query_at} does not place query {query} in its tokens")
        if key_at != key - max(0, key - KEY_BEFORE) or key_at >= len(key_tokens) or key > query:
            raise ValueError(f"{where}.key_at: {key_at} does not place key {key} in its key_tokens")
        value, key_weight = number("value"), number("key_weight")
        seen = weights("weights", query_at + 1)
        near_key = weights("key_weights", key_seen(query, key, key_at, key_tokens))
        return Example(story, query, value, key, key_weight, tokens, query_at, key_tokens, key_at, seen, near_key)

    # ---------------------------------------------------------------- reading

    def entries(self, layer: int, head: int, name: str) -> list[Example]:
        """The kept examples of head ``(layer, head)`` (0-based) for detector ``name``, best first."""
        if name not in self._kept:
            raise KeyError(f"{name!r}: no such detector ({', '.join(self.detectors)})")
        if not (0 <= layer < self.n_layer and 0 <= head < self.n_head):
            raise KeyError(f"head ({layer}, {head}): no such head ({self.n_layer} layers of {self.n_head})")
        self._settle()
        return list(self._kept[name][layer][head])

    def as_json(self, decode: Callable[[int], str], label: Callable[[int, int], str] = head_label) -> dict:
        """What :meth:`to_json` writes: ``schema_version`` (:mod:`storylens.core.schema`), ``k``, ``per_story`` (None: no limit), the detectors, and every head, layer-major (``layer`` and ``head`` counted from 1,
        like its label), its examples per detector with the token ids decoded one by one
        (``decode(id) -> str``)."""
        self._settle()
        texts: dict[int, str] = {}

        def text(ids: Sequence[int]) -> list[str]:
            out = []
            for t in ids:
                if t not in texts:
                    texts[t] = str(decode(t))
                out.append(texts[t])
            return out

        heads = []
        for layer in range(self.n_layer):
            for head in range(self.n_head):
                per = {}
                for name in self.detectors:
                    per[name] = [
                        {**e.to_state(), "tokens": text(e.tokens), "key_tokens": text(e.key_tokens)}
                        for e in self._kept[name][layer][head]
                    ]
                heads.append({"label": label(layer, head), "layer": layer + 1, "head": head + 1, "examples": per})
        return versioned({"k": self.k, "per_story": self.per_story, "detectors": list(self.detectors), "heads": heads})

    def to_pandas(self, decode: Callable[[int], str] | None = None, label: Callable[[int, int], str] = head_label):
        """Every kept example as one row of a ``pandas.DataFrame``: the head (``label``, ``layer`` and
        ``head`` from 1), the ``detector``, its ``rank`` (0: where the head fires most), then the
        :class:`Example`'s fields (``tokens`` and ``key_tokens`` as text where ``decode(id) -> str`` is
        given, else ids). Needs pandas (``storylens[pandas]``)."""

        def text(ids: Sequence[int]) -> list:
            return [decode(t) for t in ids] if decode is not None else list(ids)

        self._settle()
        rows = []
        for layer in range(self.n_layer):
            for head in range(self.n_head):
                for name in self.detectors:
                    for rank, e in enumerate(self._kept[name][layer][head]):
                        where = {"label": label(layer, head), "layer": layer + 1, "head": head + 1}
                        state = {**e.to_state(), "tokens": text(e.tokens), "key_tokens": text(e.key_tokens)}
                        rows.append({**where, "detector": name, "rank": rank, **state})
        return to_frame(rows, ["label", "layer", "head", "detector", "rank", *EXAMPLE_FIELDS])

    def to_json(
        self,
        path: str | os.PathLike,
        decode: Callable[[int], str],
        label: Callable[[int, int], str] = head_label,
    ) -> Path:
        """Write :meth:`as_json` to ``path`` atomically (a folder: ``path/examples.json``); returns
        the file written. ``label(layer, head)`` names each head (default ``L{layer+1}H{head+1}``)."""
        target = Path(path)
        if target.is_dir() and not target.is_symlink():
            target = target / "examples.json"
        text = json.dumps(self.as_json(decode, label), ensure_ascii=False, allow_nan=False, indent=1)
        return write_text_atomic(target, text + "\n")


def not_a_state(state) -> str:
    got = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
    return f"examples state: not a TopExamples state (got {got or 'an empty dict'}; expected {', '.join(sorted(STATE_KEYS))})"
