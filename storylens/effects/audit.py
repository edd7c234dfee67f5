"""Exact ablation, head by head, with its error: what attribution patching (AtP) estimates, measured.

:func:`exact_effects` switches one head at a time to its mean output (``"mean"``) or to zero
(``"zero"``) at every position after the opening token, the edit made on ``blocks.{l}.attn.hook_z``
(per head, before the output projection), and measures the change in the stories' mean next-token
loss, pooled over every predicted token as perplexity is, with a standard error from the stories'
contributions (:class:`~storylens.engine.accumulate.RatioAccumulator`). The mean is each head's
mean ``z`` over every position after the opening token of the same stories (or one given: the causal
pass's, so that AtP and the exact effect replace the output by the same vector).

:func:`audit` checks AtP against it where a reader would look: the ``k`` heads with the largest
``|atp_mean|`` and ``|atp_zero|`` and ``k`` heads drawn at random (seeded) from the rest, each with its
exact effect beside the estimate and both errors; Spearman's rho between the two over the audited
heads; and the heads where they disagree in sign beyond their errors (each more than two standard
errors from zero, of opposite signs: AtP's failures, saturation and cancellation, Kramár et al. 2024).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from storylens.core.batching import BATCH_TOKENS, length_batches
from storylens.core.errors import StorylensError
from storylens.core.figures import known
from storylens.core.heads import Head
from storylens.core.modes import eval_mode
from storylens.core.plain import Plain
from storylens.core.progress import ProgressLines
from storylens.effects.ablation import _pad, head_output_means
from storylens.effects.attribution import CausalAccumulator
from storylens.effects.cost import (
    TRUTH_BUDGET,
    TRUTH_FLOOR_FLOPS,
    AblationCost,
    block_flops,
    effect_text,
    head_flops,
    scoring_flops,
)
from storylens.engine.accumulate import RatioAccumulator
from storylens.engine.encode import BATCH_STORIES, EncodedStory
from storylens.engine.gradients import GRAPH_BYTES
from storylens.engine.ranks import rank_correlation
from storylens.engine.record import record
from storylens.lm import AttentionLM, Hook

MODES = ("mean", "zero")
AUDIT_HEADS = 8  # k: the top k by |AtP| and k drawn at random


@dataclass(frozen=True)
class Effect(Plain):
    """A change in the mean next-token loss (nats) with its standard error over stories."""

    nats: float
    se: float


def story_losses(lm: AttentionLM, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64: each story's summed next-token loss over its predicted tokens."""
    logits = lm.forward(ids)
    assert logits is not None
    dtype = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(logits[:, :-1].to(dtype).transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T - 1]
    scored = valid[:, 1:]  # position t predicts t + 1, a real token
    return (ce * scored).sum(-1).to(torch.float64).cpu()


def _replacer(head: int, value: torch.Tensor | None) -> Callable[[torch.Tensor, Hook], torch.Tensor]:
    def replace(z: torch.Tensor, hook: Hook) -> torch.Tensor:  # [batch, pos, head, d]
        z = z.clone()
        z[:, 1:, head] = 0.0 if value is None else value.to(device=z.device, dtype=z.dtype)
        return z

    return replace


@torch.inference_mode()
def exact_effects(
    lm: AttentionLM,
    stories_ids: Sequence[Sequence[int]],
    heads: Sequence[Head],
    modes: Sequence[str] = MODES,
    *,
    means: torch.Tensor | None = None,
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
) -> dict[tuple[Head, str], Effect]:
    """Each head's exact effect per mode (see the module docstring): ``1 + len(heads) * len(modes)``
    forward passes a batch of stories. ``means``: ``[layer, head, head_size]`` (default: over these
    stories, positions after the opening token). ``on_batch(stories)`` after each batch."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise StorylensError(f"modes: {', '.join(bad)} not one of {', '.join(MODES)}")
    if not stories_ids or any(len(s) < 2 for s in stories_ids):
        raise StorylensError("stories: each needs at least two tokens (one predicted)")
    if "mean" in modes and means is None:
        means = head_output_means(lm, stories_ids, batch_size=batch_size, include_marker=False)
    accs = {(h, m): RatioAccumulator(()) for h in heads for m in modes}
    with eval_mode(lm.module):
        for idx in length_batches([len(s) for s in stories_ids], batch_size, BATCH_TOKENS):
            ids, valid = _pad([stories_ids[i] for i in idx], lm.marker_id, lm.device)
            tokens = valid[:, 1:].sum(-1).to(torch.float64).cpu()
            clean = story_losses(lm, ids, valid)
            for h in heads:
                for m in modes:
                    value = None if m == "zero" else means[h.layer, h.head]  # type: ignore[index]
                    with lm.hooks([(f"blocks.{h.layer}.attn.hook_z", _replacer(h.head, value))]):
                        accs[h, m].add(story_losses(lm, ids, valid) - clean, tokens)
            if on_batch is not None:
                on_batch(len(idx))
    out = {}
    for key, acc in accs.items():
        nats, se = acc.result()
        out[key] = Effect(float(nats), float(se))
    return out


# ---------------------------------------------------------------- the estimates, and the audit


def attribution(
    model: AttentionLM,
    stories: Sequence[str] | Iterable[EncodedStory],
    *,
    batch_size: int = BATCH_STORIES,
    progress: bool = False,
    graph_bytes: int = GRAPH_BYTES,
) -> tuple[dict[str, torch.Tensor | None], CausalAccumulator]:
    """AtP (mean and zero) and DLA of every head of ``model`` over ``stories``: the six columns
    ``{name: [layer, head] float64}`` and the accumulator (its :meth:`CausalAccumulator.z_means` the
    ``mu`` mean ablation replaces each head's output by). One fused forward and backward per batch
    (``graph_bytes``: :func:`~storylens.engine.gradients.gradient_pass`)."""
    acc = CausalAccumulator(model.n_layer, model.n_head, graph_bytes)
    record(model, stories, [acc], batch_size=batch_size, progress=progress, names=frozenset())
    return acc.columns(), acc


@dataclass(frozen=True)
class AuditRow(Plain):
    head: str  # L{block}H{head}
    why: str  # "top" (largest |AtP| in a mode) or "random"
    atp_mean: Effect | None
    exact_mean: Effect
    atp_zero: Effect | None
    exact_zero: Effect | None  # None: not measured (the report measures every head's mean ablation only)


@dataclass(frozen=True)
class Audit(Plain):
    rows: tuple[AuditRow, ...]
    rho_mean: float | None  # Spearman's rho, AtP against exact, over the audited heads
    rho_zero: float | None
    disagree: tuple[tuple[str, str], ...]  # (head, mode): opposite signs, each beyond 2 se from zero
    n_stories: int
    n_tokens: int
    seed: int


def choose_heads(estimates: dict[str, dict[Head, float]], k: int, seed: int) -> tuple[list[Head], list[Head]]:
    """The ``k`` heads with the largest ``|estimate|`` in each mode (in order, once each) and ``k`` drawn
    at random (``seed``) from the others: (top, random), disjoint."""
    if k < 0:
        raise StorylensError(f"audit: k must be 0 or more, got {k}")
    top: list[Head] = []
    every = sorted(next(iter(estimates.values())))
    for values in estimates.values():
        ranked = sorted(every, key=lambda h: (-abs(values[h]) if values[h] == values[h] else 0.0, h))
        top += [h for h in ranked[:k] if h not in top]
    rest = [h for h in every if h not in top]
    return top, random.Random(seed).sample(rest, min(k, len(rest)))


def _sign_disagrees(a: Effect | None, b: Effect | None) -> bool:
    if a is None or b is None or not (a.se == a.se and b.se == b.se):
        return False
    return abs(a.nats) > 2 * a.se and abs(b.nats) > 2 * b.se and (a.nats > 0) != (b.nats > 0)


def audit(
    lm: AttentionLM,
    stories_ids: Sequence[Sequence[int]],
    atp: dict[str, dict[Head, Effect]],
    *,
    k: int = AUDIT_HEADS,
    seed: int = 0,
    means: torch.Tensor | None = None,
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
) -> Audit:
    """AtP (``atp["mean"]``, ``atp["zero"]``: every head's estimate with its error) against exact
    ablation on the heads :func:`choose_heads` picks, over ``stories_ids``."""
    top, drawn = choose_heads({m: {h: e.nats for h, e in v.items()} for m, v in atp.items()}, k, seed)
    heads = top + drawn
    exact = exact_effects(lm, stories_ids, heads, MODES, means=means, batch_size=batch_size, on_batch=on_batch)
    rows = tuple(
        AuditRow(
            h.label,
            "top" if h in top else "random",
            atp.get("mean", {}).get(h),
            exact[h, "mean"],
            atp.get("zero", {}).get(h),
            exact[h, "zero"],
        )
        for h in heads
    )

    tokens = sum(len(s) - 1 for s in stories_ids)
    return _audit_of(rows, len(stories_ids), tokens, seed)


def _audit_of(rows: tuple[AuditRow, ...], n_stories: int, n_tokens: int, seed: int) -> Audit:
    """The audit of ``rows``: rho per mode over the rows measured both ways, the sign disagreements."""

    def rho(mode: str) -> float | None:
        pairs = [(getattr(r, f"atp_{mode}"), getattr(r, f"exact_{mode}")) for r in rows]
        pairs = [(a.nats, b.nats) for a, b in pairs if a is not None and b is not None]
        return rank_correlation([a for a, _ in pairs], [b for _, b in pairs]) if len(pairs) > 2 else None

    disagree = tuple(
        (r.head, m) for r in rows for m in MODES if _sign_disagrees(getattr(r, f"atp_{m}"), getattr(r, f"exact_{m}"))
    )
    return Audit(rows, rho("mean"), rho("zero"), disagree, n_stories, n_tokens, 0 if seed is None else seed)


def audit_every_head(cols: dict, heads: Sequence[Head], n_stories: int, n_tokens: int) -> Audit | None:
    """AtP against the exact effect of every head, both from one scoring pass's columns (``atp_*`` and
    ``exact_*`` with their ``_se``; a mode's exact column absent: not compared); ``why`` "every" on each row.
    None where AtP or the mean-ablation exact effect is missing."""

    def effect(name: str, h: Head) -> Effect | None:
        col, se = cols.get(name), cols.get(name + "_se")
        return None if col is None or se is None else Effect(float(col[h]), float(se[h]))

    if cols.get("atp_mean") is None or cols.get("exact_mean") is None:
        return None
    rows = []
    for h in heads:
        exact = effect("exact_mean", h)
        assert exact is not None
        rows.append(
            AuditRow(h.label, "every", effect("atp_mean", h), exact, effect("atp_zero", h), effect("exact_zero", h))
        )
    return _audit_of(tuple(rows), n_stories, n_tokens, 0)


def effect_cell(e: Effect | None) -> str:
    """An effect for a table cell (:func:`~storylens.effects.cost.effect_text`): a sign only beyond
    two standard errors, else ``no clear effect (...)``; empty for none."""
    return "" if e is None else effect_text(e.nats, e.se)


def sign_words(e: Effect) -> str:
    """An effect in words that never states a sign the error does not support."""
    if not e.se == e.se:
        return f"{e.nats:+.4f} nats (no error: one story)"
    if abs(e.nats) <= 2 * e.se:
        return f"{e.nats:+.4f} ± {e.se:.4f} nats (within two standard errors of zero: no sign)"
    return f"{e.nats:+.4f} ± {e.se:.4f} nats"


# ---------------------------------------------------------------- the audit on the first stories, and its cost


def audit_passes(lm: AttentionLM, heads: int) -> tuple[int, int]:
    """What an audit of ``heads`` heads runs per token: (blocks, output heads). AtP on the stories (a
    forward, every block but the last run again, and a backward pass counted as two forwards:
    :mod:`storylens.engine.gradients`), the unablated losses, and each head in each of
    :data:`MODES` through the whole model (:func:`exact_effects` runs every block)."""
    L = lm.n_layer
    return (4 * L - 1) + L + len(MODES) * heads * L, 3 + 1 + len(MODES) * heads


def audit_cost(lm: AttentionLM, lengths: Sequence[int], heads: int) -> AblationCost:
    """An audit of ``heads`` heads over stories of ``lengths`` tokens, counted before it starts, as
    :func:`~storylens.effects.cost.ablate_cost` counts ``storylens ablate``."""
    blocks, outputs = audit_passes(lm, heads)
    flops = sum(lengths) * (blocks * block_flops(lm) + outputs * head_flops(lm))
    return AblationCost(passes=blocks / lm.n_layer, flops=flops, scoring=scoring_flops(lm, lengths))


def audit_budget_stories(
    lm: AttentionLM,
    lengths: Sequence[int],
    heads: int,
    scoring_tokens: float,
    *,
    budget: float = TRUTH_BUDGET,
    floor_flops: float = TRUTH_FLOOR_FLOPS,
) -> int:
    """How many of the first stories (``lengths``: the candidates' tokens, in order) an audit of
    ``heads`` heads runs on by default: the most whose :func:`audit_cost` fits the report's
    ablation budget, ``max(budget x the scoring pass over scoring_tokens tokens, floor_flops)``
    (:func:`~storylens.table.truth.truth_budget_stories`), and at least one."""
    if not lengths:
        return 0
    allowed = max(budget * lm.n_layer * scoring_tokens * block_flops(lm), floor_flops)
    n, work = 0, 0.0
    for t in lengths:
        work += audit_cost(lm, [t], heads).flops
        if work > allowed:
            break
        n += 1
    return max(1, n)


def audit_stories(
    lm: AttentionLM,
    stories: Sequence[EncodedStory],
    *,
    k: int = AUDIT_HEADS,
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = False,
) -> Audit | None:
    """The audit the report runs (:func:`audit`) on ``stories``: AtP recomputed on them (so that AtP
    and the exact effect replace a head's output by the same mean), then the chosen heads ablated
    exactly. None when no story predicts a token or the model's heads cannot be reached."""
    chosen = [e for e in stories if len(e.ids) >= 2]
    if not chosen:
        return None
    cols, acc = attribution(lm, chosen, batch_size=batch_size)
    heads = list(Head.every(lm.n_layer, lm.n_head))
    estimates = {}
    for mode in MODES:
        est, se = cols[f"atp_{mode}"], cols[f"atp_{mode}_se"]
        if est is None or se is None:
            return None  # the model's heads could not be reached
        estimates[mode] = {h: Effect(float(est[h]), float(se[h])) for h in heads}
    lines = ProgressLines("auditing AtP against exact ablation", len(chosen), enabled=progress)
    ids = [e.ids for e in chosen]
    return audit(lm, ids, estimates, k=k, seed=seed, means=acc.z_means(), batch_size=batch_size, on_batch=lines.update)


AUDIT_CSV = (
    "head",
    "chosen",
    *(f"{kind}_{m}{se}" for m in MODES for kind in ("atp", "exact") for se in ("", "_se")),
)


def audit_csv_rows(a: Audit) -> list[dict]:
    """audit.csv's rows (:data:`AUDIT_CSV`): each audited head, why it was chosen, AtP and the exact
    effect per mode with their standard errors (nats; empty where there is none)."""
    out = []
    for r in a.rows:
        row: dict = {"head": r.head, "chosen": r.why}
        for m in MODES:
            for kind in ("atp", "exact"):
                e = getattr(r, f"{kind}_{m}")
                row[f"{kind}_{m}"] = "" if e is None or not known(e.nats) else repr(e.nats)
                row[f"{kind}_{m}_se"] = "" if e is None or not known(e.se) else repr(e.se)
        out.append(row)
    return out


def audit_lines(a: Audit) -> list[str]:
    """The audit as a short table for a terminal: rho per mode, the disagreements, each head."""

    def rho(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    out = [
        f"AtP audited by exact ablation on {a.n_stories} stories ({a.n_tokens:,} predicted tokens, seed {a.seed}): "
        f"Spearman's rho {rho(a.rho_mean)} (mean), {rho(a.rho_zero)} (zero); nats of mean loss, ± one standard error",
        "  " + "  ".join(f"{c:>34}" if i > 1 else f"{c:<6}" for i, c in enumerate(
            ["head", "chosen", "AtP, mean", "exact, mean", "AtP, zero", "exact, zero"])),
    ]  # fmt: skip
    for r in a.rows:
        cells = [effect_cell(r.atp_mean), effect_cell(r.exact_mean), effect_cell(r.atp_zero), effect_cell(r.exact_zero)]
        out.append(f"  {r.head:<6}  {r.why:<6}  " + "  ".join(f"{c:>34}" for c in cells))
    if a.disagree:
        out.append(
            "  AtP and exact disagree in sign beyond their errors: " + ", ".join(f"{h} ({m})" for h, m in a.disagree)
        )
    return out
