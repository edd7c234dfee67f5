"""Train Tiny Storyteller on the training stories (Lesson 01's recipe).

AdamW, linear warm-up then cosine decay, gradient clipping, dropout, random
256-token windows cut from the training stream (``<eot> s1 <eot> s2 ...``), and
quiz perplexity evaluated every ``eval_every`` steps. A checkpoint is written
atomically every ``checkpoint_minutes`` and on Ctrl-C / SIGTERM; ``resume=True``
continues from it and reproduces the uninterrupted run's losses, because the data
order (a seeded ``torch.Generator``) and the dropout RNG are saved with it.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import load_checkpoint, save_checkpoint
from .data import Split
from .errors import StorylensError
from .model import GPT, GPTConfig
from .tokenizer import encode_story, encode_stream, load_tokenizer, train_tokenizer

CHECKPOINT = "checkpoint.safetensors"


@dataclass
class TrainConfig:
    max_steps: int = 2000
    batch_size: int = 16
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.1
    vocab_size: int = 4096
    seed: int = 1337
    eval_every: int = 250
    checkpoint_minutes: float = 3.0
    dtype: str = "fp32"  # fp32 or bf16 (autocast); see benchmarks/bench_core.py
    # the model architecture (the lesson's: 6 blocks x 4 heads, d_model 256, window 256)
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 256

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
        )


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


def get_batch(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator):
    starts = torch.randint(len(stream) - cfg.block_size - 1, (cfg.batch_size,), generator=gen)
    x = torch.stack([stream[s : s + cfg.block_size] for s in starts.tolist()])
    y = torch.stack([stream[s + 1 : s + 1 + cfg.block_size] for s in starts.tolist()])
    return x, y


@torch.no_grad()
def quiz_perplexity(model: GPT, tok, quiz: list[str], batch_size: int = 16) -> float:
    """exp(mean next-token loss) over every quiz story fed as ``[marker] + story`` (cut to the window)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    encoded = [encode_story(tok, s, model.config.block_size).ids for s in quiz]
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i : i + batch_size]
        T = max(len(e) for e in chunk)
        x = torch.zeros(len(chunk), T - 1, dtype=torch.long)
        y = torch.full((len(chunk), T - 1), -1, dtype=torch.long)
        for j, e in enumerate(chunk):
            x[j, : len(e) - 1] = torch.tensor(e[:-1])
            y[j, : len(e) - 1] = torch.tensor(e[1:])
        out = model(x, y)
        n = int((y >= 0).sum())
        total += float(out.loss) * n
        count += n
    model.train(was_training)
    return math.exp(total / count)


class _StopRequested(Exception):
    pass


def train(split: Split, out_dir: Path, cfg: TrainConfig, resume: bool = False, progress: bool = True) -> dict:
    """Train (or resume) into ``out_dir``; returns the final state (losses, evals, timings)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / CHECKPOINT
    tok_path = out_dir / "tokenizer.json"

    if resume:
        model_sd, opt_sd, state, rng = load_checkpoint(ckpt_path)
        saved_cfg = TrainConfig(**state["train_config"])
        if saved_cfg != cfg:
            diff = {k: (v, getattr(cfg, k)) for k, v in asdict(saved_cfg).items() if getattr(cfg, k) != v}
            raise StorylensError(f"{ckpt_path}: checkpoint was made with other settings {diff}")
        tok = load_tokenizer(tok_path)
    else:
        tok = train_tokenizer(split.train, cfg.vocab_size)
        tok.save(str(tok_path))
        state = {"step": 0, "losses": [], "evals": [], "train_seconds": 0.0, "train_config": asdict(cfg)}

    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    if resume:
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(opt_sd)
        gen.set_state(rng["data"])
        torch.set_rng_state(rng["torch"])

    stream = torch.tensor(encode_stream(tok, split.train), dtype=torch.long)
    tokens_per_step = cfg.batch_size * cfg.block_size

    def checkpoint():
        save_checkpoint(ckpt_path, model, optimizer, state, {"data": gen.get_state(), "torch": torch.get_rng_state()})

    # Ctrl-C / SIGTERM only raise a flag; the loop stops between two whole steps,
    # so the checkpoint never holds a half-applied optimizer step.
    stop = []

    def on_signal(signum, frame):
        stop.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    model.train()
    last_ckpt = time.time()
    bar = tqdm(total=cfg.max_steps, initial=state["step"], disable=not progress, unit="step", dynamic_ncols=True)
    try:
        while state["step"] < cfg.max_steps:
            if stop:
                raise _StopRequested()
            step = state["step"]
            t0 = time.time()
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, cfg)
            x, y = get_batch(stream, cfg, gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
                loss = model(x, y).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            dt = time.time() - t0
            state["step"] = step + 1
            state["losses"].append(round(float(loss), 6))
            state["train_seconds"] += dt
            if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.max_steps:
                ppl = quiz_perplexity(model, tok, split.quiz)
                state["evals"].append({"step": state["step"], "quiz_perplexity": ppl})
                tqdm.write(f"step {state['step']}: quiz perplexity {ppl:.3f}") if progress else None
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
            if time.time() - last_ckpt > cfg.checkpoint_minutes * 60:
                checkpoint()
                last_ckpt = time.time()
        checkpoint()
    except _StopRequested:
        checkpoint()
        bar.close()
        raise KeyboardInterrupt(f"stopped at step {state['step']}; checkpoint saved to {ckpt_path}") from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        bar.close()
    (out_dir / "train_state.json").write_text(json.dumps(state, indent=1))
    return {"model": model, "tokenizer": tok, "state": state}


def export_checkpoint(run_dir: Path, folder: Path) -> Path:
    """Turn a training run's checkpoint into a model folder (config, safetensors, tokenizer)."""
    from .hub import save_model_folder

    run_dir = Path(run_dir)
    model_sd, _, state, _ = load_checkpoint(run_dir / CHECKPOINT)
    cfg = TrainConfig(**state["train_config"])
    mcfg = cfg.model_config()
    mcfg.dropout = 0.0  # inference folder: dropout off
    model = GPT(mcfg)
    model.load_state_dict(model_sd)
    return save_model_folder(model, load_tokenizer(run_dir / "tokenizer.json"), folder)


def write_model_card(folder: Path, state: dict, n_params: int, hardware: str, quiz_stories: int, train_stories: int) -> Path:
    """The shipped model's README: data and licence, recipe, size, cost, quiz perplexity, how to reproduce."""
    cfg = TrainConfig(**state["train_config"])
    final = state["evals"][-1]["quiz_perplexity"] if state["evals"] else float("nan")
    evals = "\n".join(f"| {e['step']} | {e['quiz_perplexity']:.2f} |" for e in state["evals"])
    tokens = state["step"] * cfg.batch_size * cfg.block_size
    recipe = "\n".join(f"| `{k}` | {v} |" for k, v in asdict(cfg).items())
    text = f"""---
license: cdla-sharing-1.0
library_name: storylens
tags: [storylens, tinystories, interpretability, gpt2]
---
# Tiny Storyteller (storylens)

The "Lesson 01" model that storylens reads: a GPT-2-style decoder, 6 blocks x 4 heads, head size 64
(d_model 256), a 256-token window, tied input/output embeddings, and a byte-level BPE tokenizer of
{cfg.vocab_size} tokens whose end-of-story marker `<|endoftext|>` follows every story (and so opens the next).

**{n_params:,} parameters. Quiz perplexity {final:.2f}** on the 200 held-out quiz stories
(each fed as `[marker] + story`, cut to the window; exp of the mean next-token loss).
The lesson's model reached 9 on its own quiz; see "Limits" below.

## Data
TinyStories (Eldan & Li 2023, arXiv 2305.07759), licensed CDLA-Sharing-1.0: the {train_stories + quiz_stories:,}
stories of storylens's shared corpus, split in file order: the last {quiz_stories} are the quiz
(never trained on), the other {train_stories:,} train the tokenizer and the model. This folder
holds no story text.

## Recipe
AdamW (betas 0.9, 0.95; weight decay on matrices only), linear warm-up then cosine decay,
gradient clipping, dropout, random 256-token windows from the training stream,
{state['step']:,} steps x {cfg.batch_size} x {cfg.block_size} tokens = {tokens / 1e6:.1f} M tokens.
fp32: bf16 autocast was measured {''}slower on this CPU (see `benchmarks/bench_core.py`).

| setting | value |
|---|---|
{recipe}

Quiz perplexity during training:

| step | quiz perplexity |
|---|---|
{evals}

Training time: {state['train_seconds'] / 60:.1f} minutes of compute on {hardware}.

## Reproduce
```
storylens train --out runs/tiny-storyteller --export storylens/pretrained/tiny-storyteller
```
(the defaults are the settings above; a killed run continues with `--resume`).

## Limits
The corpus here is {train_stories:,} training stories (about 1.7 M tokens), not the lesson's 19,800,
and training had to fit a 2-core CPU session, so the model saw each token only a few times.
"""
    path = Path(folder) / "README.md"
    path.write_text(text)
    return path
