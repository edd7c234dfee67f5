"""Train Tiny Storyteller on the training stories (Lesson 01's recipe).

AdamW, linear warm-up then cosine decay, gradient clipping, dropout, random
256-token windows cut from the training stream (``<eot> s1 <eot> s2 ...``), and
quiz perplexity evaluated every ``eval_every`` steps. A checkpoint is written
atomically every ``checkpoint_minutes`` and on Ctrl-C / SIGTERM; ``resume=True``
continues from it and reproduces the uninterrupted run's losses, because the data
order (a seeded ``torch.Generator``) and the dropout RNG are saved with it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import signal
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from storylens.core.errors import StorylensError, UsageError
from storylens.core.modes import eval_mode
from storylens.core.progress import ProgressLines
from storylens.core.publish import file_lock, os_error, write_text_atomic
from storylens.data.leakage import check_leakage
from storylens.data.stories import LEAKAGE_FILE, QUIZ_FILE, Split, quiz_file_bytes
from storylens.lm import NativeLM
from storylens.model.evaluate import next_token_perplexity
from storylens.model.gpt import GPT, GPTConfig
from storylens.model.hub import save_model_folder
from storylens.model.tokenizer import encode_story, encode_stream, eot_id, load_tokenizer, train_tokenizer
from storylens.training.checkpoint import (
    check_run_state,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
    validate_state,
)
from storylens.training.copying import COPYING_FILE, copying
from storylens.training.copying import SAMPLES as COPY_SAMPLES
from storylens.training.timeline import TIMELINE_FILE, read_timeline, timeline_entry, write_timeline

CHECKPOINT = "checkpoint.safetensors"


@dataclass
class TrainConfig:
    max_steps: int = 4500
    batch_size: int = 16
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.1  # residual and embedding dropout
    # attention-probability dropout (None: same as dropout). Off by default: it doubled the time of a
    # training step here (benchmarks/bench_perf.py) and lost to residual-only dropout on the quiz
    # (benchmarks/train_sweep.md)
    attn_dropout: float | None = 0.0
    ema_decay: float = 0.998  # exponential moving average of the weights (0: off); evaluated beside the raw weights
    vocab_size: int = 4096
    seed: int = 1337
    eval_every: int = 250
    checkpoint_minutes: float = 3.0
    dtype: str = "fp32"  # fp32 or bf16 (autocast; slower on CPUs without bf16 units: benchmarks/bench_perf.py)
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
            attn_dropout=self.attn_dropout,
        )


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


def ema_decay_at(step: int, cfg: TrainConfig) -> float:
    """The EMA's decay at ``step``: short at first (so the average does not remember the random
    start), then ``cfg.ema_decay``."""
    return min(cfg.ema_decay, (1 + step) / (10 + step))


def get_batch(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator):
    starts = torch.randint(len(stream) - cfg.block_size - 1, (cfg.batch_size,), generator=gen)
    x = torch.stack([stream[s : s + cfg.block_size] for s in starts.tolist()])
    y = torch.stack([stream[s + 1 : s + 1 + cfg.block_size] for s in starts.tolist()])
    return x, y


def quiz_perplexity(model: GPT, tok: Tokenizer, quiz: list[str], batch_size: int = 16) -> float:
    """exp(mean next-token loss) over every quiz story fed as ``[marker] + story`` (cut to the window):
    :func:`storylens.model.evaluate.next_token_perplexity`, as ``storylens perplexity`` computes it."""
    encoded = [encode_story(tok, s, model.config.block_size).ids for s in quiz]
    with eval_mode(model):
        return next_token_perplexity(lambda x: model(x).logits, encoded, pad_id=eot_id(tok), batch_size=batch_size)


def _validate_optimizer(path: Path, opt_sd: dict, optimizer) -> None:

    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = opt_sd.get("param_groups")
    if (
        not isinstance(groups, list)
        or len(groups) != len(optimizer.param_groups)
        or any(
            not isinstance(g, dict) or len(g.get("params", ())) != len(mine["params"])
            for g, mine in zip(groups, optimizer.param_groups)
        )
    ):
        raise StorylensError(f"{path}: optimizer settings do not match the run's model")
    state = opt_sd["state"]
    if set(state) - set(range(len(params))):
        raise StorylensError(f"{path}: optimizer state names parameters the model does not have")
    for pid, st in state.items():
        p = params[pid]
        ref = {"exp_avg": p.detach(), "exp_avg_sq": p.detach(), "step": torch.tensor(0.0)}
        validate_state(path, st, ref, f"optimizer state {pid}")


def _validate_rng(path: Path, rng: dict, gen: torch.Generator) -> None:

    validate_state(path, rng, {"data": gen.get_state(), "torch": torch.get_rng_state()}, "random state")


class _StopRequested(Exception):
    pass


def validate_config(cfg: TrainConfig) -> None:
    """One line for a setting no training can use (before anything is read or written)."""

    def bad(name, why):
        raise UsageError(f"--{name.replace('_', '-')}: {why}")

    for name in ("max_steps", "batch_size", "eval_every", "vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            bad(name, f"must be a whole number of at least 1 (got {v!r})")
    if cfg.warmup_steps < 0:
        bad("warmup_steps", f"must be 0 or more (got {cfg.warmup_steps})")
    if cfg.vocab_size < 257:
        bad("vocab_size", f"a byte-level tokenizer needs at least 257 tokens (got {cfg.vocab_size})")
    for name in ("lr", "min_lr", "weight_decay", "grad_clip", "checkpoint_minutes"):
        v = getattr(cfg, name)
        if not math.isfinite(v) or v < 0:
            bad(name, f"must be a finite number, 0 or more (got {v})")
    if cfg.lr <= 0:
        bad("lr", f"must be above 0 (got {cfg.lr})")
    for name in ("dropout", "attn_dropout"):
        v = getattr(cfg, name)
        if v is not None and not (math.isfinite(v) and 0 <= v < 1):
            bad(name, f"a probability: at least 0 and below 1 (got {v})")
    if not (math.isfinite(cfg.ema_decay) and 0 <= cfg.ema_decay < 1):
        bad("ema_decay", f"must be at least 0 and below 1 (got {cfg.ema_decay})")
    if cfg.n_embd % cfg.n_head:
        bad("n_embd", f"{cfg.n_embd} is not divisible by n_head={cfg.n_head}")
    if cfg.dtype not in ("fp32", "bf16"):
        bad("dtype", f"fp32 or bf16 (got {cfg.dtype!r})")


def fingerprint(texts) -> str:
    """sha256 of a list of stories (each with its length, so the split points count too)."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _check_fingerprints(ckpt_path: Path, saved: dict | None, now: dict) -> None:
    if not saved:
        return  # a checkpoint from before fingerprints were recorded: nothing to compare
    what = {"train": "the training stories", "quiz": "the quiz stories", "tokenizer": "tokenizer.json"}
    for key, name in what.items():
        if key in saved and saved[key] != now.get(key):
            raise StorylensError(
                f"{ckpt_path}: {name} changed since this run started; restore them or train into a new --out"
            )


def train(
    split: Split,
    out_dir: Path,
    cfg: TrainConfig,
    resume: bool = False,
    progress: bool = True,
    copying_samples: int = COPY_SAMPLES,
) -> dict:
    """Train (or resume) into ``out_dir``; returns the final state (losses, evals, timings).

    When the run is done, ``copying_samples`` stories generated by the weights it ships are checked
    against the training stories (:mod:`storylens.training.copying`, ``copying.json``; 0: not checked).

    One run at a time per folder (a lock: a second is refused with one line); temporary files
    carry the run's pid; the checkpoint records fingerprints of the corpus split and tokenizer,
    so ``resume`` refuses a folder whose data changed, and its tensors are validated before use.
    """

    validate_config(cfg)
    out_dir = Path(out_dir)
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise StorylensError(f"{out_dir}: exists and is not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise StorylensError(f"{out_dir}: a part of this path is a file, not a folder") from None
    except OSError as e:
        raise os_error(out_dir, e, "create") from None
    _check_run_folder(out_dir, resume)  # before the lock file: nothing is added to a folder of the user's
    with file_lock(out_dir / ".lock", str(out_dir)):
        remove_stale_temporaries(out_dir / CHECKPOINT)
        remove_stale_temporaries(out_dir / "tokenizer.json")
        return _train_locked(split, out_dir, cfg, resume, progress, copying_samples)


def _resume_from(ckpt_path: Path, tok_path: Path, cfg: TrainConfig, prints: dict) -> tuple[Tokenizer, dict, tuple]:
    """A checkpoint's run, refused if it was made with other settings or its corpus or tokenizer
    changed since: ``(tokenizer, state, (weights, optimizer, random states, EMA weights))``."""
    model_sd, opt_sd, state, rng, ema_sd = load_checkpoint(ckpt_path)
    try:
        saved_cfg = TrainConfig(**state["train_config"])
    except (KeyError, TypeError) as e:
        raise StorylensError(f"{ckpt_path}: checkpoint has no usable training settings ({e})") from None
    check_run_state(ckpt_path, state, saved_cfg.max_steps)
    if saved_cfg != cfg:
        diff = {k: (v, getattr(cfg, k)) for k, v in asdict(saved_cfg).items() if getattr(cfg, k) != v}
        raise StorylensError(f"{ckpt_path}: checkpoint was made with other settings {diff}")
    tok = load_tokenizer(tok_path)
    prints["tokenizer"] = _file_digest(tok_path)
    _check_fingerprints(ckpt_path, state.get("fingerprints"), prints)
    return tok, state, (model_sd, opt_sd, rng, ema_sd)


def _fresh_start(split: Split, tok_path: Path, cfg: TrainConfig, prints: dict) -> tuple[Tokenizer, dict]:
    """A new run: its tokenizer trained on the training stories and written to ``tok_path``, and
    its state at step 0 with the fingerprints of its corpus and tokenizer."""
    tok = train_tokenizer(split.train, cfg.vocab_size)
    if tok.get_vocab_size() != cfg.vocab_size:
        raise StorylensError(
            f"corpus: too small for a {cfg.vocab_size:,}-token vocabulary (byte-level BPE found only "
            f"{tok.get_vocab_size():,} tokens in the training stories); give more stories or "
            f"--vocab-size {tok.get_vocab_size()}"
        )
    write_text_atomic(tok_path, tok.to_str())
    prints["tokenizer"] = _file_digest(tok_path)
    state = {
        "step": 0,
        "losses": [],
        "evals": [],
        "train_seconds": 0.0,
        "timeline_seconds": 0.0,
        "train_config": asdict(cfg),
        "fingerprints": prints,
    }
    return tok, state


def _training_stream(tok: Tokenizer, split: Split, cfg: TrainConfig) -> torch.Tensor:
    """The training stories as one token stream (``<eot> s1 <eot> s2 ...``), refused shorter than a window."""
    stream = torch.tensor(encode_stream(tok, split.train), dtype=torch.long)  # [tokens]
    if len(stream) < cfg.block_size + 2:
        raise StorylensError(
            f"corpus: the training stories make {len(stream):,} tokens, fewer than one "
            f"{cfg.block_size}-token window; give more stories"
        )
    return stream


@dataclass
class _Run:
    """A training run's live parts: the model (and its EMA), the optimizer, the data order, the
    state saved with each checkpoint and the head timeline measured at each evaluation."""

    cfg: TrainConfig
    split: Split
    out_dir: Path
    tok: Tokenizer
    state: dict
    model: GPT
    optimizer: torch.optim.Optimizer
    gen: torch.Generator  # the data order
    ema_model: GPT | None  # the weights' moving average (None: cfg.ema_decay is 0)
    timeline: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        # the EMA's and the model's parameters, in the same order: one fused lerp a step
        self._ema_params: list[torch.Tensor] = list(self.ema_model.parameters()) if self.ema_model is not None else []
        self._raw_params: list[torch.Tensor] = list(self.model.parameters())

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.block_size

    def shipped(self, weights: str) -> GPT:
        """The model behind ``weights`` (``shipped_weights``' answer: ``ema`` or ``raw``)."""
        return self.ema_model if weights == "ema" and self.ema_model is not None else self.model

    def start_timeline(self, resume: bool) -> None:
        """The head timeline: the entries up to the checkpoint's step (a later one is measured again);
        a run at step 0 first measures its initial weights, before any step."""
        path = self.out_dir / TIMELINE_FILE
        if resume and path.exists():
            self.timeline = [e for e in read_timeline(path) if e["step"] <= self.state["step"]]
        if self.state["step"] == 0 and not self.timeline:
            self._add_to_timeline(timeline_entry(0, 0, "initial", self.model, self.tok, self.split.quiz))
        write_timeline(path, self.timeline)

    def _add_to_timeline(self, entry: dict) -> None:
        """Keep a measured entry, its seconds counted in the state's ``timeline_seconds``."""
        self.timeline.append(entry)
        self.state["timeline_seconds"] = self.state.get("timeline_seconds", 0.0) + entry["seconds"]

    def train_step(self, stream: torch.Tensor) -> tuple[float, float]:
        """One optimizer step on a random batch of ``stream``, the EMA moved towards the new weights;
        returns the loss and the seconds it took."""
        cfg, step = self.cfg, self.state["step"]
        t0 = time.time()
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = get_batch(stream, cfg, self.gen)  # [batch, block_size] each
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
            loss = self.model(x, y).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        if self.ema_model is not None:
            with torch.no_grad():
                torch._foreach_lerp_(self._ema_params, self._raw_params, 1.0 - ema_decay_at(step, cfg))
        dt = time.time() - t0
        self.state["step"] = step + 1
        self.state["losses"].append(round(loss.item(), 6))
        self.state["train_seconds"] += dt
        return loss.item(), dt

    def evaluate(self, progress: bool) -> None:
        """The quiz perplexity of the weights (and of the EMA's), and the timeline's entry for the
        weights this run would ship if it stopped here (``shipped_weights``' rule)."""
        step, quiz = self.state["step"], self.split.quiz
        ppl = quiz_perplexity(self.model, self.tok, quiz)
        row = {
            "step": step,
            "quiz_perplexity": ppl,
            "tokens": step * self.tokens_per_step,
            "train_seconds": round(self.state["train_seconds"], 1),
        }
        if self.ema_model is not None:
            row["quiz_perplexity_ema"] = quiz_perplexity(self.ema_model, self.tok, quiz)
        self.state["evals"].append(row)
        weights = shipped_weights({"evals": [row]})
        entry = timeline_entry(step, row["tokens"], weights, self.shipped(weights), self.tok, quiz)
        self._add_to_timeline(entry)
        write_timeline(self.out_dir / TIMELINE_FILE, self.timeline)
        if progress:
            ema_txt = f" (EMA {row['quiz_perplexity_ema']:.3f})" if self.ema_model is not None else ""
            tqdm.write(f"step {step}: quiz perplexity {ppl:.3f}{ema_txt}")

    def checkpoint(self) -> None:
        """Save the weights, optimizer, state and both random states (data order and dropout) atomically."""
        rng = {"data": self.gen.get_state(), "torch": torch.get_rng_state()}
        save_checkpoint(self.out_dir / CHECKPOINT, self.model, self.optimizer, self.state, rng, ema=self.ema_model)


def _new_run(cfg: TrainConfig, split: Split, out_dir: Path, tok: Tokenizer, state: dict, saved: tuple | None) -> _Run:
    """The model, the optimizer and the data order made from ``cfg.seed``, then, resuming, the
    checkpoint's weights, optimizer and random states put back (each validated first); the EMA a
    copy of the weights, or the checkpoint's EMA weights."""
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
    ema_sd = None
    if saved is not None:
        model_sd, opt_sd, rng, ema_sd = saved
        ckpt_path = out_dir / CHECKPOINT
        expected = {k: v for k, v in model.state_dict().items()}
        validate_state(ckpt_path, model_sd, expected, "weights")
        if ema_sd is not None:
            validate_state(ckpt_path, ema_sd, expected, "EMA weights")
        _validate_optimizer(ckpt_path, opt_sd, optimizer)
        _validate_rng(ckpt_path, rng, gen)
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(opt_sd)
        gen.set_state(rng["data"])
        torch.set_rng_state(rng["torch"])
    ema_model = None
    if cfg.ema_decay > 0:
        ema_model = copy.deepcopy(model)
        if ema_sd is not None:
            ema_model.load_state_dict(ema_sd)
        ema_model.eval()
    return _Run(cfg, split, out_dir, tok, state, model, optimizer, gen, ema_model)


def _train_loop(run: _Run, stream: torch.Tensor, progress: bool) -> None:
    """Train from the run's step to ``cfg.max_steps``: evaluate every ``eval_every`` steps and at the
    end, checkpoint every ``checkpoint_minutes`` and at the end. Ctrl-C / SIGTERM only raise a flag;
    the loop stops between two whole steps, so the checkpoint never holds a half-applied optimizer
    step, and raises ``KeyboardInterrupt`` once it is saved."""
    cfg, state = run.cfg, run.state
    stop = []

    def on_signal(signum, frame):
        stop.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    run.model.train()
    last_ckpt = time.time()
    bar = tqdm(
        total=cfg.max_steps, initial=state["step"], disable=None if progress else True, unit="step", dynamic_ncols=True
    )  # disable=None: a bar on a terminal only, no carriage returns into pipes
    lines = ProgressLines("training", cfg.max_steps, unit="steps", enabled=progress, initial=state["step"])
    try:
        while state["step"] < cfg.max_steps:
            if stop:
                raise _StopRequested()
            loss, dt = run.train_step(stream)
            if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.max_steps:
                run.evaluate(progress)
            bar.update(1)
            lines.update(1)  # off a terminal, instead of the bar
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{run.tokens_per_step / dt:,.0f}")
            if time.time() - last_ckpt > cfg.checkpoint_minutes * 60:
                run.checkpoint()
                last_ckpt = time.time()
        run.checkpoint()
    except _StopRequested:
        run.checkpoint()
        bar.close()
        raise KeyboardInterrupt(
            f"stopped at step {state['step']}; checkpoint saved to {run.out_dir / CHECKPOINT}"
        ) from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        bar.close()


RUN_FILES = frozenset({CHECKPOINT, "tokenizer.json", TIMELINE_FILE, "train_state.json", COPYING_FILE, ".lock"})
"""What a training run writes in its folder (and the temporaries ``.NAME.tmp-PID`` of the first two)."""


def _check_run_folder(out_dir: Path, resume: bool) -> None:
    """Refuse a fresh start (before anything, the lock file included, is written) in a folder holding files a
    training run does not write: the user's own folder (``--resume`` goes on in a run's folder, whatever else the
    user keeps beside it: a run never writes but its own names)."""
    if resume:
        return
    present = {p.name for p in out_dir.iterdir()}
    foreign = sorted(n for n in present if n not in RUN_FILES and not (n.startswith(".") and ".tmp-" in n))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise StorylensError(
            f"{out_dir}: holds files a training run does not write ({shown}); give an empty or new folder"
        )


def _check_fresh_start(out_dir: Path, resume: bool) -> None:
    """Under the run's lock: a fresh start over an earlier run's checkpoint is refused (``--resume`` goes on from
    it); a killed run's leftovers without one (its tokenizer, a temporary) are replaced."""
    if not resume and (out_dir / CHECKPOINT).exists():
        raise StorylensError(
            f"{out_dir}: an earlier run is there; pass --resume to go on from its checkpoint (or give a new folder)"
        )


def _train_locked(
    split: Split, out_dir: Path, cfg: TrainConfig, resume: bool, progress: bool, copying_samples: int
) -> dict:
    """:func:`train` in its locked folder: start or resume the run, train it, write its state and,
    once, the copying check of the weights it ships."""
    _check_fresh_start(out_dir, resume)
    tok_path = out_dir / "tokenizer.json"
    prints = {"train": fingerprint(split.train), "quiz": fingerprint(split.quiz)}
    saved = None
    if resume:
        tok, state, saved = _resume_from(out_dir / CHECKPOINT, tok_path, cfg, prints)
    else:
        tok, state = _fresh_start(split, tok_path, cfg, prints)
    run = _new_run(cfg, split, out_dir, tok, state, saved)
    stream = _training_stream(tok, split, cfg)
    # a finished run's state is written again when this one is done: none stale beside a newer timeline
    (out_dir / "train_state.json").unlink(missing_ok=True)
    run.start_timeline(resume)
    _train_loop(run, stream, progress)
    (out_dir / "train_state.json").write_text(json.dumps(state, indent=1))
    if copying_samples and not (out_dir / COPYING_FILE).exists():  # once, when the run is done
        weights = shipped_weights(state)
        shipped = run.shipped(weights)
        shipped.eval()
        result = copying(NativeLM(shipped, tok), split.train, samples=copying_samples)
        result = {"step": state["step"], "weights": weights, **result}
        write_text_atomic(out_dir / COPYING_FILE, json.dumps(result, indent=1) + "\n")
    return {"model": run.model, "tokenizer": tok, "state": state}


def lesson_files(split: Split) -> dict[str, bytes]:
    """What a model folder ships for the lesson besides its weights: the quiz stories (so the lesson
    runs without the corpus), the leakage check computed against the training stories, and the
    data's licence (TinyStories is CDLA-Sharing-1.0)."""
    leakage = check_leakage(split.quiz, split.train)
    licence = (resources.files("storylens") / "licenses" / "CDLA-Sharing-1.0.txt").read_text(encoding="utf-8")
    notice = f"""# Data licence

This folder holds {len(split.quiz)} stories of TinyStories (`{QUIZ_FILE}`, the quiz the model never trained on)
and weights trained on {len(split.train):,} other TinyStories stories.

TinyStories: Ronen Eldan and Yuanzhi Li, "TinyStories: How Small Can Language Models Be and Still
Speak Coherent English?" (2023, arXiv 2305.07759), published under the Community Data License
Agreement - Sharing, Version 1.0 (CDLA-Sharing-1.0), reproduced below. The stories are unchanged.

---

"""
    return {
        QUIZ_FILE: quiz_file_bytes(split.quiz),
        LEAKAGE_FILE: json.dumps(leakage.to_dict(), indent=1).encode("utf-8"),
        "LICENSE-DATA.md": (notice + licence).encode("utf-8"),
    }


def shipped_weights(state: dict) -> str:
    """``"ema"`` when the run kept an average of its weights and the last evaluation found it no
    worse on the quiz than the raw weights, else ``"raw"``."""
    last = state["evals"][-1] if state.get("evals") else {}
    ema, raw = last.get("quiz_perplexity_ema"), last.get("quiz_perplexity")
    return "ema" if ema is not None and raw is not None and ema <= raw else "raw"


def export_checkpoint(run_dir: Path, folder: Path, extra_files: dict[str, bytes] | None = None) -> Path:
    """Turn a training run's checkpoint into a model folder (config, safetensors, tokenizer, and
    ``extra_files``, e.g. :func:`lesson_files`, and the run's head timeline), published in one step. The weights are the run's
    EMA when its last evaluation found them no worse than the raw ones (:func:`shipped_weights`)."""

    run_dir = Path(run_dir)
    model_sd, _, state, _, ema_sd = load_checkpoint(run_dir / CHECKPOINT)
    cfg = TrainConfig(**state["train_config"])
    mcfg = cfg.model_config()
    mcfg.dropout, mcfg.attn_dropout = 0.0, None  # inference folder: dropout off
    model = GPT(mcfg)
    model.load_state_dict(ema_sd if ema_sd is not None and shipped_weights(state) == "ema" else model_sd)
    extra = dict(extra_files or {})
    for name in (TIMELINE_FILE, COPYING_FILE):  # the run's head timeline and copying check ship with its model
        if (run_dir / name).is_file():
            extra[name] = (run_dir / name).read_bytes()
    return save_model_folder(model, load_tokenizer(run_dir / "tokenizer.json"), folder, extra)
