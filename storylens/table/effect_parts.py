"""The head table's effect columns, composed into :class:`~storylens.table.accumulator.HeadScoreAccumulator`:
AtP and DLA from the gradient pass (``causal``, :mod:`storylens.effects.attribution`), every head's exact
effect (``exact``, :mod:`storylens.effects.exact`) and an estimator beside it (``estimator``,
:mod:`storylens.effects.estimators`), each from passes of its own over each batch after the recording; streamed,
mergeable and kept in a state like every other column."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from storylens.effects.attribution import CausalAccumulator
from storylens.effects.estimators import IG_STEPS, EstimateAccumulator, EstimateMeasure
from storylens.effects.exact import ExactAccumulator, ExactMeasure, ExactPlan
from storylens.engine.encode import EncodedStory, StoryBatch
from storylens.engine.gradients import GRAPH_BYTES, Gradients
from storylens.engine.record import Needs
from storylens.lm import AttentionLM

PARTS = ("causal", "exact", "estimate", "atp_audit")  # their keys in the accumulator's state


class EffectParts:
    """``causal``: AtP and DLA; ``exact``: the plan of every head's exact effect (None: not measured);
    ``estimator``: one of :data:`~storylens.effects.estimators.ESTIMATORS` estimated on the same ablations
    (needs ``exact``: its audit is against it), ``ig_steps`` its steps where it is ``ig``; ``audit_atp`` (with
    ``causal`` and ``exact``): AtP measured again on the stories the exact effect covers, with its means, for the
    audit of the AtP columns (:attr:`atp_audit`; the ``atp`` estimator's own audit where that is the estimator)."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        *,
        causal: bool = False,
        graph_bytes: int = GRAPH_BYTES,
        exact: ExactPlan | None = None,
        estimator: str | None = None,
        ig_steps: int = IG_STEPS,
        audit_atp: bool = False,
    ):
        if estimator is not None and exact is None:
            raise ValueError("an estimator is measured beside the exact effect (its audit): pass exact too")
        if audit_atp and (exact is None or not causal):
            raise ValueError("the AtP columns' audit is against the exact effect: pass causal and exact too")
        self.n_layer, self.n_head, self.graph_bytes, self.ig_steps = n_layer, n_head, graph_bytes, ig_steps
        self.causal = CausalAccumulator(n_layer, n_head, graph_bytes) if causal else None
        self.exact = ExactMeasure(n_layer, n_head, exact) if exact is not None else None
        self.estimate = (
            EstimateMeasure(n_layer, n_head, estimator, exact, ig_steps)
            if estimator is not None and exact is not None
            else None
        )
        self.atp_audit = (
            EstimateMeasure(n_layer, n_head, "atp", exact, audit_only=True)
            if audit_atp and exact is not None and estimator != "atp"
            else None
        )
        self.audit_atp = audit_atp

    @property
    def audits(self) -> list[EstimateMeasure]:
        """The estimates audited against the exact effect: the estimator's, then AtP's (``audit_atp``)."""
        return [m for m in (self.estimate, self.atp_audit) if m is not None]

    def settings(self) -> dict:
        """What an empty twin is built from (:meth:`like`)."""
        return {
            "causal": self.causal is not None,
            "graph_bytes": self.graph_bytes,
            "exact": None if self.exact is None else self.exact.plan,
            "estimator": None if self.estimate is None else self.estimate.estimator,
            "ig_steps": self.ig_steps,
            "audit_atp": self.audit_atp,
        }

    def needs(self, needs: Needs) -> Needs:
        """``needs`` with what these parts ask of the recording: the gradient pass, reruns."""
        if self.causal is not None:
            needs = dataclasses.replace(needs, gradients=True, graph_bytes=self.graph_bytes)
        if self.exact is not None:
            needs = dataclasses.replace(needs, reruns=True)
        return needs

    def gradients(self, grads: Gradients) -> None:
        if self.causal is not None:
            self.causal.gradients(grads)

    def rerun(self, lm: AttentionLM, batch: StoryBatch, chunk: Sequence[EncodedStory]) -> None:
        if self.exact is not None:
            self.exact.rerun(lm, batch, chunk)
        for measure in self.audits:
            measure.rerun(lm, batch, chunk)

    def merge(self, other: EffectParts) -> None:
        for name in PARTS:
            if (getattr(other, name) is None) != (getattr(self, name) is None):
                raise ValueError(f"merge: one accumulator has the {name} columns and the other not")
        if self.causal is not None and other.causal is not None:
            self.causal.merge(other.causal)
        if self.exact is not None and other.exact is not None:
            self.exact.acc.merge(other.exact.acc)
        if self.estimate is not None and other.estimate is not None:
            self.estimate.acc.merge(other.estimate.acc)
            self.estimate.audited.merge(other.estimate.audited)
        if self.atp_audit is not None and other.atp_audit is not None:
            self.atp_audit.audited.merge(other.atp_audit.audited)

    def state(self) -> dict:
        est = self.estimate
        return {
            "causal": None if self.causal is None else self.causal.state(),
            "exact": None if self.exact is None else self.exact.acc.state(),
            "estimate": None if est is None else {"all": est.acc.state(), "audited": est.audited.state()},
            "atp_audit": None if self.atp_audit is None else {"audited": self.atp_audit.audited.state()},
        }

    def load_state(self, state: dict, max_stories: int | None) -> None:
        """The parts of an accumulator's ``state`` (ValueError naming what does not fit)."""
        for name in PARTS:
            if (getattr(self, name) is None) != (state.get(name) is None):
                raise ValueError(f"state: the {name} columns kept in one of the state and this accumulator only")
        if self.causal is not None:
            try:
                self.causal = CausalAccumulator(self.n_layer, self.n_head, self.graph_bytes).load_state(state["causal"])
            except ValueError as e:
                raise ValueError(f"state: causal: {e}") from None
        if self.exact is not None:
            self.exact.acc = _exact_state(state["exact"], self.exact.acc, max_stories)
        if self.estimate is not None:
            self.estimate.acc = _estimate_state(state["estimate"], "all", self.estimate)
            self.estimate.audited = _estimate_state(state["estimate"], "audited", self.estimate)
        if self.atp_audit is not None:
            self.atp_audit.audited = _estimate_state(state["atp_audit"], "audited", self.atp_audit)

    def columns(self) -> dict[str, torch.Tensor | None]:
        cols: dict[str, torch.Tensor | None] = {}
        if self.causal is not None:
            cols.update(self.causal.columns())
        if self.exact is not None:
            cols.update(self.exact.acc.columns())
        if self.estimate is not None:
            cols.update(self.estimate.acc.columns())
        return cols


def _exact_state(state: dict, mine: ExactAccumulator, max_stories: int | None) -> ExactAccumulator:
    exact = ExactAccumulator.from_state(state)
    if (exact.n_layer, exact.n_head, exact.modes, exact.means_key) != (
        mine.n_layer, mine.n_head, mine.modes, mine.means_key,
    ):  # fmt: skip
        raise ValueError("state: exact: other heads, modes or means than this accumulator's")
    if max_stories is not None and exact.stories > max_stories:
        raise ValueError(f"state: exact: {exact.stories} stories, more than {max_stories}")
    return exact


def _estimate_state(state: object, key: str, mine: EstimateMeasure) -> EstimateAccumulator:
    """``state[key]``, an estimate's accumulator, checked against ``mine``'s estimator, modes and heads."""
    try:
        got = EstimateAccumulator.from_state(state[key])  # type: ignore[index]
    except (KeyError, TypeError) as e:
        raise ValueError(f"state: estimate: {e}") from None
    if (got.estimator, got.modes, got.n_layer, got.n_head) != (
        mine.estimator, mine.acc.modes, mine.acc.n_layer, mine.acc.n_head,
    ):  # fmt: skip
        raise ValueError("state: estimate: another estimator, modes or heads than this accumulator's")
    return got
