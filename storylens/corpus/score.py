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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from storylens.circuits.composition import (
    COMPOSITION_BUDGET,
    composition_cost,
    composition_scores,
    write_composition_csv,
)
from storylens.core.errors import StorylensError
from storylens.core.files import MAX_RESULT_BYTES, json_digest, read_text
from storylens.core.progress import ProgressLines, progress_command
from storylens.core.publish import publish_folder, write_text_atomic
from storylens.core.text import unicode_problem
from storylens.corpus.exact_plan import exact_plan
from storylens.corpus.options import ScoreOptions, check_examples
from storylens.corpus.ray_engine import score_with_ray
from storylens.corpus.summary import NAME_DEFINITION, EngineInfo, NamesInfo, ScoreSummary, TopHead
from storylens.data.names import NameVocabulary
from storylens.data.sources import StorySource
from storylens.effects.audit import AUDIT_CSV, Audit, audit_budget_stories, audit_cost, audit_csv_rows, audit_stories
from storylens.effects.backups import BACKUP_STORIES, Backups, backup_effects, top_heads
from storylens.effects.cost import check_ablation_budget
from storylens.effects.estimators import EstimatorAudit, audits_of
from storylens.effects.exact import ExactPlan, exact_info
from storylens.effects.weights import HeadWeights
from storylens.engine.encode import EncodedStory, encode_stories
from storylens.engine.record import Counter, RecordStats, record
from storylens.lm import AttentionLM
from storylens.table.accumulator import HeadScoreAccumulator
from storylens.table.run_info import StoriesInfo, model_info
from storylens.table.scores import HeadScores, readable_weights, score_table
from storylens.table.truth import TRUTH_STORIES
from storylens.viz.explorer import write_explorer_for
from storylens.viz.tokens import token_text

CHECKPOINT_SUFFIX = ".checkpoint.json"


def write_examples(examples, lm: AttentionLM, path: Path) -> Path:
    """examples.json: the kept queries with their tokens as text (:func:`storylens.viz.tokens.token_text`)."""
    return examples.to_json(path, lambda i: token_text(lm.tokenizer, i))


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + CHECKPOINT_SUFFIX)


def first_pass(source, *, progress: bool = True):
    """The name vocabulary of every story in ``source``, how many there are and a SHA-256 of their text in
    order (streamed; what a checkpoint is resumed over must be these very stories, whatever kind of source holds
    them: a saved dataset rewritten in place keeps its folder's size and time)."""
    vocab, n, digest = NameVocabulary(), 0, hashlib.sha256()
    lines = ProgressLines("first pass: names", None, enabled=progress)  # off a terminal, instead of the bar
    for story in tqdm(source, unit="story", desc="first pass: names", disable=None if progress else True):
        if problem := unicode_problem(story):
            raise StorylensError(f"{source.describe()}: story {n + 1}: {problem}")
        vocab.add(story)
        raw = story.encode("utf-8")
        digest.update(len(raw).to_bytes(8, "little") + raw)
        n += 1
        lines.update()
    if n == 0:
        raise StorylensError(f"{source.describe()}: no stories")
    return vocab, n, digest.hexdigest()


def _fingerprint(lm: AttentionLM, source: StorySource, text_sha: str, settings: dict) -> dict:
    return {
        "model": str(lm.name),
        "model_sizes": [lm.n_layer, lm.n_head, lm.window],
        "weights_sha256": weights_sha256(lm),
        "source": source.fingerprint(),
        "stories_sha256": text_sha,  # every story's text, in order (the names follow from them)
        **settings,
    }


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
        saved = json.loads(read_text(ckpt, MAX_RESULT_BYTES, "delete it to start again"))  # NaN: refused below
    except (OSError, ValueError, RecursionError) as e:
        raise StorylensError(
            f"{ckpt}: not a readable checkpoint ({type(e).__name__}); delete it to start again"
        ) from None
    if not isinstance(saved, dict) or saved.get("fingerprint") != fingerprint:
        raise StorylensError(f"{ckpt}: was made with other settings, model or stories; delete it to start again")
    try:
        done = _checked_stats(saved.get("stats"), n_total)
        acc.load_state(saved.get("state") or {}, max_stories=done.n_stories)
        if saved.get("digest") != json_digest([saved["fingerprint"], saved["stats"], saved["state"]]):
            raise ValueError("its digest does not match what it holds: edited after storylens wrote it")
    except (ValueError, RecursionError) as e:
        raise StorylensError(f"{ckpt}: not a valid checkpoint ({e}); delete it to start again") from None
    return done


def _score_into(
    tmp: Path, lm: AttentionLM, source: StorySource, ckpt: Path, opts: ScoreOptions
) -> tuple[ScoreSummary, HeadScores]:
    """The two passes (resuming from ``ckpt`` where asked), then every file written into ``tmp``."""
    t0 = time.perf_counter()
    vocab, n_total, text_sha = first_pass(source, progress=opts.progress)
    names = vocab.names()
    t_names = time.perf_counter() - t0
    audited = _audit_plan(lm, source, names, n_total, opts) if opts.audit else []  # its cost said before scoring
    exact = exact_plan(lm, source, names, n_total, opts) if opts.exact_modes else None  # its cost said before scoring
    fingerprint = _fingerprint(lm, source, text_sha, _settings(opts, exact))
    acc = HeadScoreAccumulator(
        lm.n_layer, lm.n_head, opts.detectors, examples=opts.examples, causal=opts.causal,
        graph_bytes=opts.graph_memory << 20, exact=exact, estimator=opts.estimator, ig_steps=opts.ig_steps,
        audit_atp=opts.causal and exact is not None,
    )  # fmt: skip
    done = _resumed(ckpt, fingerprint, acc, n_total, opts.resume)
    t1 = time.perf_counter()
    used: dict = {}  # what the engine really used (Ray caps --workers at the cluster's CPUs)
    on_chunk = _checkpointer(ckpt, fingerprint, acc, done, n_total, opts)
    stats = done + _second_pass(lm, source, names, acc, done, n_total, opts, on_chunk, used)
    seconds = time.perf_counter() - t1
    timings = {"first_pass": round(t_names, 3), "scoring": round(seconds, 3)}
    backups, extra = _run_backups(lm, source, names, n_total, opts, acc, timings) if opts.backups else (None, None)
    weights = readable_weights(lm)
    scores = score_table(acc, stats, None, lm.window, lm, extra, weights)  # the induction test: once, after every story
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
        exact=None if exact is None or acc.exact is None else exact_info(exact, acc.exact.acc, _chosen(opts)),
        estimators=_estimator_audits(acc, opts),
        backups=backups,
    )
    if audit is not None:
        write_audit_csv(audit, tmp / "audit.csv")
    scores.to_csv(tmp / "heads.csv")
    scores.to_json(tmp / "heads.json")
    _composition(weights, opts, tmp / "composition.csv")
    if acc.examples is not None:
        write_examples(acc.examples, lm, tmp / "examples.json")
    (tmp / "summary.json").write_text(summary.to_json(), encoding="utf-8")
    title = f"storylens explorer: {summary.model.display_name}"
    write_explorer_for(tmp, title=title, meta=summary.explorer_meta(opts.examples))
    return summary, scores


def _composition(weights: HeadWeights | None, opts: ScoreOptions, path: Path) -> None:
    """composition.csv (:mod:`storylens.circuits.composition`) where the model's weights are readable and the
    pairs' products within :data:`~storylens.circuits.composition.COMPOSITION_BUDGET` or asked for; else a note."""
    if weights is None:
        return
    cost = composition_cost(weights)
    if cost > COMPOSITION_BUDGET and not opts.composition:
        print(
            f"storylens: note: composition.csv left out ({cost:.1e} multiplications for every pair of heads, past "
            f"{COMPOSITION_BUDGET:.0e}); pass --composition to make it",
            file=sys.stderr,
        )
        return
    write_composition_csv(composition_scores(weights), path)


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
    """Each estimate's audit against the exact effect on the stories both measured (--estimator; AtP's with
    --causal)."""
    measures = acc.effects.audits
    if not measures or acc.exact is None:
        return None
    exact = acc.exact.acc
    return [a for m in measures for a in audits_of(exact.columns(), m.audited, exact.stories, seed=opts.seed)]


def _chosen(opts: ScoreOptions) -> str:
    """summary.json's ``exact.chosen``: the stories as asked (--exact, --exact-stories), or by --causal's budget."""
    return "asked" if opts.exact or opts.exact_stories is not None else "budget"


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
            stats, state = list(_astuple(now)), acc.state()
            digest = json_digest([fingerprint, stats, state])
            write_text_atomic(
                ckpt, json.dumps({"fingerprint": fingerprint, "stats": stats, "state": state, "digest": digest})
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
