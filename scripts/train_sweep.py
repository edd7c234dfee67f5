"""Short training runs, one setting changed at a time, to choose Tiny Storyteller's recipe.

Each run has the same budget (``--steps`` steps of 16 x 256 tokens unless the run changes the
batch size, in which case the step count keeps the token budget), trains in ``OUT/NAME``, can
be killed and re-run (finished runs are skipped, checkpointed ones resumed), and every run keeps
an EMA of its weights so "does an EMA help" is answered by every row. The table goes to
``OUT/results.md`` and ``OUT/results.json``.

    nice -n 19 python scripts/train_sweep.py --out runs/sweep
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from storylens.data.stories import load_split
from storylens.training.train import CHECKPOINT, TrainConfig, train

# name -> changes against the base (the shipped model's recipe, scaled to the short budget)
RUNS = {
    "base (dropout 0.1 everywhere)": {},
    "residual dropout only (0.1, attention 0)": {"attn_dropout": 0.0},
    "no dropout": {"dropout": 0.0, "attn_dropout": 0.0},
    "dropout 0.2": {"dropout": 0.2},
    "lr 3e-3": {"lr": 3e-3, "min_lr": 3e-4},
    "lr 1e-3": {"lr": 1e-3, "min_lr": 1e-4},
    "batch 32 (half the steps)": {"batch_size": 32},
    "weight decay 0.3": {"weight_decay": 0.3},
    "warm-up 30": {"warmup_steps": 30},
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:40]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/sweep")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--stories", default=None)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    split = load_split(args.stories)
    # the base row is the earlier shipped recipe (dropout 0.1 everywhere), whatever TrainConfig's defaults
    base = TrainConfig(
        max_steps=args.steps,
        eval_every=args.steps // 4,
        ema_decay=args.ema,
        attn_dropout=None,
        warmup_steps=max(1, args.steps // 20),
        checkpoint_minutes=2.0,
    )
    results = []
    for name, change in RUNS.items():
        if args.only and slug(name) not in args.only:
            continue
        cfg = replace(base, **change)
        if "batch_size" in change:  # same tokens, fewer steps
            steps = args.steps * base.batch_size // cfg.batch_size
            cfg = replace(
                cfg,
                max_steps=steps,
                eval_every=steps // 4,
                warmup_steps=change.get("warmup_steps", max(1, steps // 20)),
            )
        run = out / slug(name)
        state_file = run / "train_state.json"
        if not state_file.exists():
            print(f"== {name}", flush=True)
            train(split, run, cfg, resume=(run / CHECKPOINT).exists(), progress=True)
        state = json.loads(state_file.read_text())
        last = state["evals"][-1]
        results.append(
            {
                "run": name,
                "changes": change,
                "config": asdict(cfg),
                "quiz_perplexity": last["quiz_perplexity"],
                "quiz_perplexity_ema": last.get("quiz_perplexity_ema"),
                "evals": state["evals"],
                "train_seconds": state["train_seconds"],
                "tokens": state["step"] * cfg.batch_size * cfg.block_size,
            }
        )
        write_table(out, results, args)


def write_table(out: Path, results: list[dict], args) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"Short runs: {args.steps} steps x 16 x 256 tokens each (same tokens for every row), "
        f"EMA decay {args.ema}; torch {torch.__version__}, {torch.get_num_threads()} threads.",
        "",
        "| run | quiz perplexity | with EMA weights | compute minutes |",
        "|---|---|---|---|",
    ]
    for r in results:
        ema = f"{r['quiz_perplexity_ema']:.2f}" if r["quiz_perplexity_ema"] is not None else "-"
        lines.append(f"| {r['run']} | {r['quiz_perplexity']:.2f} | {ema} | {r['train_seconds'] / 60:.1f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
