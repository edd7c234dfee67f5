"""Past the lesson: switch heads off, control for position, follow pronouns.

:func:`run_beyond` computes the three experiments the lesson names but did not run;
:func:`beyond_summary` turns them into the typed findings the report draws as its section 8 and
writes as ``summary.json``'s ``beyond``.
"""

from __future__ import annotations

from dataclasses import dataclass

from storylens.core.plain import Plain
from storylens.effects.ablation import AblationTable, Divergence, generation_divergence
from storylens.engine.record import record
from storylens.lesson.figures import DIVERGENCE_PROMPT
from storylens.lm import AttentionLM
from storylens.looking.position import PositionControl, PositionControlAccumulator
from storylens.looking.pronouns import PronounAccumulator, PronounAttention
from storylens.table.name_ablation import name_ablation_table
from storylens.table.scores import HeadScores


@dataclass
class Beyond:
    ablation: AblationTable
    position: PositionControl
    pronouns: PronounAttention
    divergence: Divergence
    top_heads: list[str]


def run_beyond(
    lm: AttentionLM,
    stories,
    scores: HeadScores,
    *,
    position=None,
    pronouns=None,
    encoded=None,
    k: int = 3,
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = True,
) -> Beyond:
    """The three experiments. ``position`` and ``pronouns``: their results when the scoring pass
    already fed their accumulators (how the report records the quiz once); else one more
    recording pass makes both."""

    top = [h.label for h in scores.top("name_mass", k)]
    ablation = name_ablation_table(
        lm, stories, name_heads=top, batch_size=batch_size, progress=progress, encoded=encoded
    )
    if position is None or pronouns is None:
        pos_acc, pron_acc = (
            PositionControlAccumulator(lm.n_layer, lm.n_head, lm.window),
            PronounAccumulator(lm.n_layer, lm.n_head),
        )
        record(lm, encoded or stories, [pos_acc, pron_acc], batch_size=batch_size, progress=False)
        position, pronouns = pos_acc.result(), pron_acc.result()
    divergence = generation_divergence(
        lm, DIVERGENCE_PROMPT, [top[0]], seed=seed, max_new_tokens=80, temperature=0.8, top_k=40
    )
    return Beyond(ablation, position, pronouns, divergence, top)


def _rank(values: dict[str, float]) -> list[str]:
    return sorted(values, key=lambda k: -values[k])


@dataclass
class HeadAblation(Plain):
    """One head switched off alone: the loss increases on the name and elsewhere (zero, mean)."""

    head: str
    name_mass: float
    zero_name_increase: float
    zero_other_increase: float
    mean_name_increase: float | None
    mean_other_increase: float | None


@dataclass
class GroupAblation(Plain):
    heads: str
    mode: str
    name_increase: float
    other_increase: float


@dataclass
class AblationFindings(Plain):
    stories: int
    name_positions: int
    other_positions: int
    baseline_name_loss: float
    baseline_other_loss: float
    rows: list[HeadAblation]  # by name-loss increase, largest first
    groups: list[GroupAblation]
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
class PositionFindings(Plain):
    unmatched_share: float
    ranking_by_excess: list[PositionRow]
    top_name_heads_still_top6: list[str]


@dataclass
class PronounRow(Plain):
    head: str
    pronoun_mass: float
    other_mass: float


@dataclass
class PronounFindings(Plain):
    stories: int
    queries: int
    ranking: list[PronounRow]
    overlap_with_name_mass_top6: list[str]


@dataclass
class DivergenceShown(Plain):
    prompt: str
    head: str
    first_difference: int | None
    baseline: str
    ablated: str


@dataclass
class BeyondSummary(Plain):
    """``--beyond``'s findings (a report's ``beyond`` in ``summary.json``): :func:`beyond_summary`."""

    ablation: AblationFindings
    position_control: PositionFindings
    pronouns: PronounFindings
    divergence: DivergenceShown


def _ablation_findings(table: AblationTable, scores: HeadScores) -> AblationFindings:
    name_mass = {h.label: h.value("name_mass") for h in scores.heads}
    abl = {r.label: r for r in table.rows if r.mode == "zero" and len(r.heads) == 1}
    abl_mean = {r.label: r for r in table.rows if r.mode == "mean" and len(r.heads) == 1}
    name_loss_rank = _rank({k: r.name_increase for k, r in abl.items()})
    top_mass = _rank(name_mass)[0]
    return AblationFindings(
        stories=table.n_stories,
        name_positions=table.n_name_positions,
        other_positions=table.n_other_positions,
        baseline_name_loss=table.baseline_name_loss,
        baseline_other_loss=table.baseline_other_loss,
        rows=[
            HeadAblation(
                head=k,
                name_mass=name_mass[k],
                zero_name_increase=abl[k].name_increase,
                zero_other_increase=abl[k].other_increase,
                mean_name_increase=abl_mean[k].name_increase if k in abl_mean else None,
                mean_other_increase=abl_mean[k].other_increase if k in abl_mean else None,
            )
            for k in name_loss_rank
        ],
        groups=[
            GroupAblation(r.label, r.mode, r.name_increase, r.other_increase) for r in table.rows if len(r.heads) > 1
        ],
        top_name_mass_head=top_mass,
        top_name_loss_head=name_loss_rank[0],
        same_head=top_mass == name_loss_rank[0],
        rank_of_top_name_mass_head_by_name_loss=name_loss_rank.index(top_mass) + 1,
    )


def beyond_summary(b: Beyond, scores: HeadScores) -> BeyondSummary:
    """The three experiments' findings: the ablations ranked, the top six heads by excess over the
    position control and by pronoun mass, and the generation with the top name head off."""
    name_mass = {h.label: h.value("name_mass") for h in scores.heads}
    pos_rows = {r["label"]: r for r in b.position.to_rows()}
    excess_rank = _rank({k: r["excess"] for k, r in pos_rows.items()})
    pron_rows = {r["label"]: r for r in b.pronouns.to_rows()}
    pron_rank = _rank({k: r["pronoun_mass"] for k, r in pron_rows.items()})
    return BeyondSummary(
        ablation=_ablation_findings(b.ablation, scores),
        position_control=PositionFindings(
            unmatched_share=b.position.unmatched_share,
            ranking_by_excess=[
                PositionRow(k, pos_rows[k]["name_mass"], pos_rows[k]["control"], pos_rows[k]["excess"])
                for k in excess_rank[:6]
            ],
            top_name_heads_still_top6=[h for h in b.top_heads if h in excess_rank[:6]],
        ),
        pronouns=PronounFindings(
            stories=b.pronouns.n_stories,
            queries=b.pronouns.n_pronoun_queries,
            ranking=[PronounRow(k, pron_rows[k]["pronoun_mass"], pron_rows[k]["other_mass"]) for k in pron_rank[:6]],
            overlap_with_name_mass_top6=sorted(set(pron_rank[:6]) & set(_rank(name_mass)[:6])),
        ),
        divergence=DivergenceShown(
            prompt=b.divergence.prompt,
            head=b.top_heads[0],
            first_difference=b.divergence.first_difference,
            baseline=b.divergence.baseline_text,
            ablated=b.divergence.ablated_text,
        ),
    )
