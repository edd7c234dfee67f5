"""Heads that stand in for others: conditional co-ablation (self-repair).

Switch off the ``K`` heads of largest exact effect together, then measure every other head's exact effect
again with those ``K`` off (:func:`~storylens.effects.exact.exact_batch` with ``base``). A head whose effect
grows once they are gone was standing in for them: a backup. Per story ``s`` and head ``h``, with ``L_s(S)``
the story's summed next-token loss with the heads ``S`` off:

    gain_s(h)   = [L_s(K + h) - L_s(K)] - [L_s(h) - L_s({})]     (backup_gain: its effect with K off, less alone)
    joint_s     = L_s(K) - L_s({})                              (the K off together)
    separate_s  = sum over k in K of [L_s(k) - L_s({})]         (the K off one at a time, summed)
    repair_s    = separate_s - joint_s                          (what the model makes up when they go together)

each pooled over stories as the exact effect is (nats per predicted token, the ratio estimator's standard
error): a positive ``repair`` is self-repair (the joint loss is less than the parts), a negative one
synergy. The same on patching pairs (:mod:`storylens.effects.patching`, ``patch --backups``), on its metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storylens.core.batching import valid_mask
from storylens.core.figures import bracketed
from storylens.core.heads import Head
from storylens.core.plain import Plain
from storylens.effects.audit import Effect, story_losses
from storylens.effects.exact import COPY_BYTES, ExactPlan, exact_batch, on_list, resample_donors
from storylens.engine.accumulate import RatioAccumulator
from storylens.engine.encode import EncodedStory, StoryBatch
from storylens.engine.record import Rerun
from storylens.lm import AttentionLM, ModelLike

BACKUP_STORIES = 200  # score --backups: the first stories the two passes run on (at most)


@dataclass(frozen=True)
class Backups(Plain):
    """What switching off ``removed`` together does (``mode`` ablation, over ``n_stories`` stories):
    ``joint`` against ``separate`` (their single effects summed) and ``repair`` (separate - joint), and
    every other head's ``gains`` (its effect with them off, less its effect alone), largest first."""

    mode: str
    removed: tuple[str, ...]
    joint: Effect
    separate: Effect
    repair: Effect
    gains: tuple[tuple[str, Effect], ...]
    n_stories: int


def top_heads(effect: torch.Tensor, k: int) -> list[Head]:
    """The ``k`` heads of largest ``|effect|`` (``[layer, head]``), largest first (ties: the earlier head)."""
    L, H = effect.shape
    order = sorted(Head.every(L, H), key=lambda h: (-abs(float(effect[h])), h))
    return order[: max(0, min(k, L * H))]


class BackupMeasure(Rerun):
    """Per batch, every head's effect alone and with ``removed`` off, into the sums of :meth:`result`."""

    def __init__(self, n_layer: int, n_head: int, plan: ExactPlan, removed: Sequence[Head]):
        self.plan, self.removed = plan, tuple(removed)
        self.sums = {
            m: {
                "gain": RatioAccumulator((n_layer, n_head)),
                "joint": RatioAccumulator(()),
                "separate": RatioAccumulator(()),
                "repair": RatioAccumulator(()),
            }
            for m in plan.modes
        }

    def rerun(self, lm: AttentionLM, batch: StoryBatch, chunk: Sequence[EncodedStory]) -> None:
        plan = self.plan
        lengths = batch.lengths.cpu()
        ids = batch.ids
        valid = valid_mask(lengths, ids.shape[1]).to(ids.device)
        donors, keep = None, None
        if "resample" in plan.modes:
            donors, keep = resample_donors(lm, ids, batch.stories, chunk, plan.seed)
        with torch.inference_mode():
            clean = story_losses(lm, ids, valid)
        alone = exact_batch(lm, ids, valid, plan.modes, plan.means, plan.budget, donors)
        after = exact_batch(lm, ids, valid, plan.modes, plan.means, plan.budget, donors, base=self.removed)
        tokens = (lengths - 1).to(torch.float64)
        for m in plan.modes:
            rows = keep if m == "resample" and keep is not None else slice(None)
            joint = after[f"{m}:reference"] - clean
            separate = torch.stack([alone[m][:, h.layer, h.head] for h in self.removed], -1).sum(-1)
            gain = after[m] - alone[m]
            for h in self.removed:
                gain[:, h.layer, h.head] = float("nan")  # not measured: already off
            parts = {"gain": gain, "joint": joint, "separate": separate, "repair": separate - joint}
            for name, c in parts.items():
                self.sums[m][name].add(c[rows], tokens[rows])

    def result(self, mode: str) -> Backups:
        s = self.sums[mode]
        gain, gain_se = s["gain"].result()
        L, H = gain.shape

        def one(name: str) -> Effect:
            v, se = s[name].result()
            return Effect(float(v), float(se))

        others = [h for h in Head.every(L, H) if h not in self.removed]
        gains = sorted(((h.label, Effect(float(gain[h]), float(gain_se[h]))) for h in others), key=lambda x: -x[1].nats)
        return Backups(
            mode, tuple(h.label for h in self.removed), one("joint"), one("separate"), one("repair"),
            tuple(gains), s["joint"].count,
        )  # fmt: skip

    def columns(self, mode: str) -> dict[str, torch.Tensor]:
        """``backup_gain`` and ``backup_gain_se`` as ``[layer, head]`` grids (NaN for the removed heads)."""
        gain, se = self.sums[mode]["gain"].result()
        return {"backup_gain": gain, "backup_gain_se": se}


def backup_effects(
    model: ModelLike,
    stories_ids: Sequence[Sequence[int]],
    removed: Sequence[Head],
    modes: Sequence[str] = ("mean",),
    *,
    means: torch.Tensor | None = None,
    seed: int = 0,
    batch_size: int = 16,
    budget: int = COPY_BYTES,
) -> BackupMeasure:
    """Every head's backup gain once ``removed`` are off, and what the model repairs, over ``stories_ids``
    (the module docstring); the stories one chunk (resample's donors drawn from them, ``seed``)."""

    def make(n_layer: int, n_head: int, plan: ExactPlan) -> BackupMeasure:
        return BackupMeasure(n_layer, n_head, plan, removed)

    return on_list(model, stories_ids, modes, means, seed, batch_size, budget, make)


def backup_lines(b: Backups, top: int = 5) -> list[str]:
    """The backups for a terminal: the joint effect against the separate ones, the largest gains."""

    def e(x: Effect) -> str:  # in brackets within two standard errors of zero (or no error): no sign claimed
        return bracketed(x.nats, x.se, 4, "story")

    out = [
        f"backups ({b.mode} ablation, {b.n_stories} stories): {', '.join(b.removed)} off together {e(b.joint)} nats, "
        f"one at a time summed {e(b.separate)}; repaired {e(b.repair)}",
        "  largest backup gains (a head's effect with them off, less alone): "
        + ", ".join(f"{h} {e(g)}" for h, g in b.gains[:top]),
        "  in brackets: within two standard errors of zero over the stories, so no sign is claimed",
    ]
    return out
