"""Score every head over many stories, streaming: one batch of attention maps at a time.

Every score is a **mean over stories of a per-story mean over that story's queries**:
each story counts once however long it is. Per-story means are summed and counted
batch by batch (:class:`~storylens.engine.accumulate.MeanAccumulator`). Each block's
map is scored the moment the model makes it (through ``attn.hook_pattern``) and freed
with its block; stories are encoded once, :data:`CHUNK_STORIES` at a time, so memory
does not grow with the number of stories (only the texts the caller passes, and the name
vocabulary of a first pass over them, span the run).

Positions count the end-of-story marker the model sees first as position 0 (see
:func:`storylens.model.tokenizer.encode_story`); a query at position q sees keys 0..q.
Stories are cut to the model's window first.

Scores, per head (the definitions the lesson leaves open are fixed here):

``name_mass``
    Queries: every position q after the main character's first mention (q > first)
    that is not itself one of the main character's name tokens (other names' tokens
    are ordinary positions), inside the story and the window. Value: the attention q
    puts on the name's token positions (only those at or before q can get any, by the
    causal mask). Name tokens are found by :mod:`storylens.data.names`. Stories
    without a main character, or whose window holds no such query, are skipped
    (counted in :attr:`HeadScores.n_main_character` / :attr:`HeadScores.n_name_scored`).
``name_baseline``
    What an even spread over the positions so far would give, over the same queries:
    (name tokens at positions <= q) / (q + 1), the ``q + 1`` counting the marker and q
    itself. It depends on no head, so it is one number. ``name_ratio`` = name_mass /
    name_baseline: a ratio of the two means, not a mean of per-story ratios.
``prev_token``
    Attention on position q - 1, over queries q >= 1 (query 0 has no previous token).
``prev_argmax``
    Share of queries q >= 1 whose most-attended key is q - 1. ``torch.argmax`` breaks
    ties towards the earliest key, so a tie with an earlier key does not count.
``prev4``
    Attention on positions q-1 .. q-4 together, over queries q >= 1; for q < 4 only
    the positions that exist (down to the marker at 0) are summed.
``marker``
    Attention on end-of-story marker tokens (every position holding the marker id; in
    a story fed alone that is position 0), over queries q >= 1: query 0 *is* the marker
    and can only attend to itself, so it would add a constant 1.
``prev_token_first``, ``prev_argmax_first``, ``prev4_first``
    The same three previous-token scores over only the first ``max_stories_prev``
    stories in the order given (the lesson quotes some figures on the first 100 quiz
    stories); ``None`` when no limit was asked for.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from storylens.core.errors import StorylensError
from storylens.core.frames import to_frame
from storylens.core.heads import Head
from storylens.core.schema import check_grid, check_schema, heads_schema, read_versioned, versioned
from storylens.effects.exact import ExactPlan
from storylens.effects.weights import HeadWeights, head_weights, weight_columns
from storylens.engine.encode import CHUNK_STORIES, EncodedStory
from storylens.engine.gradients import GRAPH_BYTES
from storylens.engine.record import Measure, record
from storylens.lm import AttentionLM, ModelLike, wrap
from storylens.looking.detectors import (
    BUILTIN_DETECTORS,
    CONTEXT_NORM,
    CONTEXT_SHARE,
    FLAG,
    INDUCTION_RANDOM,
    NAME_BASELINE,
    NAME_MASS,
    OLD_FLAG,
    PREV_TOKEN,
    Column,
    Detector,
    columns_named,
    table_columns,
)
from storylens.looking.examples import TopExamples
from storylens.looking.induction import induction_random
from storylens.looking.sinks import dormant
from storylens.table.accumulator import _COUNT_FIELDS, HeadScoreAccumulator
from storylens.viz.explorer import explorer_view
from storylens.viz.grid_html import grid_html
from storylens.viz.tokens import token_text


@dataclass(frozen=True)
class HeadScore:
    """One head's row: the head, every score column (``scores``, in the table's order: built-in
    and user detectors alike, see :func:`storylens.looking.detectors.table_columns`) and the flag.
    A column reads as ``row["name_mass"]`` or ``row.name_mass``; ``block`` and ``head`` count from 1,
    like ``label``."""

    at: Head  # 0-based
    scores: Mapping[str, float | None] = field(hash=False)
    dormant: bool | None = None  # switching it to its mean moves nothing (storylens.looking.sinks); None: not computed

    @property
    def label(self) -> str:
        return self.at.label

    @property
    def block(self) -> int:
        return self.at.layer + 1

    @property
    def head(self) -> int:
        return self.at.head + 1

    def __getitem__(self, name: str) -> float | None:
        return self.scores[name]

    def value(self, name: str) -> float:
        """Column ``name`` where it must have been computed (the lesson's columns on a finished run):
        a ValueError naming the head and column if it was not."""
        v = self.scores[name]
        if v is None:
            raise ValueError(f"{self.label}: {name} was not computed on this run")
        return v

    def __getattr__(self, name: str) -> float | None:
        scores = self.__dict__.get("scores")  # absent while a copy or unpickling is being made
        if scores is None or name not in scores:
            raise AttributeError(f"{type(self).__name__} has no column {name!r}")
        return scores[name]

    def row(self) -> dict[str, object]:
        """label, block, head (1-based), every score column (NaN as None), the flag."""
        cells = {k: _clean(v) for k, v in self.scores.items()}
        return {
            "label": self.label,
            "block": self.block,
            "head": self.head,
            **cells,
            FLAG.name: self.dormant,
        }


def _clean(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


@dataclass(frozen=True)
class HeadScores:
    """Scores of every head (one :class:`HeadScore` per head, block-major) plus counts, and what each
    column is (``columns``: its title, meaning and where it is shown; read from the heads' own columns
    when not given)."""

    heads: tuple[HeadScore, ...]
    n_stories: int  # stories scored
    n_cut: int  # stories cut to the window
    n_main_character: int  # stories with a main character
    n_name_scored: int  # ... of which the window holds at least one name query
    max_stories_prev: int | None  # the limit asked for the *_first columns
    n_prev_first: int | None  # stories behind the *_first columns
    window: int
    examples: TopExamples | None = field(default=None, compare=False, repr=False)  # where each head fires
    columns: tuple[Column, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.columns and self.heads:
            object.__setattr__(self, "columns", columns_named([*self.heads[0].scores, FLAG.name]))

    @property
    def name_baseline(self) -> float | None:
        return self.heads[0][NAME_BASELINE.name]

    @property
    def n_skipped_no_name(self) -> int:
        """Stories left out of the name scores (no main character, or none in the window)."""
        return self.n_stories - self.n_name_scored

    def counts(self) -> dict:
        """The story counts (and the baseline), as a plain dict."""
        return {**{k: vars(self)[k] for k in _COUNT_FIELDS}, NAME_BASELINE.name: _clean(self.name_baseline)}

    def shown(self, where: str) -> tuple[str, ...]:
        """The columns shown ``where`` (``storylens.looking.detectors.OVERVIEW`` .. ``TIMELINE``), in order."""
        return tuple(c.name for c in self.columns if where in c.shown)

    def title(self, name: str, marker: str = "the end-of-story marker") -> str:
        """Column ``name``'s title, ``marker`` naming the model's opening token."""
        for c in self.columns:
            if c.name == name:
                return c.title.format(marker=marker)
        raise KeyError(f"{name!r} is not a column of this table")

    @property
    def n_layer(self) -> int:
        return max(h.block for h in self.heads)

    @property
    def n_head(self) -> int:
        return max(h.head for h in self.heads)

    def to_rows(self) -> list[dict]:
        """One dict per head: label, block, head (1-based), then every column in the table's order."""
        return [h.row() for h in self.heads]

    def column(self, name: str) -> list:
        """One column, block-major (a score column's values are floats or None)."""
        if name == FLAG.name:
            return [h.dormant for h in self.heads]
        if not self.heads or name not in self.heads[0].scores:
            known = ", ".join([*(self.heads[0].scores if self.heads else ()), FLAG.name])
            raise KeyError(f"{name!r} is not a score column (one of {known})")
        return [h[name] for h in self.heads]

    def at(self, head: Head) -> HeadScore:
        """The row of a 0-based :class:`~storylens.core.heads.Head`."""
        return self.heads[head.layer * self.n_head + head.head]

    def grid(self, name: str) -> list[list[float | None]]:
        """``grid[block][head]`` (0-indexed) of one column, for heatmaps."""
        n_head = self.n_head
        col = self.column(name)
        return [col[i : i + n_head] for i in range(0, len(col), n_head)]

    def head(self, label: str) -> HeadScore:
        for h in self.heads:
            if h.label == label.strip().upper():
                return h
        raise KeyError(f"{label!r}: no such head (L1H1 .. {self.heads[-1].label})")

    def top(self, name: str = NAME_MASS.name, k: int = 6, *, largest: bool = True) -> list[HeadScore]:
        """The ``k`` heads with the largest (or smallest) ``name``; ties keep block-major order."""
        col = [v for v in self.column(name) if v is not None]
        if len(col) < len(self.heads):
            raise ValueError(f"{name}: not computed (pass max_stories_prev to score_heads)")
        order = sorted(range(len(col)), key=lambda i: -col[i] if largest else col[i])
        return [self.heads[i] for i in order[:k]]

    def best(self, name: str = NAME_MASS.name, *, largest: bool = True) -> HeadScore:
        return self.top(name, 1, largest=largest)[0]

    def count(self, name: str, *, above: float | None = None, below: float | None = None) -> int:
        """How many heads have ``name`` > ``above`` and/or < ``below``."""
        return sum(
            1
            for v in self.column(name)
            if v is not None and (above is None or v > above) and (below is None or v < below)
        )

    def to_pandas(self):
        """The table as a ``pandas.DataFrame``, one row per head as :meth:`to_rows` (label, block, head,
        every column, the flag), typed as ``pandas.read_csv`` reads :meth:`to_csv`'s file: equal to it
        exactly. Needs pandas (``storylens[pandas]``)."""
        rows = self.to_rows()
        return to_frame(rows, list(rows[0]) if rows else ["label", "block", "head"])

    def grid_html(self, name: str = NAME_MASS.name) -> str:
        """Column ``name`` as a compact HTML block x head grid (shaded by value, escaped, no script and
        nothing fetched: :mod:`storylens.viz.grid_html`), titled and with the run's counts."""
        note = f"{self.n_stories:,} stories; {self.n_layer} blocks x {self.n_head} heads; column {name}"
        return grid_html(self.grid(name), self.title(name), note)

    def explorer(self, tokenizer=None, *, title: str = "storylens explorer", meta: Mapping | None = None):
        """The explorer (explore.html, :mod:`storylens.viz.explorer`) of this table as a notebook view:
        every head with every column, sortable and filtered, a grid of any column and, where the table
        kept examples (``score_heads(..., examples=K)``), each head's top examples with their tokens
        decoded by ``tokenizer`` (the model's, e.g. ``lm.tokenizer``; needed only with examples).
        Shown inline as a cell's last expression; ``.to_html()`` is the standalone page."""
        examples = None
        if self.examples is not None:
            if tokenizer is None:
                raise ValueError("explorer: this table kept examples; pass the model's tokenizer to show their tokens")
            examples = self.examples.as_json(lambda i: token_text(tokenizer, i))
        meanings = {c.name: c.meaning for c in self.columns}
        counts = {"stories": f"{self.n_stories:,}", "heads": f"{self.n_layer} blocks x {self.n_head} heads"}
        return explorer_view(self.to_rows(), examples, title=title, meta={**counts, **(meta or {})}, meanings=meanings)

    def _repr_html_(self) -> str:
        """What Jupyter shows for a scored table: the grid of its first column (``name_mass``)."""
        if not self.heads:
            return "<p>no heads</p>"
        first = next(iter(self.heads[0].scores))
        return self.grid_html(NAME_MASS.name if NAME_MASS.name in self.heads[0].scores else first)

    def to_csv(self, path: str | os.PathLike) -> Path:
        rows = self.to_rows()
        path = Path(path)
        try:
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        except OSError as e:
            raise StorylensError(f"{path}: cannot write ({e.strerror})") from None
        return path

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        about = [{"name": c.name, "title": c.title, "meaning": c.meaning} for c in self.columns]
        doc = versioned({"counts": self.counts(), "columns": about, "heads": self.to_rows()})
        try:
            path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        except OSError as e:
            raise StorylensError(f"{path}: cannot write ({e.strerror})") from None
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> HeadScores:
        """Read back what :meth:`to_json` wrote (NaN scores come back as None)."""
        path = Path(path)
        doc = read_versioned(path, "not a head table storylens wrote", "heads")
        declared = [c["name"] for c in doc["columns"]]
        check_schema(doc, heads_schema([c for c in declared if c != FLAG.name]), str(path))
        rows = doc["heads"]
        n_layer, n_head = max(r["block"] for r in rows), max(r["head"] for r in rows)
        check_grid([(r["label"], r["block"], r["head"]) for r in rows], n_layer, n_head, str(path), base=1)
        try:
            heads = tuple(_read_row(row) for row in rows)
            c = doc["counts"]
            return cls(heads=heads, **{k: c[k] for k in _COUNT_FIELDS})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StorylensError(f"{path}: not a head-scores JSON file ({type(e).__name__}: {e})") from None


def _read_row(row: dict) -> HeadScore:
    """A :meth:`HeadScore.row` read back."""
    at = Head(int(row["block"]) - 1, int(row["head"]) - 1)
    if Head.parse(row["label"]) != at:
        raise ValueError(f"head {row['label']!r} is not block {row['block']}, head {row['head']}")
    if OLD_FLAG in row:
        raise ValueError(
            f"written by an older storylens (its flag is {OLD_FLAG}, now {FLAG.name}): score the model again"
        )
    scores = {k: v for k, v in row.items() if k not in ("label", "block", "head", FLAG.name)}
    flag = row.get(FLAG.name)
    if flag is not None and not isinstance(flag, bool):
        raise ValueError(f"{row['label']}: {FLAG.name} is {flag!r}, not true, false or null")
    return HeadScore(at, scores, flag)


def build_table(
    acc: HeadScoreAccumulator,
    with_first: bool,
    induction: torch.Tensor | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> tuple[HeadScore, ...]:
    """One :class:`HeadScore` per head, block-major: every column of ``acc``'s detectors
    (:func:`~storylens.looking.detectors.table_columns`; None where not computed), ``induction``
    (``[layer, head]``, :func:`~storylens.looking.induction.induction_random`) and the flag."""
    cols = acc.columns(with_first)
    cols[INDUCTION_RANDOM.name] = induction
    cols.update(extra or {})  # columns measured after the pass (backup_gain)
    names = [c.name for c in table_columns(acc.detectors) if c != FLAG]
    flags = head_flags(cols)
    rows = []
    for head in Head.every(acc.n_layer, acc.n_head):
        scores = {
            k: (None if (v := cols.get(k)) is None else _clean(float(v[head]))) for k in names
        }  # NaN: none counted
        rows.append(HeadScore(head, scores, None if flags is None else bool(flags[head])))
    return tuple(rows)


def head_flags(cols: Mapping[str, torch.Tensor | None]) -> torch.Tensor | None:
    """``[layer, head]``: the :func:`~storylens.looking.sinks.dormant` flag from a run's columns, with the
    mean-ablation effect where it was measured (--exact) or estimated (the causal columns; None: no context norms)."""
    norm = cols.get(CONTEXT_NORM.name)
    if norm is None:
        return None
    mean, se = cols.get("exact_mean"), cols.get("exact_mean_se")  # measured where it ran, else AtP's estimate
    if mean is None or se is None:
        mean, se = cols.get("atp_mean"), cols.get("atp_mean_se")
    return dormant(norm, None if mean is None or se is None else (mean, se), cols.get(CONTEXT_SHARE.name))


def readable_weights(lm: AttentionLM) -> HeadWeights | None:
    """``lm``'s :class:`~storylens.effects.weights.HeadWeights`; None where its weights cannot be read as heads
    (a structure storylens does not know, or no readout: the weight columns stay empty)."""
    try:
        return head_weights(lm)
    except (StorylensError, ValueError):
        return None


def score_table(
    acc: HeadScoreAccumulator,
    stats,
    max_stories_prev: int | None,
    window: int,
    lm: AttentionLM | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
    weights: HeadWeights | None = None,
) -> HeadScores:
    """The :class:`HeadScores` of a finished accumulator and the run's counts; with ``lm``, the induction
    test on random tokens measured on it (the model's alone: the same however the stories were scored) and the
    weight columns (``weights``: its weights already read)."""
    with_first = max_stories_prev is not None
    first = acc.first.get(PREV_TOKEN.name)
    mass = acc.means.get(NAME_MASS.name)
    read = weights if weights is not None or lm is None else readable_weights(lm)
    cols = {} if read is None else {k: v for k, v in weight_columns(read).items() if v is not None}
    return HeadScores(
        heads=build_table(acc, with_first, None if lm is None else induction_random(lm), {**cols, **(extra or {})}),
        n_stories=stats.n_stories,
        n_cut=stats.n_cut,
        n_main_character=stats.n_main_character,
        n_name_scored=mass.count if mass is not None else 0,
        max_stories_prev=max_stories_prev,
        n_prev_first=first.count if with_first and first is not None else None,
        window=window,
        examples=acc.examples,
        columns=table_columns(acc.detectors),
    )


def score_heads(
    model: ModelLike,
    stories: Sequence[str] | Sequence[EncodedStory],
    *,
    batch_size: int = 16,
    max_stories_prev: int | None = None,
    names: frozenset[str] | set[str] | None = None,
    detectors: Sequence[Detector] = BUILTIN_DETECTORS,
    measures: Sequence[Measure] = (),
    progress: bool = True,
    chunk_stories: int = CHUNK_STORIES,
    tokenizer=None,
    examples: int = 0,
    faithful: bool = True,
    causal: bool = False,
    graph_bytes: int = GRAPH_BYTES,
    exact: ExactPlan | None = None,
) -> HeadScores:
    """Score every head of ``model`` over ``stories`` (e.g. the 200 quiz stories) with every detector.

    ``model``: storylens's GPT, a transformers causal LM (pass ``tokenizer``), or an
    :class:`~storylens.lm.AttentionLM`. ``names`` defaults to the name vocabulary of ``stories``
    themselves (the whole set scored, as the lesson defines it): a first pass over the texts.
    ``max_stories_prev`` adds the ``*_first`` previous-token columns over the first that many
    stories, in the same single pass. ``examples``: also keep, per head and detector, that many
    queries where it fires most (:class:`~storylens.looking.examples.TopExamples`, in
    :attr:`HeadScores.examples`). ``measures``: more accumulators fed by the same recording
    (see :mod:`storylens.engine.record`); ``faithful=False`` leaves out the norm-weighted columns and
    output norms (:mod:`storylens.looking.faithful`); ``causal=True`` adds every head's AtP and DLA
    (:mod:`storylens.effects.attribution`: one fused forward and backward per batch more, holding at most
    ``graph_bytes`` of kept graphs: :func:`~storylens.engine.gradients.gradient_pass`); ``exact`` adds every
    head's exact effect (:mod:`storylens.effects.exact`: each batch rerun with each head switched off per the
    plan). Stories are encoded ``chunk_stories`` at a time, each
    chunk's stories go through the model longest first, ``batch_size`` at a time, padded at the
    end (causal attention: padding never changes an earlier position), and each block's map is
    scored as soon as it exists: memory does not grow with the number of stories.
    """

    if max_stories_prev is not None and max_stories_prev < 1:
        raise StorylensError(f"max_stories_prev: must be at least 1, got {max_stories_prev}")
    lm = wrap(model, tokenizer)
    acc = HeadScoreAccumulator(
        lm.n_layer, lm.n_head, detectors, examples=examples, faithful=faithful, causal=causal, graph_bytes=graph_bytes,
        exact=exact,
    )  # fmt: skip
    stats = record(
        lm,
        stories,
        [acc, *measures],
        batch_size=batch_size,
        names=names,
        progress=progress,
        first_limit=max_stories_prev,
        chunk_stories=chunk_stories,
    )
    return score_table(acc, stats, max_stories_prev, lm.window, lm)
