"""Activation patching on a task of the user's own: what each head carries from clean to corrupt.

A task is a file of pairs, one JSON object a line::

    {"clean": "Lily and Tom went to the park. Tom gave a ball to",
     "corrupt": "Anna and Ben went to the park. Sam gave a ball to",
     "answer": " Lily", "wrong": " Tom"}

The metric is ``logit(answer) - logit(wrong)`` at the last position. The effect of a head is the
effect of *noising* it: the clean run with that head's output ``z`` (``blocks.{l}.attn.hook_z``,
``[batch, pos, head, d_head]``, before the output projection, so the edit is one head's alone)
taken from the corrupt run at every position, minus the clean metric.

* ``atp``: attribution patching, the first-order estimate ``(z_corrupt - z_clean) . dmetric/dz``
  on the clean run, for every head from one corrupt forward, one clean forward and one backward.
* ``exact``: the patched forward pass itself, one per head, batched over pairs; a head in block
  ``l`` starts at block ``l`` from the clean run's block ``l - 1`` output
  (:meth:`~storylens.lm.hooks.AttentionLM.skip_blocks`).

Every figure is a mean over pairs with a standard error over pairs (sample sd / sqrt(n)).
``gap_fraction`` is a head's exact effect over ``corrupt - clean``: 1 means the head alone carries
the whole difference between the runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from storylens.core.batching import pad_batch
from storylens.core.errors import StorylensError, UsageError
from storylens.core.figures import bracketed, csv_cell, plus_minus
from storylens.core.frames import to_frame
from storylens.core.heads import Head, head_label
from storylens.core.modes import eval_mode
from storylens.core.plain import Plain
from storylens.core.publish import publish_folder
from storylens.core.schema import check_grid, read_versioned, versioned
from storylens.data.pairs import KEYS, MAX_PAIR_LINE_BYTES, read_pairs  # noqa: F401 (their home before)
from storylens.lm import AttentionLM, Hook, ModelLike, wrap
from storylens.model.tokenizer import text_only
from storylens.viz.patch import patch_html

EXACT_BUDGET = 1000  # heads x pairs patched forward passes run by default; past it, the top K by |atp|
BATCH_PAIRS = 32
# the tasks shipped: the lesson's own behaviour, the main character's name (the default), and indirect objects
NAME_PAIRS = Path(__file__).resolve().parent.parent / "data" / "name_pairs.jsonl"
EXAMPLE_PAIRS = Path(__file__).resolve().parent.parent / "data" / "example_pairs.jsonl"
NAME_PARAPHRASES = NAME_PAIRS.with_name("name_pairs_paraphrased.jsonl")  # the same behaviour in other stories
PAIR_SETS = {
    "names": NAME_PAIRS,
    "names-paraphrased": NAME_PARAPHRASES,
    "indirect-object": EXAMPLE_PAIRS,
}  # --pairs's names for them


# ---------------------------------------------------------------- pairs


@dataclass(frozen=True)
class Pair(Plain):
    """One line of a pairs file (``line`` counted from 1), and its tokens under the model's tokenizer."""

    line: int
    clean: str
    corrupt: str
    answer: str
    wrong: str
    clean_ids: tuple[int, ...] = ()
    corrupt_ids: tuple[int, ...] = ()
    answer_id: int = -1
    wrong_id: int = -1


def encode_pairs(lm: AttentionLM, rows: Sequence[dict], name: str = "pairs") -> list[Pair]:
    """Each row tokenised as storylens feeds text (the marker first) and checked: ``answer`` and
    ``wrong`` one token each, different; ``clean`` and ``corrupt`` of equal token length."""
    tok = text_only(lm.tokenizer)
    pairs = []
    for r in rows:
        where = f"{name}:{r['line']}"
        one = {}
        for k in ("answer", "wrong"):
            ids = tok.encode(r[k], add_special_tokens=False).ids
            if len(ids) != 1:
                raise UsageError(f"{where}: {k} {r[k]!r} is {len(ids)} tokens under the model's tokenizer, not one")
            one[k] = ids[0]
        if one["answer"] == one["wrong"]:
            raise UsageError(f"{where}: answer and wrong are the same token")
        clean, corrupt = lm.encode(r["clean"]), lm.encode(r["corrupt"])
        if len(clean) != len(corrupt):
            raise UsageError(
                f"{where}: clean is {len(clean) - 1} tokens, corrupt {len(corrupt) - 1}; they must be equal"
            )
        if len(clean) > lm.window:
            raise UsageError(f"{where}: {len(clean)} tokens with the marker; the model's window is {lm.window}")
        pairs.append(
            Pair(
                **r, clean_ids=tuple(clean), corrupt_ids=tuple(corrupt), answer_id=one["answer"], wrong_id=one["wrong"]
            )
        )
    return pairs


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class PairMetrics(Plain):
    line: int
    clean: str
    corrupt: str
    answer: str
    wrong: str
    clean_metric: float
    corrupt_metric: float


@dataclass(frozen=True)
class HeadEffect(Plain):
    """One head's noising effect on the metric (mean over pairs, standard error over pairs);
    ``exact`` and ``gap_fraction`` are None where the head was not patched exactly."""

    head: str
    layer: int  # from 0
    index: int  # the head within its block, from 0
    atp: float
    atp_se: float
    exact: float | None
    exact_se: float | None
    gap_fraction: float | None
    estimate: float | None = None  # --estimator's (storylens.effects.estimators), None without it
    estimate_se: float | None = None
    backup_gain: float | None = None  # --backups K: its effect with the K off, less alone (None: not measured)
    backup_gain_se: float | None = None


@dataclass(frozen=True)
class PatchBackups(Plain):
    """``patch --backups K``: the K heads of largest |exact| patched together; ``joint`` their effect on the
    metric, ``separate`` their single effects summed, ``repair`` = separate - joint (mean over pairs, standard
    error over pairs; storylens.effects.backups)."""

    removed: tuple[str, ...]
    joint: float
    joint_se: float
    separate: float
    separate_se: float
    repair: float
    repair_se: float


@dataclass(frozen=True)
class PatchResult(Plain):
    model: str
    pairs: int
    n_layer: int
    n_head: int
    metric: str
    clean_metric: float
    clean_metric_se: float
    corrupt_metric: float
    corrupt_metric_se: float
    exact_heads: int
    spearman: float | None  # atp vs exact over the heads patched exactly
    heads: tuple[HeadEffect, ...]
    per_pair: tuple[PairMetrics, ...]
    estimator: str | None = None  # --estimator: which (None: none beside AtP)
    estimate_spearman: float | None = None  # the estimator vs exact over the heads patched exactly
    backups: PatchBackups | None = None  # --backups K: the K patched together, what the model repairs

    def to_pandas(self, what: str = "heads"):
        """A ``pandas.DataFrame``: ``"heads"``, one row per head with patch.csv's columns (``exact``,
        ``exact_se`` and ``gap_fraction`` NaN where a head was not patched exactly); ``"pairs"``, one row
        per pair (its line, texts and both metrics). Needs pandas (``storylens[pandas]``)."""
        if what == "heads":
            return to_frame([h.to_dict() for h in self.heads], CSV_COLUMNS)
        if what == "pairs":
            return to_frame([p.to_dict() for p in self.per_pair], [f.name for f in fields(PairMetrics)])
        raise ValueError(f"to_pandas: {what!r} is not 'heads' or 'pairs'")


def mean_se(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard error over dim 0 (sample sd / sqrt(n); 0 for one pair)."""
    n = x.shape[0]
    se = x.std(0, unbiased=True) / math.sqrt(n) if n > 1 else torch.full_like(x[0], float("nan"))  # one: not known
    return x.mean(0), se


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho (average ranks for ties); None under three values or a constant side."""
    if len(a) < 3:
        return None

    def ranks(v: Sequence[float]) -> torch.Tensor:
        t = torch.tensor(v, dtype=torch.float64)
        return (t[:, None] > t[None, :]).sum(1).double() + ((t[:, None] == t[None, :]).sum(1).double() - 1) / 2

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else None


# ---------------------------------------------------------------- one batch of pairs


@dataclass
class PairBatch:
    """Pairs padded at the end (causal: padding never reaches a real position)."""

    clean: torch.Tensor  # [batch, pos]
    corrupt: torch.Tensor  # [batch, pos]
    last: torch.Tensor  # [batch] the last real position
    answer: torch.Tensor  # [batch]
    wrong: torch.Tensor  # [batch]


def pairs_digest(pairs: Sequence[Pair]) -> str:
    """A digest of ``pairs``' tokens and answers, in order: edge scores and the exact runs on the same pairs agree on it (:meth:`~storylens.circuits.edges.EdgeScores.clean_for`)."""
    h = hashlib.sha256()
    for p in pairs:
        h.update(repr((p.clean_ids, p.corrupt_ids, p.answer_id, p.wrong_id)).encode())
    return h.hexdigest()


def pair_batches(lm: AttentionLM, pairs: Sequence[Pair], size: int = BATCH_PAIRS) -> list[PairBatch]:
    out = []
    for i in range(0, len(pairs), size):
        chunk = pairs[i : i + size]
        clean, lengths = pad_batch([p.clean_ids for p in chunk], lm.marker_id, lm.device)
        corrupt, _ = pad_batch([p.corrupt_ids for p in chunk], lm.marker_id, lm.device)
        answer = torch.tensor([p.answer_id for p in chunk], device=lm.device)
        wrong = torch.tensor([p.wrong_id for p in chunk], device=lm.device)
        out.append(PairBatch(clean, corrupt, lengths - 1, answer, wrong))
    return out


def pair_metric(logits: torch.Tensor, b: PairBatch) -> torch.Tensor:
    """``logit(answer) - logit(wrong)`` at each pair's last position: ``[batch]``, from the logits ``[batch, pos,
    vocab]`` or those at the last positions alone ``[batch, 1, vocab]`` (:class:`PairMetric`)."""
    rows = logits[:, 0] if logits.shape[1] == 1 else logits[torch.arange(logits.shape[0], device=logits.device), b.last]
    return rows.gather(1, b.answer[:, None])[:, 0] - rows.gather(1, b.wrong[:, None])[:, 0]


class PairMetric:
    """:func:`pair_metric` on ``b``, a metric that says where it reads the logits: ``at`` ``[batch]``, each pair's
    last position (so the output head runs there alone: :meth:`~storylens.lm.AttentionLM.forward`)."""

    def __init__(self, b: PairBatch):
        self.b, self.at = b, b.last

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return pair_metric(logits, self.b)


def _hook_names(lm: AttentionLM) -> list[str]:
    return [f"blocks.{i}.attn.hook_z" for i in range(lm.n_layer)]


@torch.no_grad()
def _run_keep(lm: AttentionLM, ids: torch.Tensor, b: PairBatch) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """One unpatched pass: the metric ``[batch]``, every block's ``z`` ``[batch, pos, head, d_head]``
    and what every block returned (for :meth:`~storylens.lm.hooks.AttentionLM.skip_blocks`)."""
    zs: dict[int, torch.Tensor] = {}

    def keep(z: torch.Tensor, hook: Hook) -> None:
        zs[hook.layer] = z.detach().clone()

    with lm.keep_block_outputs(range(lm.n_layer)) as kept, lm.hooks([(n, keep) for n in _hook_names(lm)]):
        logits = lm.forward(ids, logits=b.last)  # the output head at the last positions alone
        assert logits is not None
        metric = pair_metric(logits, b).double()
    if len(zs) != lm.n_layer:
        raise StorylensError(
            f"{lm.name}: hook_z fired in {len(zs)} of {lm.n_layer} blocks; its heads cannot be reached"
        )
    return metric, [zs[i] for i in range(lm.n_layer)], dict(kept)


def _atp(lm: AttentionLM, b: PairBatch, z_corrupt: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean metric ``[batch]`` and ``[batch, layer, head]``: ``(z_corrupt - z_clean) . dmetric/dz`` on the clean run. Each ``z`` gets a
    zero leaf added (``z + delta``), so the gradient on ``delta`` is the metric's total derivative in
    ``z`` (through every later block); no weight gradient is asked for."""
    zs: dict[int, torch.Tensor] = {}
    deltas: dict[int, torch.Tensor] = {}

    def add(z: torch.Tensor, hook: Hook) -> torch.Tensor:
        delta = torch.zeros_like(z, requires_grad=True)
        zs[hook.layer], deltas[hook.layer] = z.detach(), delta
        return z + delta

    with torch.enable_grad(), lm.hooks([(n, add) for n in _hook_names(lm)]):
        logits = lm.forward(b.clean, logits=b.last)
        assert logits is not None
        if len(deltas) != lm.n_layer:
            raise StorylensError(
                f"{lm.name}: hook_z fired in {len(deltas)} of {lm.n_layer} blocks; its heads cannot be reached"
            )
        metric = pair_metric(logits, b)
        grads = torch.autograd.grad(metric.sum(), [deltas[i] for i in range(lm.n_layer)])
    out = [
        torch.einsum("bphd,bphd->bh", (zc - zs[i]).double(), g.double())  # [batch, head]
        for i, (zc, g) in enumerate(zip(z_corrupt, grads, strict=True))
    ]
    return metric.detach().double(), torch.stack(out, 1)  # [batch], [batch, layer, head]


@torch.no_grad()
def _exact(lm: AttentionLM, b: PairBatch, heads: Sequence[Head], z_corrupt, kept, clean_metric) -> torch.Tensor:
    """``[batch, len(heads)]``: the clean run with one head's ``z`` from the corrupt run at every
    position, minus the clean metric; a head in block ``l`` starts from block ``l - 1``'s clean output."""
    out = torch.empty(b.clean.shape[0], len(heads), dtype=torch.float64, device=b.clean.device)
    for j, (layer, head) in enumerate(heads):

        def patch(z: torch.Tensor, hook: Hook, layer: int = layer, head: int = head) -> torch.Tensor:
            z = z.clone()
            z[:, :, head] = z_corrupt[layer][:, :, head]
            return z

        with (
            lm.skip_blocks(layer, kept[layer - 1]) if layer > 0 else contextlib.nullcontext(),
            lm.hooks([(f"blocks.{layer}.attn.hook_z", patch)]),
        ):
            logits = lm.forward(b.clean, logits=b.last)
        assert logits is not None
        out[:, j] = pair_metric(logits, b).double() - clean_metric
    return out


# ---------------------------------------------------------------- every head


def exact_heads(atp: torch.Tensor, exact: str | int | None, n_pairs: int) -> list[Head]:
    """Which heads are patched exactly: ``"all"``; ``K`` (the top K by |mean atp|); None: all while
    heads x pairs <= :data:`EXACT_BUDGET`, else the top ``EXACT_BUDGET // pairs``."""
    L, H = atp.shape
    order = [Head(int(i) // H, int(i) % H) for i in torch.argsort(atp.abs().flatten(), descending=True, stable=True)]
    if exact == "all" or (exact is None and L * H * n_pairs <= EXACT_BUDGET):
        k = L * H
    elif exact is None:
        k = max(1, EXACT_BUDGET // n_pairs)
    else:
        k = int(exact)
        if k < 0:
            raise UsageError(f"--exact: {k} heads; give all or a number from 0")
    return sorted(order[: min(k, L * H)])


def patch_heads(
    model: ModelLike,
    pairs: Sequence[Pair],
    *,
    exact: str | int | None = None,
    progress=None,
) -> PatchResult:
    """Every head's noising effect on the pairs' metric: AtP for every head, exact for the heads
    :func:`exact_heads` picks (an estimator beside them and the backups: :mod:`storylens.effects.patch_more`).
    ``pairs`` from :func:`encode_pairs`;
    ``progress(n)`` is told of each batch of pairs done (twice: once for AtP, once for exact)."""
    lm = wrap(model)
    if not pairs:
        raise StorylensError("pairs: nothing to run")
    batches = pair_batches(lm, pairs)
    clean_m, corrupt_m, atp = [], [], []
    with eval_mode(lm.module):
        for b in batches:  # AtP: one corrupt forward, one clean forward and one backward
            m_corrupt, z_corrupt, _ = _run_keep(lm, b.corrupt, b)
            m_clean, atp_b = _atp(lm, b, z_corrupt)
            clean_m.append(m_clean)
            corrupt_m.append(m_corrupt)
            atp.append(atp_b)
            if progress:
                progress(len(b.last))
        atp_all = torch.cat(atp).cpu()  # [pair, layer, head]
        atp_mean, atp_se = mean_se(atp_all)
        chosen = exact_heads(atp_mean, exact, len(pairs))
        effects = []
        for b in batches if chosen else []:  # exact: one forward per head, batched over pairs
            m_corrupt, z_corrupt, _ = _run_keep(lm, b.corrupt, b)
            m_clean, _, kept = _run_keep(lm, b.clean, b)
            effects.append(_exact(lm, b, chosen, z_corrupt, kept, m_clean))
            if progress:
                progress(len(b.last))
    clean, corrupt = torch.cat(clean_m).cpu(), torch.cat(corrupt_m).cpu()
    exact_all = torch.cat(effects).cpu() if effects else torch.zeros(len(pairs), 0, dtype=torch.float64)
    return _result(lm, pairs, clean, corrupt, atp_mean, atp_se, chosen, exact_all)


def _result(lm: AttentionLM, pairs, clean, corrupt, atp_mean, atp_se, chosen, exact_all) -> PatchResult:  # noqa: PLR0913
    c_mean, c_se = mean_se(clean)
    k_mean, k_se = mean_se(corrupt)
    gap = float(k_mean - c_mean)
    ex_mean, ex_se = mean_se(exact_all) if exact_all.shape[1] else (exact_all[0], exact_all[0])
    exact_of = {h: (float(ex_mean[j]), float(ex_se[j])) for j, h in enumerate(chosen)}
    heads = []
    for layer in range(lm.n_layer):
        for head in range(lm.n_head):
            e = exact_of.get(Head(layer, head))
            heads.append(
                HeadEffect(
                    head=head_label(layer, head),
                    layer=layer,
                    index=head,
                    atp=float(atp_mean[layer, head]),
                    atp_se=float(atp_se[layer, head]),
                    exact=None if e is None else e[0],
                    exact_se=None if e is None else e[1],
                    gap_fraction=None if e is None or gap == 0 else e[0] / gap,
                )
            )
    both = [(h.atp, h.exact) for h in heads if h.exact is not None]
    return PatchResult(
        model=lm.name,
        pairs=len(pairs),
        n_layer=lm.n_layer,
        n_head=lm.n_head,
        metric="logit(answer) - logit(wrong) at the last position",
        clean_metric=float(c_mean),
        clean_metric_se=float(c_se),
        corrupt_metric=float(k_mean),
        corrupt_metric_se=float(k_se),
        exact_heads=len(chosen),
        spearman=spearman([a for a, _ in both], [e for _, e in both if e is not None]),
        heads=tuple(heads),
        per_pair=tuple(
            PairMetrics(p.line, p.clean, p.corrupt, p.answer, p.wrong, float(c), float(k))
            for p, c, k in zip(pairs, clean, corrupt, strict=True)
        ),
    )


# ---------------------------------------------------------------- files

CSV_COLUMNS = (
    "head",
    "layer",
    "index",
    "atp",
    "atp_se",
    "exact",
    "exact_se",
    "gap_fraction",
    "estimate",
    "estimate_se",
    "backup_gain",
    "backup_gain_se",
)


def patch_csv(result: PatchResult) -> str:
    """One row per head (blocks and heads from 1 in ``head``, from 0 in ``layer``/``index``)."""

    lines = [",".join(CSV_COLUMNS)]
    for h in result.heads:
        lines.append(",".join(csv_cell(getattr(h, c)) for c in CSV_COLUMNS))
    return "\n".join(lines) + "\n"


def patch_json(result: PatchResult) -> str:
    """patch.json: ``schema_version`` first, then the result's fields (``storylens/schemas/patch.schema.json``)."""
    return json.dumps(versioned(result.to_dict()), indent=1, allow_nan=False) + "\n"


def load_patch(folder: str | Path) -> PatchResult:
    """Read back the patch.json ``storylens patch --out FOLDER`` wrote (``FOLDER`` or the file itself)
    as a :class:`PatchResult`; an older run's file, another version or a file missing a key is one
    StorylensError line naming it."""
    path = Path(folder)
    path = path / "patch.json" if path.is_dir() else path
    doc = read_versioned(path, "not a folder storylens patch wrote", "patch")
    names = [f.name for f in fields(PatchResult)]
    if missing := [k for k in names if k not in doc]:
        raise StorylensError(f"{path}: not a storylens patch.json (missing {', '.join(missing)})")
    check_grid([(h["head"], h["layer"], h["index"]) for h in doc["heads"]], doc["n_layer"], doc["n_head"], str(path))
    if len(doc["per_pair"]) != doc["pairs"]:
        raise StorylensError(f"{path}: {len(doc['per_pair'])} pairs listed, but pairs is {doc['pairs']}")
    if (exact := sum(h["exact"] is not None for h in doc["heads"])) != doc["exact_heads"]:
        raise StorylensError(f"{path}: {exact} heads patched exactly, but exact_heads is {doc['exact_heads']}")
    try:
        return PatchResult.from_dict(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StorylensError(f"{path}: not a storylens patch.json ({type(e).__name__}: {e})") from None


def task_verdict(clean: float, se: float | None, pairs: int) -> str:
    """Whether the model does the task, said before anything else: its clean metric (``logit(answer) -
    logit(wrong)``, mean over ``pairs`` pairs, standard error ``se``) above zero beyond two standard errors."""
    figure = f"its clean metric is {clean:+.3f}" + ("" if se is None or not se == se else f" ± {se:.3f}")
    figure += f" over {pairs} pair{'s' if pairs != 1 else ''}"
    if se is None or not se == se or pairs < 2:
        return f"Whether the model does this task is not known: {figure}, with no error from one pair."
    if clean > 2 * se:
        return f"The model does this task: {figure}, above zero beyond two standard errors (it prefers the answer)."
    if clean < -2 * se:
        return (
            f"The model does not do this task: {figure}, below zero beyond two standard errors (it prefers the "
            "wrong token); what its heads do here explains a behaviour the model does not have."
        )
    return f"Whether the model does this task is unclear: {figure}, within two standard errors of zero."


def summary_lines(result: PatchResult, top: int = 10) -> list[str]:
    """Whether the model does the task, the clean and corrupt metrics, and the ``top`` heads of largest
    |effect| (exact where run)."""
    gap = result.corrupt_metric - result.clean_metric
    out = [
        task_verdict(result.clean_metric, result.clean_metric_se, result.pairs),
        f"{result.pairs} pair{'s' * (result.pairs != 1)} on {result.model}; metric: {result.metric}",
        f"clean   {plus_minus(result.clean_metric, result.clean_metric_se, one='pair')}",
        f"corrupt {plus_minus(result.corrupt_metric, result.corrupt_metric_se, one='pair')}   (gap {gap:+.3f})",
        f"exact patching on {result.exact_heads} of {len(result.heads)} heads"
        + ("" if result.spearman is None else f"; Spearman rho (atp vs exact) {result.spearman:.3f}")
        + (
            ""
            if result.estimator is None or result.estimate_spearman is None
            else f"; ({result.estimator} vs exact) {result.estimate_spearman:.3f}"
        ),
        "",
        f"{'head':8} {'exact':>18} {'atp':>18} {'of gap':>8}",
    ]

    def size(h: HeadEffect) -> float:
        return abs(h.exact if h.exact is not None else h.atp)

    def effect(x: float, se: float | None) -> str:  # in brackets where no sign is claimed
        text = bracketed(x, se, one="pair")
        return text if text.startswith("(") else f" {text} "

    for h in sorted(result.heads, key=size, reverse=True)[:top]:
        ex = "" if h.exact is None or h.exact_se is None else effect(h.exact, h.exact_se)
        frac = "" if h.gap_fraction is None else f"{h.gap_fraction:+.2f}"
        frac = f"({frac})" if frac and ex.startswith("(") else frac  # the exact effect's sign unclaimed
        out.append(f"{h.head:8} {ex:>18} {effect(h.atp, h.atp_se):>18} {frac:>8}")
    if result.backups is not None:
        b = result.backups
        gains = sorted((h for h in result.heads if h.backup_gain is not None), key=lambda h: -(h.backup_gain or 0.0))
        out += [
            "",
            f"backups: {', '.join(b.removed)} patched together {effect(b.joint, b.joint_se)}, one at a time summed "
            f"{effect(b.separate, b.separate_se)}, repaired {effect(b.repair, b.repair_se)}",
            "  largest backup gains: "
            + ", ".join(f"{h.head} {effect(h.backup_gain or 0.0, h.backup_gain_se)}" for h in gains[:5]),
        ]
    out += ["", "in brackets: within two standard errors of zero over the pairs (or no error), so no sign is claimed"]
    return out


@torch.no_grad()
def pair_patterns(model: ModelLike, pairs: Sequence[Pair], limit: int = 4) -> list[dict]:
    """For the page: the first ``limit`` pairs' tokens and every head's attention on the clean and the
    corrupt text, ``[layer][head][query][key]`` rounded to 4 decimals."""
    lm = wrap(model)
    out = []
    with eval_mode(lm.module):
        for p in pairs[:limit]:
            entry: dict = {"line": p.line}
            for side, ids in (("clean", p.clean_ids), ("corrupt", p.corrupt_ids)):
                maps = lm.patterns(torch.tensor([ids], device=lm.device))  # per layer [1, head, q, k]
                entry[side] = {
                    "tokens": [lm.decode([i]) for i in ids],
                    "attention": [[[[round(float(x), 4) for x in row] for row in h] for h in m[0]] for m in maps],
                }
            out.append(entry)
    return out


def write_patch(out: str | Path, result: PatchResult, model: ModelLike, pairs: Sequence[Pair]) -> Path:
    """``out/patch.csv``, ``patch.json`` and ``patch.html``, published together (nothing on an error)."""
    verdict = task_verdict(result.clean_metric, result.clean_metric_se, result.pairs)
    page = patch_html(
        result.to_dict(), pair_patterns(model, pairs), title=f"storylens patch: {result.model}", verdict=verdict
    )
    with publish_folder(out, "patch") as tmp:
        (tmp / "patch.csv").write_text(patch_csv(result), encoding="utf-8")
        (tmp / "patch.json").write_text(patch_json(result), encoding="utf-8")
        (tmp / "patch.html").write_text(page, encoding="utf-8")
    return Path(out)
