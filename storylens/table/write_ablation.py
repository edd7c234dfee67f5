"""Where heads look against what they write: the LOCOS comparison (arXiv 2607.01002) on the name task. The heads
ranked by attention mass on the name (the name detector) and by what they write toward the name from the name
(:mod:`storylens.effects.writes`); the top ``k`` of each ranking mean-ablated together, and the loss on the
name's tokens (the positions ``storylens ablate`` scores) measured with and without them, story by story, so
that each increase, and the difference between the two rankings' increases, has a standard error over stories.
It ranks heads by both wings' columns, so it sits above both."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from storylens.core.errors import StorylensError
from storylens.core.figures import csv_cell
from storylens.core.heads import Head
from storylens.core.schema import check_schema, schema, versioned
from storylens.effects.ablation import Condition, ablation_story_losses, group_label, head_output_means
from storylens.effects.writes import WRITE_COLUMNS, WriteScores, top_heads, write_scores
from storylens.engine.accumulate import RatioAccumulator
from storylens.engine.encode import EncodedStory
from storylens.engine.ranks import rank_correlation
from storylens.lm import AttentionLM
from storylens.table.scores import score_heads
from storylens.viz.figures import save_figure
from storylens.viz.writes import writes_figure

RANKINGS = ("write", "mass")  # write_name; name_mass


@dataclass(frozen=True)
class Cut:
    """The top ``k`` heads of one ranking mean-ablated together: the change in the mean loss on the name's
    tokens and on every other token (nats per token, pooled over stories) with standard errors."""

    ranking: str
    k: int
    heads: tuple[Head, ...]
    name_increase: float
    name_increase_se: float
    other_increase: float
    other_increase_se: float


@dataclass(frozen=True)
class WriteComparison:
    """:class:`WriteScores` beside the name mass, their rank agreement, and the ablation of each ranking's top
    ``k`` (``cuts``, both rankings for each ``k``) with ``write - mass`` per ``k`` (``differences``: the paired
    difference of the name-loss increases and its standard error over stories)."""

    writes: WriteScores
    name_mass: torch.Tensor  # [layer, head]
    spearman: float
    cuts: tuple[Cut, ...]
    differences: tuple[tuple[int, float, float], ...]  # (k, write - mass, se)
    baseline_name_loss: float
    stories: int
    name_positions: int
    mode: str

    def cut(self, ranking: str, k: int) -> Cut:
        return next(c for c in self.cuts if c.ranking == ranking and c.k == k)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    rho = rank_correlation(a.flatten().tolist(), b.flatten().tolist())
    return math.nan if rho is None else float(rho)


def _increase(cond: torch.Tensor, base: torch.Tensor, counts: torch.Tensor, col: int) -> tuple[float, float]:
    """The pooled change per position of kind ``col`` (0 name, 1 other) and its standard error over stories."""
    acc = RatioAccumulator()
    acc.add(cond[:, col] - base[:, col], counts[:, col])
    mean, se = acc.result()
    return float(mean), float(se)


def compare_writes(
    lm: AttentionLM,
    stories: Sequence[EncodedStory],
    *,
    ks: Sequence[int] = (1, 2, 4, 8),
    mode: str = "mean",
    batch_size: int = 8,
    progress: bool = False,
) -> WriteComparison:
    """The comparison over ``stories`` (encoded, e.g. the quiz's): the write-aware scores, the name mass
    (:func:`~storylens.table.scores.score_heads`), and ``len(ks) * 2`` ablations, each one forward over the
    stories with a main character (``progress``: a bar for each of the three passes)."""
    n_heads = lm.n_layer * lm.n_head
    if not ks or any(not 1 <= k <= n_heads for k in ks):
        raise StorylensError(f"ks: each k from 1 to the model's {n_heads} heads (got {list(ks)})")
    with tqdm(total=len(stories), unit="story", desc="write scores", disable=None if progress else True) as bar:
        writes = write_scores(lm, stories, batch_size=batch_size, progress=bar.update)
    column = score_heads(lm, list(stories), batch_size=batch_size, faithful=False, progress=progress).column(
        "name_mass"
    )
    mass = torch.tensor([math.nan if v is None else v for v in column], dtype=torch.float64).view(lm.n_layer, -1)
    kept = [s for s in stories if s.mention_starts]
    plan = [
        (r, k, Condition(f"{r}{k}", tuple(top_heads(writes.name if r == "write" else mass, k)), mode))
        for k in ks
        for r in RANKINGS
    ]
    conditions = [c for _, _, c in plan]
    means = head_output_means(lm, [s.ids for s in stories], batch_size=batch_size) if mode == "mean" else None
    sums, counts = ablation_story_losses(
        lm,
        [s.ids for s in kept],
        [s.mention_starts for s in kept],
        conditions,
        means=means,
        batch_size=batch_size,
        progress=progress,
    )
    base = sums["baseline"]
    cuts = []
    for ranking, k, c in plan:
        cond = sums[f"{c.label}/{c.mode}"]
        name, other = _increase(cond, base, counts, 0), _increase(cond, base, counts, 1)
        cuts.append(Cut(ranking, k, c.heads, *name, *other))
    diffs = tuple((k, *_increase(sums[f"write{k}/{mode}"], sums[f"mass{k}/{mode}"], counts, 0)) for k in ks)
    return WriteComparison(
        writes=writes,
        name_mass=mass,
        spearman=_agreement(writes.name, mass),
        cuts=tuple(cuts),
        differences=diffs,
        baseline_name_loss=float(base[:, 0].sum() / counts[:, 0].sum()),
        stories=len(kept),
        name_positions=int(counts[:, 0].sum()),
        mode=mode,
    )


def describe(result: WriteComparison) -> list[str]:
    """The comparison in a few lines, as ``storylens writes`` prints it."""
    lines = [
        f"write-aware vs attention-mass ranking: Spearman {result.spearman:+.3f} over every head; "
        f"name loss {result.baseline_name_loss:.3f} nats before any ablation ({result.name_positions} name tokens, "
        f"{result.stories} stories)"
    ]
    for k, d, se in result.differences:
        w, m = result.cut("write", k), result.cut("mass", k)
        lines.append(
            f"  top {k:>3} {result.mode}-ablated: by write {w.name_increase:+.3f} ± {w.name_increase_se:.3f} "
            f"({group_label(w.heads)[:40]}), by mass {m.name_increase:+.3f} ± {m.name_increase_se:.3f} "
            f"({group_label(m.heads)[:40]}); write - mass {d:+.3f} ± {se:.3f}"
        )
    return lines


WRITES_CSV = ("head", "layer", "index", "name_mass", *WRITE_COLUMNS, "rank_write", "rank_mass")


def _clean(x: float) -> float | None:
    return x if math.isfinite(x) else None


def writes_document(result: WriteComparison, model: str) -> dict:
    """writes.json's document (``storylens/schemas/writes.schema.json``): NaN as null."""
    w = result.writes
    L, H = w.name.shape
    heads = [
        {"head": Head(layer, h).label, "name_mass": _clean(float(result.name_mass[layer, h]))}
        | {c: _clean(float(v[layer, h])) for c, v in w.columns().items()}
        for layer in range(L)
        for h in range(H)
    ]
    return versioned(
        {
            "model": model,
            "mode": result.mode,
            "stories": result.stories,
            "queries": w.queries,
            "name_positions": result.name_positions,
            "baseline_name_loss": result.baseline_name_loss,
            "spearman": _clean(result.spearman),
            "heads": heads,
            "cuts": [
                {"ranking": c.ranking, "k": c.k, "heads": [h.label for h in c.heads]}
                | {
                    f: _clean(getattr(c, f))
                    for f in ("name_increase", "name_increase_se", "other_increase", "other_increase_se")
                }
                for c in result.cuts
            ],
            "differences": [{"k": k, "write_minus_mass": d, "se": _clean(se)} for k, d, se in result.differences],
        }
    )


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """1 for the largest (NaN last), block-major ties."""
    flat = torch.nan_to_num(values.flatten(), nan=-math.inf)
    order = torch.argsort(flat, descending=True, stable=True)
    out = torch.empty_like(order)
    out[order] = torch.arange(1, len(order) + 1)
    return out


def write_writes(result: WriteComparison, model: str, folder: Path) -> dict:
    """writes.json, writes.csv (one row per head) and writes.png / writes.svg into ``folder``; the document."""
    doc = writes_document(result, model)
    check_schema(doc, schema("writes"), "writes.json")
    (folder / "writes.json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    rw, rm = _ranks(result.writes.name), _ranks(result.name_mass)
    with open(folder / "writes.csv", "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(WRITES_CSV)
        for i, row in enumerate(doc["heads"]):
            cells = [row[c] for c in ("name_mass", *WRITE_COLUMNS)]
            layer, h = divmod(i, result.writes.name.shape[1])
            out.writerow((row["head"], layer, h, *(csv_cell(x) for x in cells), int(rw[i]), int(rm[i])))
    fig = writes_figure(doc, title=f"storylens writes: {model}")
    save_figure(fig, folder / "writes")
    return doc
