"""Does attention tell the truth here? For the strongest heads of every detector: where the head
looks (the raw score), what it moves there (the norm-weighted score, :mod:`storylens.looking.faithful`),
how much it writes (its output share), and what the model loses without it (zero and mean ablation
through ``hook_z``, :mod:`storylens.effects.ablation`) where the detector says the head matters:
the name's tokens for the name detector, every next token for the others. Then, per detector, the
rank correlation across heads between raw and norm-weighted scores and the heads whose rank moves
most, and a few sentences that say it in measured words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from storylens.core.heads import Head
from storylens.core.plain import Plain
from storylens.data.names import name_vocabulary
from storylens.effects.ablation import MODES, AblationTable, ablation_loss_table, head_output_means
from storylens.effects.cost import (
    TRUTH_BUDGET,
    TRUTH_FLOOR_FLOPS,
    AblationCost,
    block_flops,
    effect_text,
    head_flops,
    scoring_flops,
)
from storylens.engine.encode import EncodedStory, encode_stories, is_encoded
from storylens.engine.ranks import rank_correlation, rank_moves
from storylens.lm import AttentionLM, ModelLike, wrap
from storylens.looking.detectors import NORM_PREFIX, TRUTH
from storylens.looking.sinks import DORMANT_SHARE

if TYPE_CHECKING:
    from storylens.table.scores import HeadScores


TRUTH_HEADS = 2  # the strongest heads of each detector that are switched off


TRUTH_STORIES = 50  # the first stories of the quiz the ablations run on (at most, within the budget)


AGREE, PART = 0.8, 0.5  # Spearman's rho at or above AGREE: "agree"; below PART: "part"


@dataclass(frozen=True)
class TruthRow(Plain):
    detector: str
    head: str  # L{block}H{head}
    raw: float
    norm: float | None
    share: float | None
    zero_increase: float | None  # loss increase with the head's output set to zero (nats); None: no position
    mean_increase: float | None  # ... set to its mean output
    where: str  # "name tokens" or "next tokens"
    dormant: bool  # the head is dormant: switching it to its mean moves nothing (storylens.looking.sinks)


@dataclass(frozen=True)
class Agreement(Plain):
    detector: str
    rho: float | None  # Spearman's rank correlation, raw vs norm-weighted, over every head
    moves: tuple[tuple[str, float, float], ...]  # (head, raw rank, norm-weighted rank), 1 = strongest


@dataclass(frozen=True)
class TruthEffect(Plain):
    """A row's head with ``--causal``: AtP's estimate of what mean ablation does to the mean next-token
    loss (nats, every quiz story) with its standard error, and the exact effect with its error where
    the audit ablated the head (None where it did not)."""

    detector: str
    head: str
    atp: float | None
    atp_se: float | None
    exact: float | None = None
    exact_se: float | None = None


@dataclass(frozen=True)
class TruthCausal(Plain):
    """The table's causal columns (``--causal``): per row, :class:`TruthEffect`; per detector, Spearman's
    rho over every head between its raw score and ``atp_mean``; the stories each rests on."""

    rows: tuple[TruthEffect, ...]
    rho: tuple[tuple[str, float | None], ...]  # (detector, rho: raw score vs atp_mean over every head)
    atp_stories: int  # the quiz stories AtP is over
    exact_stories: int  # the stories the audit ablated the heads on (0: no audit)


@dataclass(frozen=True)
class Truth(Plain):
    rows: tuple[TruthRow, ...]
    agreements: tuple[Agreement, ...]
    n_stories: int  # stories the ablations ran on
    n_name_positions: int
    n_other_positions: int
    dormant: tuple[str, ...]  # every dormant head
    sentences: tuple[str, ...]
    stories_chosen: str = ""  # how the stories were chosen and their cost, in words (the report says it)
    causal: TruthCausal | None = None  # AtP for every head, exact where audited (--causal; no key without it)

    def to_dict(self) -> dict:
        d = super().to_dict()
        if d["causal"] is None:
            del d["causal"]
        return d


def with_causal(truth: Truth, scores: HeadScores, exact: dict[str, tuple[float, float]], exact_stories: int) -> Truth:
    """``truth`` with its causal columns (:class:`TruthCausal`) from ``scores``' ``atp_mean`` and
    ``atp_mean_se`` (a ``--causal`` run) and ``exact``: ``{head label: (nats, se)}`` of the audited
    heads' exact mean ablation on ``exact_stories`` stories; its sentences said with them."""
    atp, se = scores.column("atp_mean"), scores.column("atp_mean_se")
    index = {h.label: i for i, h in enumerate(scores.heads)}
    rows = tuple(
        TruthEffect(r.detector, r.head, atp[index[r.head]], se[index[r.head]], *exact.get(r.head, (None, None)))
        for r in truth.rows
    )
    known = all(v is not None for v in atp)
    rho = tuple(
        (a.detector, rank_correlation(scores.column(a.detector), atp) if known else None) for a in truth.agreements
    )
    causal = TruthCausal(rows, rho, scores.n_stories, exact_stories if exact else 0)
    out = replace(truth, causal=causal)
    return replace(out, sentences=tuple(sentences(out)))


def truth_detectors(scores: HeadScores) -> list[str]:
    """The detectors shown in the faithfulness table (:data:`~storylens.looking.detectors.TRUTH`,
    built-in and user ones alike), those computed for every head."""
    return [d for d in scores.shown(TRUTH) if all(v is not None for v in scores.column(d))]


def truth_heads(scores: HeadScores, k: int = TRUTH_HEADS) -> dict[str, list[str]]:
    """Each detector's ``k`` strongest heads (labels), the heads the table switches off."""
    return {d: [h.label for h in scores.top(d, k)] for d in truth_detectors(scores)}


def switched_off(top: dict[str, list[str]]) -> list[str]:
    """The heads of :func:`truth_heads` ``top``, each once, in the order first named."""
    return list(dict.fromkeys(label for labels in top.values() for label in labels))


@dataclass(frozen=True)
class AblationPasses:
    """What the table's ablations run per token of an ablated story: ``blocks`` passes of one block
    (the heads' mean outputs over every block; the unablated losses over every block; for each head
    and mode, the blocks from the head's own on, those before it not run again:
    :meth:`~storylens.lm.AttentionLM.skip_blocks`) and ``heads`` passes of the output head (every
    pass that computes a loss)."""

    blocks: int
    heads: int


def ablation_passes(lm: AttentionLM, scores: HeadScores, *, k: int = TRUTH_HEADS) -> AblationPasses:
    L = lm.n_layer
    heads = switched_off(truth_heads(scores, k))
    ablated = len(MODES) * sum(L - Head.parse(h).layer for h in heads)
    return AblationPasses(blocks=2 * L + ablated, heads=1 + len(MODES) * len(heads))


def ablation_flops(lm: AttentionLM, scores: HeadScores, lengths: Sequence[int], *, k: int = TRUTH_HEADS) -> list[float]:
    """Each story's ablation work for the table, in floating-point operations: its tokens times
    :func:`ablation_passes`, at :func:`block_flops` a block and :func:`head_flops` an output head.
    (A means pass without logits may skip the last block's MLP: counted, a slight overcount.)"""
    n = ablation_passes(lm, scores, k=k)
    per_token = n.blocks * block_flops(lm) + n.heads * head_flops(lm)
    return [t * per_token for t in lengths]


def truth_budget_stories(
    lm: AttentionLM,
    scores: HeadScores,
    lengths: Sequence[int],
    *,
    k: int = TRUTH_HEADS,
    max_stories: int = TRUTH_STORIES,
    budget: float = TRUTH_BUDGET,
    floor_flops: float = TRUTH_FLOOR_FLOPS,
) -> int:
    """How many of the first stories the table's ablations run on: the most, up to ``max_stories``,
    whose :func:`ablation_flops` fit ``max(budget x scoring_flops(every story), floor_flops)``, and at
    least one (which may not fit). ``lengths``: the tokens of every story scored, in order (the first
    ones are ablated)."""
    if not lengths or not max_stories:
        return 0
    allowed = max(budget * scoring_flops(lm, lengths), floor_flops)
    n, work = 0, 0.0
    for w in ablation_flops(lm, scores, lengths[:max_stories], k=k):
        work += w
        if work > allowed:
            break
        n += 1
    return max(1, n)


def _increase(table: AblationTable, label: str, mode: str, detector: str) -> float | None:
    """The loss increase with ``label`` off in ``mode``: on name tokens for the name detector, else pooled over all."""
    n_name, n_other = table.n_name_positions, table.n_other_positions
    r = table.row(label, mode)
    if detector == "name_mass":
        return r.name_increase if n_name else None
    if n_name + n_other == 0:
        return None
    name = r.name_increase if n_name else 0.0
    other = r.other_increase if n_other else 0.0
    return (n_name * name + n_other * other) / (n_name + n_other)


def _agreements(scores: HeadScores, detectors: Sequence[str]) -> tuple[Agreement, ...]:
    """Per detector: the rank correlation of raw and norm-weighted scores and the heads whose rank moves most."""
    labels = [h.label for h in scores.heads]
    return tuple(
        Agreement(
            d,
            rank_correlation(scores.column(d), scores.column(NORM_PREFIX + d)),
            tuple(rank_moves(scores.column(d), scores.column(NORM_PREFIX + d), labels)),
        )
        for d in detectors
    )


def truth_table(
    model: ModelLike,
    scores: HeadScores,
    stories: Sequence[str] | Sequence[EncodedStory],
    *,
    k: int = TRUTH_HEADS,
    n_stories: int = TRUTH_STORIES,
    batch_size: int = 16,
    progress: bool = False,
) -> Truth:
    """The table for ``scores`` (a :class:`~storylens.table.scores.HeadScores` with its norm-weighted
    columns) of ``model`` on ``stories`` (the same stories, as texts or already encoded); the ablations
    run on the first ``n_stories``."""
    lm = wrap(model)
    given: list = list(stories)  # texts, or the records of encode_stories
    encoded: list[EncodedStory] = given if is_encoded(given) else encode_stories(lm, given, name_vocabulary(given))
    top = truth_heads(scores, k)
    detectors = list(top)
    heads = switched_off(top)
    chosen = list(encoded[:n_stories])
    ids = [e.ids for e in chosen]
    table = ablation_loss_table(
        lm,
        ids,
        [e.mention_starts for e in chosen],
        heads=heads,
        modes=MODES,
        means=head_output_means(lm, ids, batch_size=batch_size),
        batch_size=batch_size,
        progress=progress,
    )
    n_name, n_other = table.n_name_positions, table.n_other_positions
    index = {h.label: i for i, h in enumerate(scores.heads)}
    rows = []
    for d in detectors:
        for label in top[d]:
            h = scores.head(label)
            rows.append(
                TruthRow(
                    detector=d,
                    head=label,
                    raw=scores.column(d)[index[label]],
                    norm=scores.column(NORM_PREFIX + d)[index[label]],
                    share=h.output_share,
                    zero_increase=_increase(table, label, "zero", d),
                    mean_increase=_increase(table, label, "mean", d),
                    where="name tokens" if d == "name_mass" else "next tokens",
                    dormant=bool(h.dormant),
                )
            )
    agreements = _agreements(scores, detectors)
    dormant = tuple(h.label for h in scores.heads if h.dormant)
    truth = Truth(tuple(rows), agreements, len(chosen), n_name, n_other, dormant, ())
    return Truth(**{**truth.__dict__, "sentences": tuple(sentences(truth))})


def _ablation_clause(t: Truth, best: TruthRow) -> str:
    """The strongest head's ablation in words (no error: the table's ablations have none)."""
    if best.zero_increase is None or best.mean_increase is None:
        return f"; the {t.n_stories} stories switched off hold no {best.where} to measure it on."
    return (
        f"; switching it off changes the loss on {best.where} by {best.zero_increase:+.3f} nats"
        f" (mean ablation {best.mean_increase:+.3f})."
    )


def _matters_more(best: TruthRow, rows: list[TruthRow]) -> str:
    """The head of the detector's top rows whose zero ablation hurts most, where it is not the first."""
    hurts = max(rows, key=lambda r: r.zero_increase if r.zero_increase is not None else -math.inf)
    if (
        hurts is not best
        and hurts.zero_increase is not None
        and best.zero_increase is not None
        and hurts.zero_increase > best.zero_increase
    ):
        return f" Of its top {len(rows)}, {hurts.head} matters more ({hurts.zero_increase:+.3f})."
    return ""


def _causal_clause(t: Truth, best: TruthRow) -> str:
    """The strongest head's effect on the mean next-token loss: AtP with its error over every quiz
    story, and the exact effect where the audit ablated it, each signed only beyond two errors."""
    assert t.causal is not None
    e = next(r for r in t.causal.rows if r.detector == best.detector and r.head == best.head)
    if e.atp is None:
        return "."
    s = f"; by AtP over {t.causal.atp_stories} stories, replacing its output by its mean {_loss_words(e.atp, e.atp_se)}"
    if e.exact is not None:
        s += f" (exactly, on the {t.causal.exact_stories} audited: {effect_text(e.exact, e.exact_se)} nats)"
    return s + "."


def _loss_words(nats: float, se: float | None) -> str:
    """An effect on the mean next-token loss in words, its sign said only beyond two standard errors."""
    if se is None or se != se:
        return f"changes the mean next-token loss by {nats:+.4f} nats (no error: one story)"
    if abs(nats) <= 2 * se:
        return f"has no clear effect on the mean next-token loss ({nats:+.4f} ± {se:.4f} nats)"
    return f"changes the mean next-token loss by {nats:+.4f} ± {se:.4f} nats"


def _verdict(rho: float | None) -> str:
    if rho is None:
        return "cannot be compared (a constant column)"
    if rho >= AGREE:
        return f"agree (Spearman's rho {rho:.2f})"
    if rho >= PART:
        return f"partly agree (rho {rho:.2f})"
    return f"part (rho {rho:.2f})"


def sentences(t: Truth) -> list[str]:
    """Where raw attention, the norm-weighted score and ablation agree and where they part, in the
    table's own numbers (with ``--causal``: in AtP's and the audit's, with their errors)."""
    out = []
    for a in t.agreements:
        rows = [r for r in t.rows if r.detector == a.detector]
        if not rows:
            continue
        best = rows[0]
        s = f"{a.detector}: raw and norm-weighted rankings {_verdict(a.rho)}."
        if best.norm is not None and best.share is not None:
            s += (
                f" Its strongest head, {best.head}, scores {best.raw:.3f} raw and {best.norm:.3f} norm-weighted"
                f" and writes {best.share:.0%} of its block's head output"
            )
            s += _causal_clause(t, best) if t.causal is not None else _ablation_clause(t, best)
        if t.causal is None:
            s += _matters_more(best, rows)
        if a.moves and a.moves[0][1] != a.moves[0][2]:
            label, r_raw, r_norm = a.moves[0]
            s += f" The weighting moves {label} most, from rank {r_raw:g} to {r_norm:g}."
        if t.causal is not None:
            rho = dict(t.causal.rho).get(a.detector)
            if rho is not None:
                s += f" Over every head, Spearman's rho between the raw score and AtP (mean ablation) is {rho:.2f}."
        out.append(s)
    quiet = f"under {DORMANT_SHARE:g} of an even share of its block's story-dependent output"
    if t.dormant:
        out.append(
            f"{len(t.dormant)} head(s) are dormant ({quiet}: switching one to its mean moves nothing): "
            + ", ".join(t.dormant)
            + "."
        )
    else:
        out.append(f"No head is dormant: no head's story-dependent output is {quiet}.")
    return out


def truth_cost(
    lm: AttentionLM, scores: HeadScores, lengths: Sequence[int], n: int, *, k: int = TRUTH_HEADS
) -> AblationCost:
    """What the truth table's ablations cost on the first ``n`` stories of ``lengths``."""
    first = list(lengths[:n])
    return AblationCost(
        passes=ablation_passes(lm, scores, k=k).blocks / lm.n_layer,
        flops=sum(ablation_flops(lm, scores, first, k=k)),
        scoring=scoring_flops(lm, first),
    )
