"""``storylens train``: train Tiny Storyteller on the training stories (resumable; a head timeline,
a copying count and, if asked, a model folder when done)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from storylens.cli.options import add_no_progress, out_path
from storylens.core.errors import UsageError
from storylens.core.progress import progress_command
from storylens.data.stories import load_split
from storylens.training.copying import COPYING_FILE, read_copying
from storylens.training.copying import SAMPLES as COPY_SAMPLES
from storylens.training.timeline import TIMELINE_FILE
from storylens.training.train import TrainConfig, export_checkpoint, lesson_files, train, validate_config

COMMAND = "train"
POSITION = 90


def add_parser(sub) -> None:
    t = sub.add_parser(COMMAND, help="train Tiny Storyteller on the training stories")
    t.add_argument("--stories", default=None, help="corpus file (default: ../shared/data/tinystories/stories.txt.gz)")
    t.add_argument("--out", default="runs/tiny-storyteller", help="run folder (checkpoint, tokenizer)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    t.add_argument("--export", default=None, help="write a model folder here when done")
    t.add_argument(
        "--copying-samples",
        type=int,
        default=COPY_SAMPLES,
        metavar="N",
        help=f"when done, generate N stories and count their 8-word runs found in the training stories "
        f"(default {COPY_SAMPLES}; 0: skip)",
    )
    t.add_argument(
        "--first",
        type=int,
        default=None,
        metavar="N",
        help="use only the corpus's first N stories (the lesson: --stories tinystories --first 20000)",
    )
    _add_train_config(t)
    add_no_progress(t)
    t.set_defaults(func=run)


def _add_train_config(t: argparse.ArgumentParser) -> None:
    """One option per :class:`TrainConfig` field a run may change (``--max-steps``, ``--lr``, ...),
    unset by default so the config's own default (named in the help) holds."""
    d = TrainConfig()
    for name in (
        "max_steps",
        "batch_size",
        "eval_every",
        "seed",
        "warmup_steps",
        "vocab_size",
        "n_layer",
        "n_head",
        "n_embd",
    ):
        t.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {getattr(d, name)}")
    for name in ("lr", "min_lr", "weight_decay", "dropout", "attn_dropout", "ema_decay", "checkpoint_minutes"):
        t.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=f"default {getattr(d, name)}")
    t.add_argument(
        "--dtype", choices=["fp32", "bf16"], default=None, help="default fp32 (bf16 autocast is slower here)"
    )


def run(args) -> int:
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    cfg = TrainConfig(**overrides)
    validate_config(cfg)
    if args.first is not None and args.first < 201:
        raise UsageError(f"--first: at least 201 stories (200 for the quiz and one to train on), got {args.first}")
    if args.copying_samples < 0:
        raise UsageError(f"--copying-samples: 0 or more (got {args.copying_samples})")
    split = load_split(args.stories, first=args.first)
    try:
        with progress_command("train"):
            result = train(
                split,
                out_path(args.out),
                cfg,
                resume=args.resume,
                copying_samples=args.copying_samples,
                progress=not args.no_progress,
            )
    except KeyboardInterrupt as e:
        print(f"\n{e or 'interrupted'}; continue with --resume", file=sys.stderr)
        return 130
    state = result["state"]
    evals = state["evals"]
    if evals:
        print(f"quiz perplexity {evals[-1]['quiz_perplexity']:.3f} after {state['step']} steps")
        share = state.get("timeline_seconds", 0.0) / max(state["train_seconds"], 1e-9)
        print(
            f"head timeline: {len(evals)} evaluations in {Path(args.out) / TIMELINE_FILE} "
            f"({state.get('timeline_seconds', 0.0):.1f} s, {100 * share:.1f}% of the training steps' time)"
        )
    copied = read_copying(args.out)
    if copied is not None and copied["share"] is not None:
        print(
            f"copying: {100 * copied['share']:.1f}% of the 8-word runs in {copied['samples']} generated stories "
            f"occur in the training stories ({Path(args.out) / COPYING_FILE})"
        )
    if args.export:
        folder = export_checkpoint(Path(args.out), out_path(args.export, "--export"), lesson_files(split))
        print(f"model folder written to {folder}")
    return 0
