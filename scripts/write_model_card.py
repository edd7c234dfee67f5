"""Write the shipped model's card (its README.md) from the training run that made it:

    python scripts/write_model_card.py runs/tiny-storyteller [storylens/pretrained/tiny-storyteller]

Everything in it is read from the run (its checkpoint, or the ``train_state.json`` a finished run
writes: recipe, evaluations, compute time), the shipped folder itself (parameters, quiz perplexity
measured now, its head timeline and copying check) and benchmarks/train_sweep.md (the short runs
behind the recipe).
"""

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.readme_tables import update
from storylens.core.publish import write_text_atomic
from storylens.data.stories import load_split
from storylens.lesson.figures import LESSON_FIGURES
from storylens.model.hub import load_model
from storylens.training.checkpoint import load_checkpoint
from storylens.training.copying import COPYING_FILE, read_copying
from storylens.training.page import run_summary
from storylens.training.timeline import TIMELINE_FILE, evaluations, read_timeline
from storylens.training.train import CHECKPOINT, TrainConfig, quiz_perplexity, shipped_weights


def cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sweep_table() -> str:
    lines = (ROOT / "benchmarks" / "train_sweep.md").read_text().splitlines()
    table = [x for x in lines if x.startswith("|")]
    return (
        (
            "\nChosen from short runs of the same budget (600 steps; `benchmarks/train_sweep.md` in the "
            "repository):\n\n" + "\n".join(table) + "\n"
        )
        if table
        else ""
    )


def timeline_section(entries: list[dict], state: dict) -> str:
    """The card's "Heads as they formed" section, from the run's head timeline (empty without one)."""
    if not entries:
        return ""
    s = run_summary("tiny-storyteller", entries)
    rows = []
    for kind, f in s["formation"].items():
        if f is not None:
            when = f"{f['half_way_step']:,} ({f['half_way_tokens'] / 1e6:.1f} M)"
            rows.append(
                f"| {kind} | {f['head']} | {f['block']} | {f['first']:.3f} | {f['peak']:.3f} ({f['peak_step']:,}) | "
                f"{f['last']:.3f} | {'by ' + when + ', the first evaluation' if f['at_first'] else when} |"
            )
    ind = s["induction_step"]
    bumps = s["loss_bumps"]
    bump = (
        "The quiz loss never rose from one evaluation to the next."
        if not bumps
        else "The quiz loss rose at step " + ", ".join(f"{b['step']:,} (+{b['rise']:.3f} nats)" for b in bumps) + "."
    )
    share = state.get("timeline_seconds", 0.0) / state["train_seconds"] if state.get("train_seconds") else 0.0
    n = len(evaluations(entries))
    initial = n < len(entries)
    start = (
        f"Before its first step (the seeded initial weights) and at each of its {n} evaluations "
        if initial
        else f"At each of its {n} evaluations "
    )
    first = "score at step 0" if initial else "first score"
    return f"""
## Heads as they formed
{start}the run scored every head on the quiz, with the weights it
would have shipped at that step, and kept the table in `{TIMELINE_FILE}` (this folder; draw it with
`storylens timeline storylens/pretrained/tiny-storyteller --out timeline`). The strongest head of each
kind at the end, and when it got half way from its first score to its highest:

| kind | head | block | {first} | highest (step) | last score | half way at step (tokens) |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Induction test (a repeated run of random tokens): the loss on the second copy is
{s["second_copy_loss"]:.2f} nats against {s["first_copy_loss"]:.2f} on the first at the end; its largest rise
between two evaluations came at step {ind["step"]:,} (+{ind["rise"]:.3f}). {bump} The timeline took
{share:.1%} of the training time.
"""


def copying_sentence(copied: dict | None) -> str:
    """The card's sentence on copying from the training stories (``copying.json``), or nothing."""
    if not copied or copied.get("share") is None:
        return ""
    return (
        f" Of the {copied['runs']:,} {copied['run_words']}-word runs in {copied['samples']} stories it writes from the"
        f" end-of-story marker (seeds {copied['seed']} to {copied['seed'] + copied['samples'] - 1}, temperature 1,"
        f" `{COPYING_FILE}`), {copied['share']:.1%} occur word for word in its training stories."
    )


def write_model_card(
    folder: Path,
    state: dict,
    n_params: int,
    hardware: str,
    quiz_stories: int,
    train_stories: int,
    quiz_perplexity: float,
    choices: str = "",
    timeline: list[dict] | None = None,
    time_note: str = "",
    copied: dict | None = None,
) -> Path:
    """The shipped model's README: data and licence, recipe and how it was chosen, size, cost, the
    quiz perplexity curve, how to reproduce. ``quiz_perplexity`` is the shipped folder's own
    (``storylens perplexity``); ``choices`` a markdown table of the short runs behind the recipe."""
    cfg = TrainConfig(**state["train_config"])
    which = shipped_weights(state)
    with_ema = any(e.get("quiz_perplexity_ema") is not None for e in state["evals"])
    head = "| step | tokens (M) | quiz perplexity |" + (" with EMA weights |" if with_ema else "")
    rule = "|---|---|---|" + ("---|" if with_ema else "")
    evals = "\n".join(
        f"| {e['step']} | {e['step'] * cfg.batch_size * cfg.block_size / 1e6:.1f} | {e['quiz_perplexity']:.2f} |"
        + (f" {e['quiz_perplexity_ema']:.2f} |" if with_ema else "")
        for e in state["evals"]
    )
    tokens = state["step"] * cfg.batch_size * cfg.block_size
    recipe = "\n".join(f"| `{k}` | {v} |" for k, v in asdict(cfg).items())
    passes = tokens / (train_stories * 205)  # about 205 tokens per training story (1.7 M / 8,204)
    weights = (
        f"the exponential moving average of the weights (decay {cfg.ema_decay}), which the last evaluation "
        "found no worse than the raw weights"
        if which == "ema"
        else "the raw weights of the last step"
    )
    text = f"""---
license: cdla-sharing-1.0
library_name: storylens
tags: [storylens, tinystories, interpretability, gpt2]
---
# Tiny Storyteller (storylens)

The "Lesson 01" model that storylens reads: a GPT-2-style decoder, 6 blocks x 4 heads, head size 64
(d_model 256), a 256-token window, tied input/output embeddings, and a byte-level BPE tokenizer of
{cfg.vocab_size} tokens whose end-of-story marker `<|endoftext|>` follows every story (and so opens the next).

**{n_params:,} parameters. Quiz perplexity {quiz_perplexity:.2f}** on the {quiz_stories} held-out quiz stories
(`storylens perplexity`: each story fed as `[marker] + story`, cut to the window; exp of the mean
next-token loss). The lesson's model reached {LESSON_FIGURES.quiz_perplexity:g} on its own quiz.

## Data
TinyStories (Eldan & Li 2023, arXiv 2305.07759), licensed CDLA-Sharing-1.0: the {train_stories + quiz_stories:,}
stories of storylens's shared corpus, split in file order: the last {quiz_stories} are the quiz
(never trained on), the other {train_stories:,} train the tokenizer and the model. This folder
holds the quiz (`quiz.txt.gz`, so the lesson runs without the corpus), the leakage check computed
against the training stories (`leakage.json`) and the data's licence (`LICENSE-DATA.md`); no
training story.

## Recipe
AdamW (betas 0.9, 0.95; weight decay on matrices only), linear warm-up then cosine decay,
gradient clipping, random 256-token windows from the training stream,
{state["step"]:,} steps x {cfg.batch_size} x {cfg.block_size} tokens = {tokens / 1e6:.1f} M tokens
(about {passes:.0f} passes over the training stories). Dropout on the residual stream and embeddings
only: dropout on the attention probabilities doubled the time of a step here and lost to
residual-only dropout in the short runs below. fp32: bf16 autocast was measured slower on this CPU
(see `benchmarks/bench_perf.py`). The folder holds {weights}.

| setting | value |
|---|---|
{recipe}
{choices}
Quiz perplexity during training (the weights as they were at that step, and their moving average):

{head}
{rule}
{evals}

Training time: {state["train_seconds"] / 60:.1f} minutes, the training steps' wall clock summed (evaluations
and checkpoints not counted), on {hardware}.{" " + time_note if time_note else ""}
{timeline_section(timeline or [], state)}
## Reproduce
```
storylens train --out runs/tiny-storyteller --export storylens/pretrained/tiny-storyteller
```
(the defaults are the settings above; a killed run continues with `--resume`).

## Limits
The corpus here is {train_stories:,} training stories (about 1.7 M tokens), not the lesson's {LESSON_FIGURES.train_stories:,},
so the model sees each training token many times; training had to fit a 2-core CPU session.{copying_sentence(copied)}
"""
    return write_text_atomic(Path(folder) / "README.md", text)


def run_state(run: Path) -> dict:
    """The run's state: from its checkpoint while it has one, else the ``train_state.json`` it wrote when done."""
    if (run / CHECKPOINT).is_file():
        return load_checkpoint(run / CHECKPOINT)[2]
    if not (run / "train_state.json").is_file():
        sys.exit(f"{run}: neither {CHECKPOINT} nor train_state.json: not a training run's folder")
    return json.loads((run / "train_state.json").read_text(encoding="utf-8"))


def main() -> None:
    p = argparse.ArgumentParser(
        description="Write the shipped model's card (README.md) from the training run "
        "that made it, and the model line of the docs' lesson page."
    )
    p.add_argument(
        "run", type=Path, help="the training run's folder (holds checkpoint.safetensors or train_state.json)"
    )
    p.add_argument(
        "folder",
        type=Path,
        nargs="?",
        default=ROOT / "storylens" / "pretrained" / "tiny-storyteller",
        help="the shipped model folder (default: storylens/pretrained/tiny-storyteller)",
    )
    p.add_argument(
        "--time-note", default="", help="a sentence on how the training time was measured (the card quotes it)"
    )
    args = p.parse_args()
    run, folder = args.run, args.folder
    state = run_state(run)
    model = load_model(folder)
    split = load_split()
    ppl = quiz_perplexity(model, model.tokenizer, split.quiz)
    hardware = f"{cpu()}, {os.cpu_count()} cores (torch CPU build)"
    where = run if (run / TIMELINE_FILE).is_file() else folder
    if where == folder and (folder / TIMELINE_FILE).is_file():
        print(f"{run} holds no {TIMELINE_FILE}: the card's timeline is the one in {folder}", file=sys.stderr)
    timeline = read_timeline(where / TIMELINE_FILE) if (where / TIMELINE_FILE).is_file() else []
    path = write_model_card(
        folder,
        state,
        model.num_parameters(),
        hardware,
        len(split.quiz),
        len(split.train),
        ppl,
        sweep_table(),
        timeline,
        args.time_note,
        read_copying(run) or read_copying(folder),
    )
    print(f"{path}: quiz perplexity {ppl:.2f}")
    cfg = state["train_config"]
    line = (
        f"The shipped model was trained here ({len(split.train):,} training stories, {state['step']:,} steps of "
        f"{cfg['batch_size']} x {cfg['block_size']} tokens, {state['train_seconds'] / 60:.0f} minutes of training "
        f"time on {os.cpu_count()} CPU cores): **quiz perplexity {ppl:.2f}** (`storylens perplexity`; the lesson's model: {LESSON_FIGURES.quiz_perplexity:g}). "
        "The recipe, the short runs that chose it and the curve are in its model card "
        "(`storylens/pretrained/tiny-storyteller/README.md`)."
    )
    update("model-line", line)


if __name__ == "__main__":
    main()
