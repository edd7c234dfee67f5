"""The report's summary, typed: what ``storylens report`` writes as ``summary.json``.

:class:`ReportSummary` holds every figure the report states, and the report's page, ``storylens
report``'s printout and the README's tables read it by attribute. Its parts are the results
themselves wherever one exists: the model and the quiz as ``storylens score`` names them
(:mod:`storylens.table.run_info`), the leakage check's :class:`~storylens.data.leakage.LeakageStats`,
the numerical checks (:class:`~storylens.lesson.checks.Check`), ``--beyond``'s findings
(:class:`~storylens.lesson.beyond.BeyondSummary`) and the faithfulness table
(:class:`~storylens.table.truth.Truth`). :meth:`ReportSummary.to_dict` is ``summary.json``
exactly (its keys in their order, its values); :meth:`ReportSummary.from_dict` and :func:`load`
read one back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from storylens.core.plain import Plain
from storylens.core.schema import versioned
from storylens.data.leakage import LeakageStats
from storylens.effects.audit import Audit
from storylens.lesson.beyond import BeyondSummary
from storylens.lesson.checks import Check
from storylens.lesson.why_cards import WhyCard
from storylens.table.run_info import ModelInfo, StoriesInfo
from storylens.table.truth import Truth


@dataclass
class QuizInfo(StoriesInfo):
    """The quiz scored (:class:`~storylens.table.run_info.StoriesInfo`) and what the lesson adds."""

    skipped: int = 0
    shipped_with_storylens: bool = False
    train_stories: int | None = None


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
    prev_token: float | None  # None: no story counted (--prev-limit 0)
    prev4: float | None
    stories: int | None


@dataclass
class ArgmaxFirst(Plain):
    head: str
    share: float | None
    stories: int | None


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
class ReportSummary(Plain):
    model: ModelInfo
    quiz: QuizInfo
    marker: Marker
    story_shown: StoryShown
    # the lesson's own figures (the report's "lesson" section: --sections; no key when not run)
    leakage: Leakage | None = None
    name_heads: NameHeads | None = None
    previous_token: PreviousToken | None = None
    number_to_reproduce: NumberToReproduce | None = None
    numerics: list[Check] | None = None
    beyond: BeyondSummary | None = None  # only with --beyond (no key in JSON without it)
    faithfulness: Truth | None = None  # where heads look, what they move (no key when not run)
    audit: Audit | None = None  # AtP against exact ablation (with --causal; no key when not run)
    why: list[WhyCard] | None = None  # the top heads' query-key terms (with --why; no key when not run)
    sections: list[str] | None = None  # the report's sections run (storylens.lesson.report.SECTIONS)
    timings_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """summary.json: the lesson's keys in the order a lesson's report has always written them, and
        no key for a part not run."""
        d = super().to_dict()
        order = ["model", "quiz", "leakage", "name_heads", "previous_token", "marker", "story_shown"]
        order += ["number_to_reproduce", "numerics", "beyond", "faithfulness", "audit", "why", "sections", "timings_s"]
        return versioned({k: d[k] for k in order if d[k] is not None})

    def to_json(self) -> str:
        """``summary.json``'s text."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)


def load(path: str | os.PathLike) -> ReportSummary:
    """A report's ``summary.json`` (or the report folder holding it), typed."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    return ReportSummary.from_dict(json.loads(path.read_text(encoding="utf-8")))
