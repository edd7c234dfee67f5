"""The report's summary, typed: what ``storylens report`` writes as ``summary.json``.

:class:`ReportSummary` holds every figure the report states, in dataclasses that the report's
page, ``storylens report``'s printout and the README's tables read by attribute.
:meth:`ReportSummary.to_dict` is ``summary.json`` exactly (its keys in their order, its values);
:meth:`ReportSummary.from_dict` and :func:`load` read one back.
"""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T", bound="Plain")


def _plain(value: Any) -> Any:
    """A value as JSON holds it: dataclasses as dicts, lists as lists."""
    if isinstance(value, Plain):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _build(tp: Any, value: Any) -> Any:
    """``value`` (read from JSON) as the type ``tp``: dataclasses from dicts, lists of them, optionals."""
    if value is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _build(next(a for a in args if a is not type(None)), value)
    if origin is list:
        return [_build(args[0], v) for v in value]
    if origin is dict:
        return dict(value)
    if isinstance(tp, type) and issubclass(tp, Plain):
        return tp.from_dict(value)
    return value


class Plain:
    """A dataclass that is a JSON object: its fields, in order, as keys."""

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[T], d: dict) -> T:
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _build(hints[f.name], d[f.name]) for f in fields(cls) if f.name in d})  # type: ignore[arg-type]


@dataclass
class ModelInfo(Plain):
    name: str  # what the model was loaded as (a folder or a hub id)
    parameters: int
    blocks: int
    heads: int
    window: int
    display_name: str  # the name for people: a folder's own name, never its path
    lesson_comparison: bool  # the lesson's figures are shown beside this model's (storylens's own models)

    @property
    def n_heads(self) -> int:
        return self.blocks * self.heads


@dataclass
class QuizInfo(Plain):
    source: str
    stories: int
    cut_to_window: int
    with_main_character: int
    name_scored: int
    skipped: int
    shipped_with_storylens: bool
    train_stories: int | None


@dataclass
class LeakageStats(Plain):
    """:meth:`storylens.data.leakage.LeakageReport.summary`, typed."""

    n_quiz: int
    n_train: int
    n_duplicates: int
    word: str
    n_mentioning: int
    run_words: int
    run_share_mean: float
    run_share_max: float
    run_share_argmax: int | None
    n_too_short: int


@dataclass
class Leakage(Plain):
    """The leakage check: ``computed`` (with ``recomputed`` and the figures) or not, and why (``source``).
    In JSON the figures sit beside ``computed`` and ``source``, not under a key of their own."""

    computed: bool
    source: str
    recomputed: bool | None = None  # against the training stories here (True) or the check stored with the model
    stats: LeakageStats | None = None

    def to_dict(self) -> dict:
        if self.stats is None:
            return {"computed": self.computed, "source": self.source}
        return {"computed": self.computed, "recomputed": self.recomputed, "source": self.source, **self.stats.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Leakage:
        stats = {k: v for k, v in d.items() if k not in ("computed", "recomputed", "source")}
        return cls(d["computed"], d["source"], d.get("recomputed"), LeakageStats.from_dict(stats) if stats else None)


@dataclass
class HeadMass(Plain):
    head: str
    name_mass: float
    ratio: float


@dataclass
class NameHeads(Plain):
    baseline: float  # the even-spread baseline
    top: list[HeadMass]  # the top heads by name mass, best first
    below_baseline: int


@dataclass
class PrevHighest(Plain):
    head: str
    prev_token: float


@dataclass
class PrevFirst(Plain):
    head: str
    prev_token: float
    prev4: float
    stories: int


@dataclass
class ArgmaxFirst(Plain):
    head: str
    share: float
    stories: int


@dataclass
class ArgmaxAll(Plain):
    head: str
    share: float


@dataclass
class PreviousToken(Plain):
    above_half: int
    highest: PrevHighest
    highest_first: PrevFirst  # over the first ``stories`` stories
    best_argmax_first: ArgmaxFirst
    best_argmax_all: ArgmaxAll


@dataclass
class MarkerHighest(Plain):
    head: str
    marker: float


@dataclass
class Marker(Plain):
    highest: MarkerHighest
    above_half: int
    called: str  # "the end-of-story marker", or a transformers model's opening token

    @property
    def called_cap(self) -> str:
        return self.called[0].upper() + self.called[1:]


@dataclass
class StoryShown(Plain):
    quiz_index: int  # counting from 1
    main_character: str
    tokens: int  # the tokens shown (a long story is cut to the figures' budget)


@dataclass
class NumberToReproduce(Plain):
    head: str
    name_mass: float
    baseline: float
    ratio: float
    stories: int
    of: int


@dataclass
class NumericRow(Plain):
    """One numerical check (:meth:`storylens.lesson.checks.Check.to_dict`)."""

    name: str
    dtype: str
    measured: float
    bound: float
    lesson: float | None
    detail: str
    passed: bool
    lesson_note: str = ""  # why the bound is larger or smaller than the lesson's figure (checks.lesson_note)


@dataclass
class AblationRow(Plain):
    head: str
    name_mass: float
    zero_name_increase: float
    zero_other_increase: float
    mean_name_increase: float | None
    mean_other_increase: float | None


@dataclass
class AblationGroup(Plain):
    heads: str
    mode: str
    name_increase: float
    other_increase: float


@dataclass
class Ablation(Plain):
    stories: int
    name_positions: int
    other_positions: int
    baseline_name_loss: float
    baseline_other_loss: float
    rows: list[AblationRow]  # by name-loss increase, largest first
    groups: list[AblationGroup]
    top_name_mass_head: str
    top_name_loss_head: str
    same_head: bool
    rank_of_top_name_mass_head_by_name_loss: int


@dataclass
class PositionRow(Plain):
    head: str
    name_mass: float
    control: float
    excess: float


@dataclass
class PositionControl(Plain):
    unmatched_share: float
    ranking_by_excess: list[PositionRow]
    top_name_heads_still_top6: list[str]


@dataclass
class PronounRow(Plain):
    head: str
    pronoun_mass: float
    other_mass: float


@dataclass
class Pronouns(Plain):
    stories: int
    queries: int
    ranking: list[PronounRow]
    overlap_with_name_mass_top6: list[str]


@dataclass
class Divergence(Plain):
    prompt: str
    head: str
    first_difference: int | None
    baseline: str
    ablated: str


@dataclass
class BeyondSummary(Plain):
    """``--beyond``: :func:`storylens.lesson.beyond.beyond_summary`, typed."""

    ablation: Ablation
    position_control: PositionControl
    pronouns: Pronouns
    divergence: Divergence


@dataclass
class TruthRow(Plain):
    detector: str
    head: str
    raw: float
    norm: float | None
    share: float | None
    zero_increase: float | None
    mean_increase: float | None
    where: str
    flagged: bool


@dataclass
class Agreement(Plain):
    detector: str
    rho: float | None
    moves: list  # [head, raw rank, norm-weighted rank]


@dataclass
class Faithfulness(Plain):
    """Where heads look, what they move, what they matter for: :func:`storylens.analysis.truth.truth_table`."""

    rows: list[TruthRow]
    agreements: list[Agreement]
    n_stories: int
    n_name_positions: int
    n_other_positions: int
    flagged: list  # [head, detectors]
    sentences: list[str]
    stories_chosen: str = ""  # how the ablations' stories were chosen, and their cost beside the scoring pass

    @classmethod
    def of(cls, t, stories_chosen: str = "") -> Faithfulness:
        return cls(
            rows=[TruthRow(**r.__dict__) for r in t.rows],
            agreements=[Agreement(a.detector, a.rho, [list(m) for m in a.moves]) for a in t.agreements],
            n_stories=t.n_stories,
            n_name_positions=t.n_name_positions,
            n_other_positions=t.n_other_positions,
            flagged=[list(f) for f in t.flagged],
            sentences=list(t.sentences),
            stories_chosen=stories_chosen,
        )


@dataclass
class ReportSummary(Plain):
    model: ModelInfo
    quiz: QuizInfo
    leakage: Leakage
    name_heads: NameHeads
    previous_token: PreviousToken
    marker: Marker
    story_shown: StoryShown
    number_to_reproduce: NumberToReproduce
    numerics: list[NumericRow] = field(default_factory=list)
    beyond: BeyondSummary | None = None  # only with --beyond (no key in JSON without it)
    faithfulness: Faithfulness | None = None  # where heads look, what they move (no key when not run)
    timings_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = super().to_dict()
        for key in ("beyond", "faithfulness"):
            if d[key] is None:
                del d[key]
        return d

    def to_json(self) -> str:
        """``summary.json``'s text."""
        return json.dumps(self.to_dict(), indent=1)


def load(path: str | os.PathLike) -> ReportSummary:
    """A report's ``summary.json`` (or the report folder holding it), typed."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    return ReportSummary.from_dict(json.loads(path.read_text(encoding="utf-8")))
