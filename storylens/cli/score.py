"""``storylens score``: score every head over any corpus (streamed; checkpointed; on Ray if
asked), with, if asked, causal effects and their audit against exact ablation."""

from __future__ import annotations

import argparse

from storylens.cli.options import (
    add_causal,
    add_exact,
    add_examples,
    add_model,
    add_no_progress,
    add_over_budget,
    check_seed,
    graph_memory_of,
    load,
    load_detector,
    out_path,
)
from storylens.cli.rules import ray_address
from storylens.core.publish import check_target_folder
from storylens.corpus.exact_plan import BY_BUDGET
from storylens.corpus.options import ScoreOptions
from storylens.corpus.ray_engine import check_address
from storylens.corpus.score import score_corpus
from storylens.data.sources import open_source
from storylens.effects.audit import AUDIT_HEADS, audit_lines
from storylens.effects.backups import backup_lines
from storylens.effects.cost import ABLATION_LIMIT_FLOPS, OVER_BUDGET_FLAG, TRUTH_BUDGET, TRUTH_FLOOR_FLOPS
from storylens.effects.estimators import audit_lines as estimator_lines
from storylens.engine.encode import BATCH_STORIES, CHUNK_STORIES
from storylens.looking.detectors import BUILTIN_DETECTORS
from storylens.table.truth import TRUTH_STORIES

COMMAND = "score"
POSITION = 30


def add_parser(sub) -> None:
    s = sub.add_parser(COMMAND, help="score every head over any corpus (streamed; checkpointed; on Ray if asked)")
    s.add_argument(
        "--stories",
        required=True,
        metavar="SRC",
        help="a .txt/.gz file with <|endoftext|> lines, .jsonl, .parquet, a saved Hugging Face dataset "
        "folder, or hf:OWNER/NAME (the local cache, or the hub with --allow-download)",
    )
    s.add_argument("--out", required=True, help="output folder: heads.csv, heads.json, summary.json")
    s.add_argument("--text-field", default="text", help="the story's field in JSON lines, Parquet or a dataset")
    s.add_argument(
        "--split",
        default=None,
        help="a Hugging Face dataset's split (default train; refused for a source without splits)",
    )
    s.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N stories")
    s.add_argument(
        "--batch-size",
        type=int,
        default=BATCH_STORIES,
        help=f"stories per forward pass (default {BATCH_STORIES}: on a CPU nearly as fast as more, with "
        "less peak memory; raise it on a GPU)",
    )
    s.add_argument(
        "--chunk-stories",
        type=int,
        default=CHUNK_STORIES,
        help=f"stories encoded and batched together, the unit of checkpoints and of Ray work (default {CHUNK_STORIES})",
    )
    s.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        metavar="N",
        help="write a checkpoint after every N batches (at the end of a chunk; default 50)",
    )
    s.add_argument("--resume", action="store_true", help="go on from the checkpoint an interrupted run left")
    s.add_argument("--engine", choices=["local", "ray"], default="local", help="this process, or Ray actors")
    s.add_argument("--workers", type=int, default=2, help="with --engine ray: how many actors (default 2)")
    s.add_argument(
        "--address", default=None, type=ray_address, help="with --engine ray: join this cluster (default: a local Ray)"
    )
    s.add_argument("--detector", action="append", default=[], metavar="FILE", help="add a head detector (see report)")
    composition = (
        "composition.csv (Q/K/V composition of every pair of heads) however long (default: under 4e9 products)"
    )
    s.add_argument("--composition", action="store_true", help=f"write {composition}")
    add_examples(s)
    add_causal(
        s,
        "; and every head's exact effect in mean ablation on the first stories the budget allows, with AtP "
        "audited against it there (summary.json's estimators; --exact: on every story)",
    )
    add_exact(s)
    _add_audit(s)
    add_no_progress(s)
    add_model(s)
    s.set_defaults(func=run)


def _add_audit(s: argparse.ArgumentParser) -> None:
    """``--audit``, ``--audit-stories``, ``--seed`` and ``--over-budget``: AtP checked against exact ablation."""
    s.add_argument(
        "--audit",
        type=int,
        nargs="?",
        const=AUDIT_HEADS,
        default=0,
        metavar="K",
        help=f"with --causal: after scoring, check AtP against exact ablation (mean and zero) on the K heads of "
        f"largest |AtP| and K drawn at random, as the report does; audit.csv and summary.json's audit "
        f"(--audit alone: K = {AUDIT_HEADS}; 0, the default: none; see docs/audit.md)",
    )
    s.add_argument(
        "--audit-stories",
        type=int,
        default=None,
        metavar="N",
        help=f"the audit on the first N stories (default: as many of the first {TRUTH_STORIES} as cost at most "
        f"{TRUTH_BUDGET:.0%}% of the scoring pass or {TRUTH_FLOOR_FLOPS / 1e12:g} TFLOP); its cost is said before "
        f"scoring starts, and past {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP needs {OVER_BUDGET_FLAG}",
    )
    s.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the audit's random heads and --exact resample's donors: seed, 0 to 2^64 - 1 (default 0)",
    )
    add_over_budget(s)


def run(args) -> int:
    check_seed(args.seed)
    options = ScoreOptions(
        batch_size=args.batch_size,
        chunk_stories=args.chunk_stories,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        engine=args.engine,
        workers=args.workers,
        address=args.address,
        model_source=args.model,
        detectors=BUILTIN_DETECTORS + tuple(load_detector(f) for f in args.detector),
        progress=not args.no_progress,
        examples=args.examples,
        causal=args.causal,
        graph_memory=graph_memory_of(args),
        audit=args.audit,
        audit_stories=args.audit_stories,
        seed=args.seed,
        over_budget=args.over_budget,
        exact=args.exact,
        exact_stories=args.exact_stories,
        estimator=args.estimator,
        ig_steps=args.ig_steps,
        backups=args.backups,
        composition=args.composition,
    )
    if args.engine == "ray" and args.address:
        check_address(args.address)  # in seconds, before the first pass reads the corpus
    out = out_path(args.out)
    check_target_folder(out, kind="score")  # before the model or any story: a bad --out costs nothing
    source = open_source(
        args.stories, text_field=args.text_field, limit=args.limit, split=args.split, allow_download=args.allow_download
    )
    scored = score_corpus(load(args), source, out, options)
    print("\n".join(_lines(scored, options)))
    return 0


def _lines(scored, options: ScoreOptions) -> list[str]:
    """What ``storylens score`` prints: the stories, each detector's top head, where the files went, and the
    effects' figures where they were measured."""
    s, st = scored.summary, scored.summary.stories
    lines = [
        f"{st.stories:,} stories from {st.source}: {st.cut_to_window:,} cut to the window, "
        f"{st.with_main_character:,} with a main character ({st.name_scored:,} scored for names)"
    ]
    lines += [f"  {name:16} highest {top.head} {top.score:.3f}" for name, top in s.top.items() if top is not None]
    lines.append(
        f"written to {scored.out} (scoring {s.timings_s['scoring']:.1f} s, first pass {s.timings_s['first_pass']:.1f} s, "
        f"engine {s.engine.name})"
    )
    if s.exact is not None:
        counted = ", ".join(f"{m}: {n:,} stories" for m, n in s.exact.stories.items())
        how = (
            ""
            if s.exact.chosen == "asked"
            else f"; --causal's default: the first stories, {BY_BUDGET}; --exact: every story"
        )
        lines.append(f"exact effects ({counted}{how}): heads.csv's exact_*")
    elif options.causal:
        lines.append("exact effects: not measured (no story fits the default budget), so the AtP columns are unaudited")
    if s.backups is not None:
        lines += backup_lines(s.backups)
    if s.estimators:
        lines += estimator_lines(s.estimators)
    if s.audit is not None:
        lines += audit_lines(s.audit)
    elif options.audit:
        lines.append("audit: not run (the model's heads could not be reached, or no story predicts a token)")
    return lines
