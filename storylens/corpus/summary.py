"""``storylens score``'s summary, typed: what it writes as ``summary.json``.

Named as the report's summary names the same things (:mod:`storylens.lesson.summary`): the model is
the same :class:`~storylens.table.run_info.ModelInfo`, the stories the same
:class:`~storylens.table.run_info.StoriesInfo` (the report's ``quiz`` holds the same keys and
more), the seconds each phase took ``timings_s``. :meth:`ScoreSummary.to_dict` is ``summary.json``
exactly; :func:`load` reads one back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from storylens.core.files import read_json
from storylens.core.plain import Plain
from storylens.core.schema import versioned
from storylens.effects.audit import Audit
from storylens.effects.backups import Backups
from storylens.effects.estimators import EstimatorAudit
from storylens.effects.exact import ExactInfo
from storylens.table.run_info import ModelInfo, StoriesInfo

NAME_DEFINITION = "a capitalised word whose lower-case form appears nowhere in the stories scored"


@dataclass
class NamesInfo(Plain):
    """The first pass's name vocabulary: how many names, and the word sets they come from."""

    definition: str
    names: int
    lower_case_words: int
    capitalised_words: int


@dataclass
class EngineInfo(Plain):
    name: str  # "local" or "ray"
    workers: int  # what the engine really used (Ray caps --workers at the cluster's CPUs)
    resumed_from: int  # stories done by an earlier run (a checkpoint), 0 when started afresh


@dataclass
class TopHead(Plain):
    head: str
    score: float


@dataclass
class ScoreSummary(Plain):
    model: ModelInfo
    stories: StoriesInfo
    names: NamesInfo
    engine: EngineInfo
    timings_s: dict[str, float]  # first_pass, scoring
    detectors: list[str]
    top: dict[str, TopHead | None]  # per detector, its highest head (None: no head has a value)
    audit: Audit | None = None  # AtP against exact ablation (--causal --audit K; no key when not run)
    exact: ExactInfo | None = None  # what the exact columns rest on (--exact, --causal; no key when not run)
    estimators: list[EstimatorAudit] | None = (
        None  # each estimate's audit against the exact effect (--estimator, --causal)
    )
    backups: Backups | None = None  # the heads that stand in once the strongest are off (--backups K)

    def to_dict(self) -> dict:
        """``summary.json``: ``schema_version`` (:mod:`storylens.core.schema`), then the fields (no
        ``audit`` key when none was run)."""
        d = super().to_dict()
        for key in ("audit", "exact", "estimators", "backups"):
            if d[key] is None:
                del d[key]
        return versioned(d)

    def to_json(self) -> str:
        """``summary.json``'s text."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    def explorer_meta(self, examples: int) -> dict:
        """What explore.html says about the run: the model, the stories, the examples kept."""
        return {
            "model": self.model.described,
            "stories": f"{self.stories.stories:,} from {self.stories.source}",
            "examples": f"{examples} per head and detector" if examples else "not kept (--examples 0)",
        }


def load(path: str | os.PathLike) -> ScoreSummary:
    """A score run's ``summary.json`` (or the folder holding it), typed."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    return ScoreSummary.from_dict(read_json(path))
