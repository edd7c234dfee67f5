"""``storylens score``: every head over any corpus, streamed in flat memory, checkpointed, on one
machine or on a Ray cluster. Writes the head table (heads.csv, heads.json), summary.json, the top
examples (examples.json) and explore.html, an offline page to explore them
(:mod:`storylens.viz.explorer`).

Two passes over the source (:mod:`storylens.data.sources`), both streamed:

1. **names**: the lesson's name definition needs the whole set scored (a name is a capitalised
   word whose lower-case form appears nowhere in it), so a first pass builds the
   :class:`~storylens.data.names.NameVocabulary`, a mergeable pair of word sets;
2. **recording**: stories are encoded and batched ``chunk_stories`` at a time, in order (the same
   stories always make the same batches); each batch is run once and every detector streamed
   into one :class:`~storylens.table.accumulator.HeadScoreAccumulator` (float64 sums and counts).

Every ``checkpoint_every`` batches (at the end of a chunk) the merged sums, counts and the number of
stories done are written atomically beside ``out``; ``resume=True`` skips those stories and goes on,
so an interrupted run ends with the same numbers as an uninterrupted one. With ``engine="ray"``
the chunks go to a pool of Ray actors instead (:mod:`storylens.corpus.ray_engine`) and their sums are merged.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from storylens.core.errors import StorylensError, UsageError
from storylens.core.progress import ProgressLines, progress_command
from storylens.core.publish import publish_folder, write_text_atomic
from storylens.corpus.ray_engine import score_with_ray
from storylens.corpus.summary import NAME_DEFINITION, EngineInfo, NamesInfo, ScoreSummary, TopHead
from storylens.data.names import NameVocabulary
from storylens.data.sources import StorySource
from storylens.effects.ablation import head_output_means
from storylens.effects.audit import AUDIT_CSV, Audit, audit_budget_stories, audit_cost, audit_csv_rows, audit_stories
from storylens.effects.backups import BACKUP_STORIES, Backups, backup_effects, top_heads
from storylens.effects.cost import ABLATION_LIMIT_FLOPS, OVER_BUDGET_FLAG, block_flops, check_ablation_budget
from storylens.effects.estimators import ESTIMATORS, IG_STEPS, EstimatorAudit, audits_of, estimate_cost
from storylens.effects.exact import EXACT_MODES, LENGTH_STORIES, ExactPlan, exact_cost, exact_info, fitting_stories
from storylens.engine.encode import BATCH_STORIES, CHUNK_STORIES, EncodedStory, encode_stories
from storylens.engine.gradients import GRAPH_BYTES
from storylens.engine.record import Counter, RecordStats, record
from storylens.lm import AttentionLM
from storylens.looking.detectors import BUILTIN_DETECTORS, Detector
from storylens.table.accumulator import HeadScoreAccumulator
from storylens.table.run_info import StoriesInfo, model_info
from storylens.table.scores import HeadScores, score_table
from storylens.table.truth import TRUTH_STORIES
from storylens.viz.explorer import write_explorer_for
from storylens.viz.tokens import token_text

CHECKPOINT_SUFFIX = ".checkpoint.json"


EXAMPLES = 8  # queries kept per head and detector, where it fires most (examples.json)


# examples kept in all (heads x detectors x K), each about 1 KB in memory and again in examples.json
# and explore.html (0.74 KB held, 0.62 KB of JSON: the shipped model, K = 200): about 0.5 GB at most,
# and room for the default K on a model of 80 x 64 heads (286,720)
EXAMPLES_BUDGET = 500_000


def check_graph_memory(mb) -> None:
    """``--graph-memory MB``: a whole number of MiB, 0 or more (0: one block's activations at a time)."""
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        raise UsageError(f"--graph-memory: a whole number of MiB, 0 or more (got {mb!r})")


def check_examples(k, heads: int | None = None, detectors: int | None = None) -> None:
    """``k`` examples per head and detector: a whole number, 0 or more, and (given the model's
    ``heads`` and the ``detectors``) within :data:`EXAMPLES_BUDGET` kept in all."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise UsageError(f"--examples: a whole number, 0 or more (got {k!r})")
    if heads is not None and detectors is not None and k * heads * detectors > EXAMPLES_BUDGET:
        raise UsageError(
            f"--examples {k:,}: {heads:,} heads x {detectors} detectors x {k:,} = {k * heads * detectors:,} "
            f"examples, past the budget of {EXAMPLES_BUDGET:,} kept in all (about 1 KB each in memory, and "
            f"again in examples.json and explore.html); at most {EXAMPLES_BUDGET // (heads * detectors):,} here"
        )


def write_examples(examples, lm: AttentionLM, path: Path) -> Path:
    """examples.json: the kept queries with their tokens as text (:func:`storylens.viz.tokens.token_text`)."""
    return examples.to_json(path, lambda i: token_text(lm.tokenizer, i))


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + CHECKPOINT_SUFFIX)


def first_pass(source, *, progress: bool = True):
    """The name vocabulary of every story in ``source`` and how many there are (streamed)."""
    vocab, n = NameVocabulary(), 0
    lines = ProgressLines("first pass: names", None, enabled=progress)  # off a terminal, instead of the bar
    for text in tqdm(source, unit="story", desc="first pass: names", disable=None if progress else True):
        vocab.add(text)
        n += 1
        lines.update()
    if n == 0:
        raise StorylensError(f"{source.describe()}: no stories")
    return vocab, n


def _fingerprint(lm: AttentionLM, source: StorySource, names: frozenset[str], settings: dict) -> dict:
    digest = hashlib.sha256("\n".join(sorted(names)).encode("utf-8")).hexdigest()[:16]
    return {
        "model": str(lm.name),
        "model_sizes": [lm.n_layer, lm.n_head, lm.window],
        "weights_sha256": weights_sha256(lm),
        "source": source.fingerprint(),
        "names_sha256": digest,
        **settings,
    }


@dataclass(frozen=True)
class ScoreOptions:
    """How ``storylens score`` runs, built once (by the command line, or from :func:`score_corpus`'s
    keywords) and checked once, here, before the first story.

    ``batch_size`` stories a batch, ``chunk_stories`` a chunk (the unit of a checkpoint and of a Ray
    task); a checkpoint every ``checkpoint_every`` batches, gone on from with ``resume``; ``engine``
    "local" or "ray" (``workers`` actors, on the cluster at ``address``, each loading ``model_source``:
    a folder or hub id, None for the shipped model); ``detectors``: every detector scored;
    ``examples``: the queries kept per head and detector where it fires most (0: none); ``causal``:
    every head's AtP and DLA too (:mod:`storylens.effects.attribution`, ``--causal``), the gradient pass
    holding at most ``graph_memory`` MiB of kept graphs (``--graph-memory``); ``audit``: K > 0
    (with ``causal``) audits AtP by exact ablation after the scoring, the K heads of largest |AtP| and K
    drawn at random (``seed``) on ``audit_stories`` first stories (None: as many as the ablation budget
    allows, :func:`~storylens.effects.audit.audit_budget_stories`), refused past
    :data:`~storylens.effects.cost.ABLATION_LIMIT_FLOPS` unless ``over_budget``; ``exact``: modes of
    :data:`~storylens.effects.exact.EXACT_MODES` in which every head's exact effect is measured in the same pass
    (:mod:`storylens.effects.exact`), on the first ``exact_stories`` stories (None: all), refused past the same
    budget unless ``over_budget``; mean ablation's means over the same stories (a pass of their own before the
    scoring); resample's donors drawn with ``seed``."""

    batch_size: int = BATCH_STORIES
    chunk_stories: int = CHUNK_STORIES
    checkpoint_every: int = 50
    resume: bool = False
    engine: str = "local"
    workers: int = 2
    address: str | None = None
    model_source: str | None = None
    detectors: tuple[Detector, ...] = BUILTIN_DETECTORS
    progress: bool = True
    examples: int = EXAMPLES
    causal: bool = False
    graph_memory: int = GRAPH_BYTES >> 20
    audit: int = 0
    audit_stories: int | None = None
    seed: int = 0
    over_budget: bool = False
    exact: tuple[str, ...] = ()
    exact_stories: int | None = None
    estimator: str | None = None
    ig_steps: int = IG_STEPS
    backups: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "detectors", tuple(self.detectors))
        object.__setattr__(self, "exact", tuple(self.exact))
        bad = [m for m in self.exact if m not in EXACT_MODES]
        if bad or len(set(self.exact)) != len(self.exact):
            raise UsageError(f"--exact: modes among {', '.join(EXACT_MODES)}, each once (got {','.join(self.exact)})")
        n = self.exact_stories
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1 or not self.exact):
            raise UsageError(f"--exact-stories: a whole number, 1 or more, with --exact (got {n!r})")
        if self.estimator is not None and self.estimator not in ESTIMATORS:
            raise UsageError(f"--estimator: one of {', '.join(ESTIMATORS)} (got {self.estimator!r})")
        if self.estimator is not None and not self.exact:
            raise UsageError(
                "--estimator: an estimate is shown beside its audit against the exact effect: pass --exact too "
                "(with --exact-stories N to measure that on the first N stories only)"
            )
        if isinstance(self.backups, bool) or not isinstance(self.backups, int) or self.backups < 0:
            raise UsageError(f"--backups: a whole number of heads, 0 or more (got {self.backups!r})")
        if self.backups and not self.exact:
            raise UsageError("--backups: switches off the heads of largest exact effect: pass --exact too")
        if isinstance(self.ig_steps, bool) or not isinstance(self.ig_steps, int) or self.ig_steps < 1:
            raise UsageError(f"--ig-steps: a whole number, 1 or more (got {self.ig_steps!r})")
        check_examples(self.examples)
        if isinstance(self.audit, bool) or not isinstance(self.audit, int) or self.audit < 0:
            raise UsageError(f"--audit: a whole number of heads, 0 or more (got {self.audit!r})")
        check_graph_memory(self.graph_memory)
        if self.audit and not self.causal:
            raise UsageError("--audit: audits the causal columns; pass --causal too")
        n = self.audit_stories
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1 or not self.audit):
            raise UsageError(f"--audit-stories: a whole number, 1 or more, with --audit (got {n!r})")
        if self.batch_size < 1 or self.chunk_stories < 1 or self.checkpoint_every < 1:
            raise UsageError("--batch-size, --chunk-stories and --checkpoint-every: must be at least 1")
        if self.engine not in ("local", "ray"):
            raise UsageError(f"--engine: local or ray (got {self.engine!r})")
        if self.workers < 1:
            raise UsageError(f"--workers: must be at least 1 (got {self.workers})")


@dataclass
class ScoreRun:
    out: Path
    scores: HeadScores
    summary: ScoreSummary


def score_corpus(
    lm: AttentionLM, source: StorySource, out: str | os.PathLike, options: ScoreOptions | None = None, **changes: Any
) -> ScoreRun:
    """Score every head of ``lm`` over ``source`` and write the table into ``out`` (see the module
    docstring): ``options`` (default :class:`ScoreOptions`), with any of its fields given as keywords
    changed: ``score_corpus(lm, source, "out", batch_size=8)``. ``out`` is checked by
    :func:`~storylens.core.publish.publish_folder` before the first story: a bad one costs nothing."""

    opts = replace(options or ScoreOptions(), **changes)
    check_examples(opts.examples, lm.n_layer * lm.n_head, len(opts.detectors))
    out = Path(out)
    # off a terminal (a log, CI) a line every few seconds says how far it is: storylens: score: ...
    with (
        progress_command("score"),
        publish_folder(out, "score") as tmp,
    ):  # the lock is held for the whole run, checkpoints included
        summary, scores = _score_into(tmp, lm, source, checkpoint_path(out), opts)
    ckpt = checkpoint_path(out)
    if ckpt.exists():
        ckpt.unlink()
    return ScoreRun(out, scores, summary)


def _resumed(ckpt: Path, fingerprint: dict, acc: HeadScoreAccumulator, n_total: int, resume: bool) -> RecordStats:
    """The stories an earlier run's checkpoint holds, its sums loaded into ``acc`` (none: no checkpoint);
    a checkpoint there without ``resume``, unreadable, or made with other settings is refused."""
    if not ckpt.exists():
        return RecordStats(0, 0, 0)
    if not resume:
        raise StorylensError(
            f"{ckpt}: an earlier run's checkpoint is there; pass --resume to go on from it "
            "(or delete it to start again)"
        )
    try:
        saved = json.loads(ckpt.read_text())
    except (OSError, ValueError) as e:
        raise StorylensError(
            f"{ckpt}: not a readable checkpoint ({type(e).__name__}); delete it to start again"
        ) from None
    if not isinstance(saved, dict) or saved.get("fingerprint") != fingerprint:
        raise StorylensError(f"{ckpt}: was made with other settings, model or stories; delete it to start again")
    try:
        done = _checked_stats(saved.get("stats"), n_total)
        acc.load_state(saved.get("state") or {}, max_stories=done.n_stories)
    except ValueError as e:
        raise StorylensError(f"{ckpt}: not a valid checkpoint ({e}); delete it to start again") from None
    return done


def _score_into(
    tmp: Path, lm: AttentionLM, source: StorySource, ckpt: Path, opts: ScoreOptions
) -> tuple[ScoreSummary, HeadScores]:
    """The two passes (resuming from ``ckpt`` where asked), then every file written into ``tmp``."""
    t0 = time.perf_counter()
    vocab, n_total = first_pass(source, progress=opts.progress)
    names = vocab.names()
    t_names = time.perf_counter() - t0
    exact = _exact_plan(lm, source, names, n_total, opts) if opts.exact else None  # its cost said before scoring
    fingerprint = _fingerprint(lm, source, names, _settings(opts, exact))
    acc = HeadScoreAccumulator(
        lm.n_layer, lm.n_head, opts.detectors, examples=opts.examples, causal=opts.causal,
        graph_bytes=opts.graph_memory << 20, exact=exact, estimator=opts.estimator, ig_steps=opts.ig_steps,
    )  # fmt: skip
    audited = _audit_plan(lm, source, names, n_total, opts) if opts.audit else []  # its cost said before scoring
    done = _resumed(ckpt, fingerprint, acc, n_total, opts.resume)
    t1 = time.perf_counter()
    used: dict = {}  # what the engine really used (Ray caps --workers at the cluster's CPUs)
    on_chunk = _checkpointer(ckpt, fingerprint, acc, done, n_total, opts)
    stats = done + _second_pass(lm, source, names, acc, done, n_total, opts, on_chunk, used)
    seconds = time.perf_counter() - t1
    timings = {"first_pass": round(t_names, 3), "scoring": round(seconds, 3)}
    backups, extra = _run_backups(lm, source, names, n_total, opts, acc, timings) if opts.backups else (None, None)
    scores = score_table(acc, stats, None, lm.window, lm, extra)  # the induction test: once, after every story
    audit = _run_audit(lm, audited, opts, timings) if audited else None
    summary = ScoreSummary(
        model=model_info(lm),
        stories=StoriesInfo(
            source=source.describe(),
            stories=stats.n_stories,
            cut_to_window=stats.n_cut,
            with_main_character=stats.n_main_character,
            name_scored=scores.n_name_scored,
        ),
        names=NamesInfo(NAME_DEFINITION, len(names), len(vocab.lower), len(vocab.capitalised)),
        engine=EngineInfo(
            opts.engine, used.get("workers", opts.workers) if opts.engine == "ray" else 1, done.n_stories
        ),
        timings_s=timings,
        detectors=[d.name for d in opts.detectors],
        top={d.name: _top(scores, d.name) for d in opts.detectors},
        audit=audit,
        exact=None if exact is None or acc.exact is None else exact_info(exact, acc.exact.acc),
        estimators=_estimator_audits(acc, opts),
        backups=backups,
    )
    if audit is not None:
        write_audit_csv(audit, tmp / "audit.csv")
    scores.to_csv(tmp / "heads.csv")
    scores.to_json(tmp / "heads.json")
    if acc.examples is not None:
        write_examples(acc.examples, lm, tmp / "examples.json")
    (tmp / "summary.json").write_text(summary.to_json(), encoding="utf-8")
    title = f"storylens explorer: {summary.model.display_name}"
    write_explorer_for(tmp, title=title, meta=summary.explorer_meta(opts.examples))
    return summary, scores


def _settings(opts: ScoreOptions, exact: ExactPlan | None) -> dict:
    """What a checkpoint's fingerprint holds of the options (a resumed run must score alike)."""
    return {
        "batch_size": opts.batch_size,
        "chunk_stories": opts.chunk_stories,
        "detectors": [d.name for d in opts.detectors],
        "examples": opts.examples,
        **({"causal": True} if opts.causal else {}),  # a run without these keeps its fingerprint
        **({"exact": exact.settings()} if exact is not None else {}),
        **({"estimator": opts.estimator, "ig_steps": opts.ig_steps} if opts.estimator else {}),
    }


def _run_backups(
    lm: AttentionLM, source: StorySource, names: frozenset[str], n_total: int, opts: ScoreOptions,
    acc: HeadScoreAccumulator, timings: dict,
) -> tuple[Backups | None, dict | None]:  # fmt: skip
    """``--backups K``, after the scoring: the K heads of largest exact effect (the first mode's) off
    together, every other head measured again, on the first stories the exact effect covered (at most
    :data:`~storylens.effects.backups.BACKUP_STORIES`): the summary's backups and the backup_gain columns."""
    if acc.exact is None:
        return None, None
    t = time.perf_counter()
    plan, mode = acc.exact.plan, acc.exact.plan.modes[0]
    n = min(n_total, plan.stories or n_total, BACKUP_STORIES)
    stories = [e.ids for e in encode_stories(lm, list(islice(iter(source), n)), names) if len(e.ids) >= 2]
    removed = top_heads(acc.exact.acc.columns()[f"exact_{mode}"], opts.backups)
    measure = backup_effects(
        lm, stories, removed, (mode,), means=plan.means, seed=plan.seed, batch_size=opts.batch_size, budget=plan.budget
    )
    timings["backups"] = round(time.perf_counter() - t, 3)
    return measure.result(mode), measure.columns(mode)


def _estimator_audits(acc: HeadScoreAccumulator, opts: ScoreOptions) -> list[EstimatorAudit] | None:
    """The estimator's audit against the exact effect on the stories both measured (--estimator)."""
    if acc.estimate is None or acc.exact is None:
        return None
    return audits_of(acc.exact.acc.columns(), acc.estimate.audited, acc.exact.acc.stories, seed=opts.seed)


def _audit_plan(
    lm: AttentionLM, source: StorySource, names: frozenset[str], n_total: int, opts: ScoreOptions
) -> list[EncodedStory]:
    """The stories the audit will run on, the first of the source: ``audit_stories`` of them, or as
    many of the first :data:`~storylens.table.truth.TRUTH_STORIES` as the report's ablation budget
    allows (a fifth of the scoring pass, estimated from their mean length, or 1 TFLOP). Its cost is said
    on stderr now, before the scoring, and past the budget refused unless ``over_budget``."""
    asked = opts.audit_stories
    texts = list(islice(iter(source), min(asked or TRUTH_STORIES, n_total)))
    candidates = encode_stories(lm, texts, names)
    lengths = [len(e.ids) for e in candidates]
    heads = min(3 * opts.audit, lm.n_layer * lm.n_head)  # at most: the top K of each mode, K drawn at random
    n = asked if asked is not None else audit_budget_stories(lm, lengths, heads, n_total * sum(lengths) / len(lengths))
    chosen = candidates[:n]
    how = "as many as the ablation budget allows"
    if asked is not None:
        how = "as asked (--audit-stories)" + (f"; the source holds {n_total}" if asked > n_total else "")
    what = f"score --audit {opts.audit}: the first {len(chosen)} stories, {how}"
    check_ablation_budget(audit_cost(lm, lengths[:n], heads), what, over=opts.over_budget)
    return chosen


def _exact_plan(
    lm: AttentionLM, source: StorySource, names: frozenset[str], n_total: int, opts: ScoreOptions
) -> ExactPlan:
    """``--exact``'s plan: its cost over the stories it will cover (their length estimated from the first
    :data:`~storylens.effects.exact.LENGTH_STORIES`), said on stderr before the scoring and past the ablation
    budget refused unless ``over_budget`` (naming the ``--exact-stories`` that fits); then, for mean
    ablation, every head's mean output over every story it covers (a pass of its own, streamed: the mean
    is that of the stories measured, not a sample's; see :func:`corpus_means`)."""
    first = encode_stories(lm, list(islice(iter(source), min(LENGTH_STORIES, n_total))), names)
    lengths = [len(e.ids) for e in first]
    mean_length = sum(lengths) / len(lengths)
    covered = min(n_total, opts.exact_stories or n_total)
    means_tokens = covered * mean_length if "mean" in opts.exact else 0
    cost = exact_cost(lm, covered * mean_length, opts.exact, means_tokens)
    what = f"score --exact {','.join(opts.exact)}: every head on the first {covered:,} stories"
    more = 0.0  # an estimator's, on every story, and the backups' two passes
    if opts.estimator is not None:
        more = estimate_cost(lm, n_total * mean_length, opts.estimator, opts.exact, opts.ig_steps)
        what += f", --estimator {opts.estimator} on all {n_total:,}"
    if opts.backups:
        more += 2 * exact_cost(lm, min(covered, BACKUP_STORIES) * mean_length, opts.exact).flops
        what += f", --backups {opts.backups} on the first {min(covered, BACKUP_STORIES):,}"
    cost = replace(cost, flops=cost.flops + more, passes=cost.passes + more / max(cost.scoring, 1.0))
    if cost.flops > ABLATION_LIMIT_FLOPS and not opts.over_budget:
        left = ABLATION_LIMIT_FLOPS - more - means_tokens * lm.n_layer * block_flops(lm)
        fits = fitting_stories(lm, mean_length, opts.exact, left) if left > 0 else 0
        raise UsageError(
            f"{what}: {cost.describe()}, past the budget of {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP; "
            + (f"pass --exact-stories {fits:,} (fits it) or " if fits else "pass ")
            + f"{OVER_BUDGET_FLAG} to run it anyway"
        )
    check_ablation_budget(cost, what, over=True)  # said on stderr
    means = corpus_means(lm, source, names, covered, opts) if "mean" in opts.exact else None
    return ExactPlan(opts.exact, means, covered if means is not None else 0, opts.exact_stories, opts.seed)


def corpus_means(
    lm: AttentionLM, source: StorySource, names: frozenset[str], n: int, opts: ScoreOptions
) -> torch.Tensor:
    """Every head's mean output ``[layer, head, d]`` over every position after the opening token of the source's
    first ``n`` stories, streamed a chunk at a time (:func:`~storylens.effects.ablation.head_output_means` per
    chunk, weighted by its positions, summed in float64)."""
    total: torch.Tensor | None = None
    count = 0
    stories = islice(iter(source), n)
    lines = ProgressLines("exact: the heads' means", n, enabled=opts.progress)
    while chunk := list(islice(stories, opts.chunk_stories)):
        ids = [e.ids for e in encode_stories(lm, chunk, names) if len(e.ids) >= 2]
        lines.update(len(chunk))
        if not ids:
            continue
        positions = sum(len(s) - 1 for s in ids)
        part = head_output_means(lm, ids, batch_size=opts.batch_size, include_marker=False).to(torch.float64)
        total = part * positions if total is None else total + part * positions
        count += positions
    if total is None:
        raise StorylensError("--exact mean: no story of two tokens or more to take the heads' means over")
    return (total / count).to(torch.float32 if lm.dtype != torch.float64 else torch.float64)


def _run_audit(lm: AttentionLM, stories: list[EncodedStory], opts: ScoreOptions, timings: dict) -> Audit | None:
    """The report's audit (:func:`~storylens.effects.audit.audit_stories`) on the planned stories."""
    t = time.perf_counter()
    audit = audit_stories(lm, stories, k=opts.audit, seed=opts.seed, batch_size=opts.batch_size, progress=opts.progress)
    timings["audit"] = round(time.perf_counter() - t, 3)
    return audit


def write_audit_csv(audit: Audit, path: Path) -> Path:
    """audit.csv: one row per audited head (:data:`~storylens.effects.audit.AUDIT_CSV`)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(AUDIT_CSV))
        w.writeheader()
        w.writerows(audit_csv_rows(audit))
    return path


def _checkpointer(
    ckpt: Path, fingerprint: dict, acc: HeadScoreAccumulator, done: RecordStats, n_total: int, opts: ScoreOptions
) -> Callable[[RecordStats], None]:
    """What runs after a chunk (on Ray: whenever the chunks merged in order grow): a checkpoint every
    ``checkpoint_every`` batches."""
    batches_since = [0]
    last = [done]

    def progress_made(stats_here: RecordStats) -> None:
        now = done + stats_here
        batches_since[0] += -(-(now.n_stories - last[0].n_stories) // opts.batch_size)
        last[0] = now
        if batches_since[0] >= opts.checkpoint_every and now.n_stories < n_total:
            write_text_atomic(
                ckpt, json.dumps({"fingerprint": fingerprint, "stats": list(_astuple(now)), "state": acc.state()})
            )
            batches_since[0] = 0

    return progress_made


def _second_pass(
    lm: AttentionLM,
    source: StorySource,
    names: frozenset[str],
    acc: HeadScoreAccumulator,
    done: RecordStats,
    n_total: int,
    opts: ScoreOptions,
    on_chunk: Callable[[RecordStats], None],
    used: dict,
) -> RecordStats:
    """The recording pass over the stories after ``done``, on Ray (the workers read the source
    themselves, skipping what is done; ``used`` gets what the engine used) or here."""
    if opts.engine == "ray":
        return score_with_ray(
            opts.model_source,
            source,
            names,
            acc,
            workers=opts.workers,
            address=opts.address,
            details=used,
            batch_size=opts.batch_size,
            chunk_stories=opts.chunk_stories,
            total=n_total,
            progress=opts.progress,
            detectors=opts.detectors,
            examples=opts.examples,
            causal=opts.causal,
            graph_bytes=opts.graph_memory << 20,
            exact=acc.exact.plan if acc.exact is not None else None,
            start=done.n_stories,
            on_progress=on_chunk,
        )
    lines = ProgressLines("scoring", n_total, enabled=opts.progress, initial=done.n_stories)  # a measure: counts
    return record(
        lm,
        _skip(source, done.n_stories),
        [acc, Counter(lines.update)],
        batch_size=opts.batch_size,
        names=names,
        progress=opts.progress,
        chunk_stories=opts.chunk_stories,
        start=done.n_stories,
        total=n_total,
        on_chunk=on_chunk,
    )


def _top(scores: HeadScores, column: str) -> TopHead | None:
    try:
        h = scores.best(column)
    except ValueError:
        return None
    return TopHead(h.label, scores.column(column)[scores.heads.index(h)])


def _checked_stats(stats, n_total: int):
    """The stories counted in a checkpoint, checked: whole numbers, cut and main-character counts
    no more than the stories, the stories no more than the source holds."""

    if (
        not isinstance(stats, list)
        or len(stats) != 3
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in stats)
    ):
        raise ValueError(f"stats {stats!r} are not three whole numbers of 0 or more")
    n, cut, main = stats
    if n > n_total or cut > n or main > n:
        raise ValueError(
            f"stats {stats!r}: {n} stories done of {n_total}, {cut} cut and {main} with a main "
            "character cannot all hold"
        )
    return RecordStats(n, cut, main)


def weights_sha256(lm: AttentionLM) -> str:
    """A hash of every weight's bytes, in order (with its name, shape and dtype): a checkpoint made
    with other weights of the same shapes is never resumed. About a second per 500 MB of weights."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in lm.module.state_dict().items():
            t = p.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


def _astuple(stats) -> tuple[int, int, int]:
    return stats.n_stories, stats.n_cut, stats.n_main_character


def _skip(source, n: int):
    """The stories after the first ``n`` (a resumed run reads the source again from the start)."""
    return islice(iter(source), n, None)


def default_workers() -> int:
    return max(1, (os.cpu_count() or 2))
