"""Head detectors: what each looks for in one block's attention ``[batch, head, query, key]`` (their
arithmetic: :mod:`storylens.looking.patterns` and :mod:`storylens.looking.reads`), and the head table's
columns they own.

A detector gives, for every query, a number ``[batch, head, query]`` (how much of the query's
attention goes where the detector looks), and says which queries count ``[batch, query]``. A
head's score is then the **mean over stories of the per-story mean over the counted queries**
(every story counts once; a story with no counted query is left out), streamed by
:class:`storylens.table.accumulator.HeadScoreAccumulator`. Positions count the opening marker as 0.

The lesson's detectors (definitions in :mod:`storylens.table.scores`):
``name_mass``, ``prev_token``, ``prev_argmax``, ``prev4``, ``marker``.

TransformerLens's two token patterns (its ``head_detector``), as masses:

``duplicate_token``
    Attention on earlier positions holding the same token as the query (``k < q``,
    ``ids[k] == ids[q]``), over the queries that have such a position.
``induction``
    Attention on the positions just after an earlier occurrence of the query's token
    (``k <= q``, ``k >= 1``, ``ids[k - 1] == ids[q]``, ``k - 1 < q``), over the queries that
    have one. (TransformerLens averages its "mul" score over every position, queries with no
    such key adding 0; storylens averages over the queries the pattern applies to.)

``first_mass``
    Attention on position 0, the token that opens every sequence (where attention sinks rest),
    over queries q >= 1.

A user pattern (:func:`pattern_detector`) is any function of the token ids ``[batch, tokens]``
giving key weights ``[batch, query, key]``; its score is the attention-weighted sum of those
weights over the queries whose row is not all zero.

The detectors own the head table's columns: each :class:`Detector` carries its column's title,
meaning and where it is shown, and declares the columns derived from it; :func:`table_columns`
lays the table out from the list of detectors (built-in and user ones alike), and every reader
(the table's files, the report, the faithfulness table, the training timeline) reads it from there.
Adding a built-in detector is its definition here, appended to :data:`BUILTIN_DETECTORS`, and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from storylens.engine.masks import Masks, norms_for_keys
from storylens.looking.patterns import (
    keys_mass,
    masked_mean,
    pairs_mass,
    prev_is_argmax,
    prev_span,
    prev_token,
    scaled_diagonal,
    scaled_prev_is_argmax,
    scaled_prev_span,
)
from storylens.looking.reads import Reads
from storylens.looking.sinks import ACTIVE_SHARE, DORMANT_FLOOR, DORMANT_NATS, DORMANT_SHARE, SINK_THRESHOLD

NORM_PREFIX = "norm_"  # norm_<column>: the same detector on the norm-weighted map (storylens.looking.faithful)


FIRST_SUFFIX = "_first"  # <detector>_first: the same detector over only the first stories (the lesson's)


# where a column is shown (Column.shown): the report's overview grids (raw, then norm-weighted), the
# lesson's own sections of the report (which name their columns), the report's "More detectors",
# the faithfulness table (its strongest heads switched off), the training timeline's figures
OVERVIEW, LESSON, MORE, TRUTH, TIMELINE = "overview", "lesson", "more", "truth", "timeline"


SINKS = "sinks"  # the report's grids of sinks and dormant heads (storylens.looking.sinks)


SHOWN_BEYOND_LESSON = frozenset((OVERVIEW, MORE, TRUTH))  # a detector beyond the lesson's, a user's among them


@dataclass(frozen=True)
class Column:
    """One column of the head table (:class:`storylens.table.scores.HeadScores`): its name, its title
    (a table's or heatmap's heading; ``{marker}`` stands for what the model's opening token is called),
    what it means in one line, where it is shown (``OVERVIEW`` .. ``TIMELINE``), and whether it has a
    norm-weighted twin ``norm_<name>``."""

    name: str
    title: str
    meaning: str
    shown: frozenset[str] = frozenset()
    norm: bool = False

    @property
    def twin(self) -> Column:
        """The norm-weighted twin: the same score on the norm-weighted map, in the overview where this one is."""
        meaning = f"{self.name} on the norm-weighted map (what the head moves, not only where it looks)"
        return Column(NORM_PREFIX + self.name, "Norm-weighted: " + self.title.lower(), meaning, self.shown & {OVERVIEW})


@dataclass(frozen=True)
class Detector:
    """A named detector: ``values(pattern, masks) -> [B, H, q]`` and ``queries(masks) -> [B, q]``,
    and what its column of the head table needs: a title, a one-line meaning, where it is shown
    (:class:`Column`), the columns derived from it, and whether the ``*_first`` twin is kept. Every
    detector has its norm-weighted twin ``norm_<name>`` (when the norm-weighted map is scored)."""

    name: str
    values: Callable[[torch.Tensor, Masks], torch.Tensor]
    queries: Callable[[Masks], torch.Tensor]
    first_columns: bool = False  # also scored over the first N stories (the lesson's *_first)
    # reads a chunk of query rows right (masks cut to them, its first row masks.start) and is linear
    # in each row (or, scale_free, unchanged when a row is scaled): every built-in and pattern
    # detector. A detector made by hand without it gets whole maps and the norm-weighted map itself.
    rows: bool = False
    scale_free: bool = False
    # values(pattern * norms[key], masks) without forming that map, bit for bit: ``scaled(pattern,
    # norms [B, H, keys], masks)`` (the norm-weighted columns then cost a few reads of the map, not a
    # pass; None: the scaled map is formed for it)
    scaled: Callable[[torch.Tensor, torch.Tensor, Masks], torch.Tensor] | None = None
    # values (and scaled) from the block's shared reads (:class:`Reads`), bit for bit: the built-in
    # detectors read a few entries of each row, gathered once for all of them (None: values, scaled)
    read: Callable[[Reads], torch.Tensor] | None = None
    title: str = ""  # "" : "Detector <name>"
    meaning: str = ""
    shown: frozenset[str] = SHOWN_BEYOND_LESSON
    derived: tuple[Column, ...] = ()  # columns computed from this one's (following it in the table)
    kind: str = ""  # the kind of head it finds, as the training timeline's formation table says ("" : none)

    def story_means(self, pattern: torch.Tensor, masks: Masks) -> torch.Tensor:
        return masked_mean(self.values(pattern, masks), self.queries(masks))

    @property
    def column(self) -> Column:
        """Its own column (with a norm-weighted twin)."""
        title = self.title or f"Detector {self.name}"
        return Column(self.name, title, self.meaning or title, self.shown, norm=True)

    @property
    def first_column(self) -> Column:
        """``<name>_first``: the same over the first stories only (``max_stories_prev``)."""
        return Column(self.name + FIRST_SUFFIX, f"{self.column.title} (first stories)", self.column.meaning)


def _duplicate_queries(m: Masks) -> torch.Tensor:
    return m.sparse_keys("duplicate_keys")[1][:, 0].any(-1)  # a query with an earlier duplicate


def _induction_queries(m: Masks) -> torch.Tensor:
    return m.sparse_keys("induction_keys")[1][:, 0].any(-1)


NAME_BASELINE = Column(
    "name_baseline",
    "Even-spread baseline of name mass",
    "name tokens at or before q over q + 1, over the name queries: what an even spread would give (one number)",
)


NAME_RATIO = Column(
    "name_ratio",
    "Name mass / even-spread baseline",
    "name_mass / name_baseline: a ratio of the two means",
    frozenset((OVERVIEW, LESSON)),
    norm=True,
)


NAME_MASS = Detector(
    "name_mass",
    lambda p, m: m.column_mass(p)[..., 0],
    lambda m: m.name_queries,
    rows=True,
    scaled=lambda p, w, m: m.scaled_column_mass(p, w)[..., 0],
    read=lambda r: r.column_mass()[..., 0],
    title="Name mass (share of attention on the main character's name)",
    meaning="attention on the main character's name tokens, over the queries after its first mention",
    shown=frozenset((OVERVIEW, LESSON, TRUTH, TIMELINE)),
    derived=(NAME_BASELINE, NAME_RATIO),
    kind="name",
)


MARKER = Detector(
    "marker",
    lambda p, m: m.column_mass(p)[..., 1],
    lambda m: m.queries,
    rows=True,
    scaled=lambda p, w, m: m.scaled_column_mass(p, w)[..., 1],
    read=lambda r: r.column_mass()[..., 1],
    title="Attention on {marker}",
    meaning="attention on the end-of-story marker tokens, over queries q >= 1",
    shown=frozenset((OVERVIEW, LESSON, TRUTH, TIMELINE)),
)


PREV_TOKEN = Detector(
    "prev_token",
    lambda p, m: prev_token(p, m.start),
    lambda m: m.queries,
    first_columns=True,
    rows=True,
    scaled=lambda p, w, m: scaled_diagonal(p, w, 1, m.start),
    read=lambda r: r.diagonal(1),
    title="Attention on the previous token",
    meaning="attention on position q - 1, over queries q >= 1",
    shown=frozenset((OVERVIEW, LESSON, TRUTH, TIMELINE)),
    kind="previous-token",
)


PREV_ARGMAX = Detector(
    "prev_argmax",
    lambda p, m: prev_is_argmax(p, m.start, m.earlier_max(p)),
    lambda m: m.queries,
    first_columns=True,
    rows=True,
    scaled=lambda p, w, m: scaled_prev_is_argmax(p, w, m.start, m.earlier_max(p)),
    read=lambda r: r.prev_is_argmax(),
    scale_free=True,
    title="Share of queries whose top key is the previous token",
    meaning="share of queries q >= 1 whose most-attended key is q - 1 (ties to the earliest key)",
    shown=frozenset((OVERVIEW, LESSON, TRUTH)),
)


PREV4 = Detector(
    "prev4",
    lambda p, m: prev_span(p, start=m.start),
    lambda m: m.queries,
    first_columns=True,
    rows=True,
    scaled=lambda p, w, m: scaled_prev_span(p, w, start=m.start),
    read=lambda r: r.prev_span(),
    title="Attention on the last four tokens",
    meaning="attention on positions q - 1 .. q - 4 together, over queries q >= 1",
    shown=frozenset((OVERVIEW, LESSON, TRUTH)),
)


DUPLICATE_TOKEN = Detector(
    "duplicate_token",
    lambda p, m: pairs_mass(p, *m.key_pairs("duplicate_keys"), m.start),
    _duplicate_queries,
    rows=True,
    scaled=lambda p, w, m: pairs_mass(p, *m.key_pairs("duplicate_keys"), m.start, w),
    read=lambda r: r.pairs("duplicate_keys"),
    title="Attention on earlier copies of the query's token (duplicate-token)",
    meaning="attention on earlier positions holding the query's token, over the queries that have one",
    shown=frozenset((OVERVIEW, MORE, TRUTH, TIMELINE)),
)


INDUCTION = Detector(
    "induction",
    lambda p, m: pairs_mass(p, *m.key_pairs("induction_keys"), m.start),
    _induction_queries,
    rows=True,
    scaled=lambda p, w, m: pairs_mass(p, *m.key_pairs("induction_keys"), m.start, w),
    read=lambda r: r.pairs("induction_keys"),
    title="Attention on the token after an earlier copy of the query's token (induction)",
    meaning="attention on the positions just after an earlier copy of the query's token, over the queries that have one",
    shown=frozenset((OVERVIEW, MORE, TRUTH, TIMELINE)),
    kind="induction",
)


FIRST_MASS = Detector(
    "first_mass",
    lambda p, m: p[..., 0].clone(),  # a copy: the map's memory is reused once its block is scored
    lambda m: m.queries,
    rows=True,
    scaled=lambda p, w, m: p[..., 0] * norms_for_keys(p, w)[..., 0, None],
    read=lambda r: r.first(),
    title="Attention on position 0 (the opening token)",
    meaning="attention on position 0, the token that opens every sequence, over queries q >= 1",
    shown=frozenset((OVERVIEW, MORE, SINKS)),
)


LESSON_DETECTORS = (NAME_MASS, PREV_TOKEN, PREV_ARGMAX, PREV4, MARKER)


BUILTIN_DETECTORS = LESSON_DETECTORS + (DUPLICATE_TOKEN, INDUCTION, FIRST_MASS)


# the induction test on repeated random tokens (storylens.looking.induction): a column of the model alone,
# measured once per run (one forward pass of INDUCTION_SEQUENCES x (1 + 2 x INDUCTION_LENGTH) tokens), not a detector
INDUCTION_SEQUENCES, INDUCTION_LENGTH, INDUCTION_SEED = 4, 50, 0


INDUCTION_RANDOM = Column(
    "induction_random",
    "Induction on repeated random tokens",
    f"attention from each token of a random sequence's second copy on the token after that token in the first copy "
    f"(TransformerLens's induction score): {INDUCTION_SEQUENCES} sequences of {INDUCTION_LENGTH} random ordinary "
    f"tokens (seed {INDUCTION_SEED}), twice, after the opening token; the model's alone, not the stories'",
    frozenset((OVERVIEW, MORE)),
)


# what a head's weights say (storylens.effects.weights): columns of the model alone, no forward pass
OV_COPYING = Column(
    "ov_copying",
    "OV copying score: raises (1) or lowers (-1) the logit of the token it reads",
    "Re(sum l) / sum |l| over the eigenvalues l of the full OV circuit W_E W_V W_O W_U, the norms folded in "
    "(Elhage et al. 2021, TransformerLens's copying score): 1 a head that copies, -1 one that suppresses; from "
    "the weights",
    frozenset((OVERVIEW,)),
)


QK_SAME_TOKEN = Column(
    "qk_same_token",
    "QK same-token preference: a token's score on its own kind, in standard deviations",
    "the full QK circuit W_E W_Q (W_E W_K)^T over tokens alone: its diagonal's mean less every entry's mean, in "
    "standard deviations of the entries; from the weights",
    frozenset((OVERVIEW,)),
)


QK_PREVIOUS = Column(
    "qk_previous",
    "QK positional preference: the previous position from positions alone",
    "the share of queries whose highest score in the positional QK circuit W_pos W_Q (W_pos W_K)^T is on the "
    "previous position (models with learned positions; empty for rotary ones); from the weights",
    frozenset((OVERVIEW,)),
)


WEIGHT_COLUMNS = (OV_COPYING, QK_SAME_TOKEN, QK_PREVIOUS)


# what each head writes (storylens.looking.faithful), and the flag drawn from it: not detectors
OUTPUT_NORM = Column("output_norm", "Output norm", "the mean size of what the head writes, over queries q >= 1")


OUTPUT_SHARE = Column(
    "output_share",
    "Output share: the head's part of its block's head-output sizes",
    "output_norm over the sum of its block's heads' output norms",
    frozenset((OVERVIEW,)),
)


SINK_RATE = Column(
    "sink_rate",
    f"Sink rate: the share of stories with attention on position 0 above {SINK_THRESHOLD}",
    f"the share of stories whose first_mass exceeds {SINK_THRESHOLD} (Gu et al. 2024's Sink^{SINK_THRESHOLD})",
    frozenset((SINKS,)),
)


FIRST_VALUE_RATIO = Column(
    "first_value_ratio",
    "First value ratio: |f_0| over the mean |f_j| of the other keys",
    "the opening token's value vector through the head's output slice, over the mean of the story's other keys' "
    "(Guo et al. 2024's value-state drain), mean over stories",
    frozenset((SINKS,)),
)


CONTEXT_SHARE = Column(
    "context_share",
    "Context share: the part of what the head writes that depends on the story",
    "E|o_i - mean(o)|^2 / E|o_i|^2 over every query q >= 1, o_i the head's output through its slice of the "
    "output projection and mean(o) its corpus mean: what mean ablation removes, as a share of the output",
    frozenset((OVERVIEW, SINKS)),
)


CONTEXT_NORM = Column(
    "context_norm",
    "Context norm: the size of the story-dependent output",
    "sqrt(E|o_i - mean(o)|^2) over every query q >= 1",
    frozenset((SINKS,)),
)


ACTIVE_RATE = Column(
    "active_rate",
    f"Active rate: the share of stories where the head's own context share exceeds {ACTIVE_SHARE}",
    f"the share of stories in which the head's context share, about the story's own mean, exceeds {ACTIVE_SHARE}",
    frozenset((SINKS,)),
)


# what each head does to the loss (storylens.effects.attribution, `--causal`): None where not computed
ATP_MEAN = Column(
    "atp_mean",
    "AtP, mean ablation: the change in mean next-token loss, in nats",
    "attribution patching: the first-order change in the corpus's mean next-token loss (nats, pooled over "
    "predicted tokens) when the head's output is replaced by its corpus mean at every position after the opening token",
    frozenset((OVERVIEW,)),
)


ATP_MEAN_SE = Column("atp_mean_se", "AtP, mean ablation: standard error", "atp_mean's standard error over stories")


ATP_ZERO = Column(
    "atp_zero",
    "AtP, zero ablation: the change in mean next-token loss, in nats",
    "attribution patching: as atp_mean, the head's output replaced by zero",
    frozenset((OVERVIEW,)),
)


ATP_ZERO_SE = Column("atp_zero_se", "AtP, zero ablation: standard error", "atp_zero's standard error over stories")


DLA = Column(
    "dla",
    "Direct logit attribution: the head's direct push on the next token's logit",
    "the head's output through the final norm (scale frozen) on the next token's unembedding minus the "
    "vocabulary's mean, mean over predicted tokens (TransformerLens's logit_attrs); negative: it pushes the "
    "right token down",
    frozenset((OVERVIEW,)),
)


DLA_SE = Column("dla_se", "Direct logit attribution: standard error", "dla's standard error over stories")


CAUSAL_COLUMNS = (ATP_MEAN, ATP_MEAN_SE, ATP_ZERO, ATP_ZERO_SE, DLA, DLA_SE)


def _exact_columns() -> tuple[Column, ...]:
    """What each head does to the loss, measured (storylens.effects.exact, ``--exact``): None where not run."""
    replaced = {
        "mean": "its corpus mean (over the first stories, summary.json's exact.mean_stories)",
        "zero": "zero",
        "resample": "its output on another story of the corpus drawn at random (summary.json's exact.seed)",
    }
    out: list[Column] = []
    for mode, by in replaced.items():
        out.append(
            Column(
                f"exact_{mode}",
                f"Exact {mode} ablation: the change in mean next-token loss, in nats",
                "measured: the change in the corpus's mean next-token loss (nats, pooled over predicted tokens) "
                f"when the head's output is replaced at every position after the opening token by {by}",
                frozenset((OVERVIEW,)),
            )
        )
        out.append(
            Column(
                f"exact_{mode}_se",
                f"Exact {mode} ablation: standard error",
                f"exact_{mode}'s standard error over stories",
            )
        )
    return tuple(out)


EXACT_COLUMNS = _exact_columns()


BACKUP_GAIN = Column(
    "backup_gain",
    "Backup gain: its exact effect with the strongest heads off, less its effect alone",
    "measured (storylens.effects.backups, --backups K): the head's exact effect on the mean next-token loss once "
    "the K heads of largest exact effect are off, minus its exact effect with them on; positive: it stands in "
    "for them (summary.json's backups names them)",
    frozenset((OVERVIEW,)),
)


BACKUP_GAIN_SE = Column("backup_gain_se", "Backup gain: standard error", "backup_gain's standard error over stories")


OLD_FLAG = "looks_without_moving"  # the flag before dormant (storylens 0.x runs): refused when read back


SINK_COLUMNS = (SINK_RATE, FIRST_VALUE_RATIO, CONTEXT_SHARE, CONTEXT_NORM, ACTIVE_RATE)


FLAG = Column(
    "dormant",
    "Dormant: switching the head to its mean moves nothing",
    f"its story-dependent output is under {DORMANT_SHARE} of an even share of its block's (context_norm^2 against "
    f"the block's mean), or at most {DORMANT_FLOOR:g} of what it writes (context_share: a constant or nothing, "
    f"whatever its block does), and, where the mean-ablation effect was measured (exact_mean) or else estimated (atp_mean), "
    f"|effect| + 2 se is under {DORMANT_NATS} nats",
)


def score_columns(detectors: Sequence[Detector]) -> tuple[Column, ...]:
    """The raw score columns of ``detectors``, in the table's order: each detector's own, then
    those derived from it; the ``*_first`` twins follow the last detector that keeps them."""
    firsts = [d for d in detectors if d.first_columns]
    out: list[Column] = []
    for d in detectors:
        out += [d.column, *d.derived]
        if firsts and d is firsts[-1]:
            out += [f.first_column for f in firsts]
    return tuple(out)


def table_columns(detectors: Sequence[Detector]) -> tuple[Column, ...]:
    """Every column of the head table for ``detectors`` (after label, block, head), in order: the raw
    scores (:func:`score_columns`), their norm-weighted twins, the induction test on random tokens
    (:mod:`storylens.looking.induction`), what its weights say (:mod:`storylens.effects.weights`), what each
    head writes, the sink and
    context columns (:mod:`storylens.looking.sinks`), the causal columns (:mod:`storylens.effects.attribution`),
    the exact columns (:mod:`storylens.effects.exact`), the flag."""
    raw = score_columns(detectors)
    twins = (c.twin for c in raw if c.norm)
    return (
        *raw, *twins, INDUCTION_RANDOM, *WEIGHT_COLUMNS, OUTPUT_NORM, OUTPUT_SHARE, *SINK_COLUMNS, *CAUSAL_COLUMNS, *EXACT_COLUMNS,
        BACKUP_GAIN, BACKUP_GAIN_SE, FLAG,
    )  # fmt: skip


BUILTIN_COLUMNS = table_columns(BUILTIN_DETECTORS)


SCORE_COLUMNS = tuple(c.name for c in score_columns(BUILTIN_DETECTORS))  # the built-in raw score columns


# a user detector may not take a column's name, nor one a head's row answers to itself
RESERVED_COLUMNS = frozenset(
    ("label", "block", "head", "layer", "at", "scores", "row", "value", *(c.name for c in BUILTIN_COLUMNS))
)


def columns_named(names: Sequence[str]) -> tuple[Column, ...]:
    """The columns called ``names`` (a head table read back from a file): a built-in's as declared,
    any other name a user detector's (with its norm-weighted twin where ``norm_<name>`` is there too)."""
    known = {c.name: c for c in BUILTIN_COLUMNS}
    user = {n: pattern_column(n) for n in names if n not in known and not n.startswith(NORM_PREFIX)}
    for n in names:
        if n not in known and n.startswith(NORM_PREFIX) and n[len(NORM_PREFIX) :] in user:
            known[n] = user[n[len(NORM_PREFIX) :]].twin
    known.update(user)
    return tuple(known.get(n) or Column(n, n, n) for n in names)


def pattern_column(name: str) -> Column:
    """A user pattern's column (:func:`pattern_detector`)."""
    return Column(
        name, f"Detector {name} (a pattern of key weights)", f"the user pattern {name}", SHOWN_BEYOND_LESSON, True
    )


def pattern_detector(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Detector:
    """A detector from a user pattern: ``fn(ids [B, T]) -> key weights [B, q, k]`` (see the module
    docstring). The weights are kept causal and inside each story."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"detector name {name!r}: use letters, digits and _ (it becomes a column)")
    if name in RESERVED_COLUMNS:
        raise ValueError(f"detector name {name!r} is already a column of the head table; choose another NAME")
    if name.startswith(NORM_PREFIX):
        raise ValueError(
            f"detector name {name!r} starts with {NORM_PREFIX!r}, kept for the norm-weighted columns; choose another NAME"
        )
    cache_key = f"pattern:{name}"

    def keys(m: Masks) -> torch.Tensor:
        return m.cut(m.cached(cache_key, lambda: m.full.pattern_keys(fn, name)))

    column = pattern_column(name)
    return Detector(
        name,
        lambda p, m: keys_mass(p, keys(m)),
        lambda m: (keys(m) != 0).any(-1),
        rows=True,
        title=column.title,
        meaning=column.meaning,
    )
