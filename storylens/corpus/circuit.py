"""``storylens circuit --stories``: every edge scored against the corpus loss under mean or zero ablation, the
faithfulness curve of the top circuits run exactly over the same stories, the oracle and the stability
(:mod:`storylens.circuits.stories` for what each is), streamed a chunk of stories at a time.

Up to four passes over the source, each a sum over stories: the writers' means (mean ablation only), the edge
scores (with the stability's Poisson resamples), the curve (the clean run, every size's circuit, the empty one
and each oracle edge ablated alone) and the stability's core. After each chunk (at most every
:data:`CHECKPOINT_S` seconds, and at each pass's end) the sums and the stories done are written atomically beside
``out`` (``OUT.checkpoint.safetensors``); ``resume`` goes on from there, so an interrupted run ends with the same
figures as an uninterrupted one. With ``engine="ray"`` the chunks go to Ray actors
(:func:`~storylens.corpus.ray_engine.run_chunks_on_ray`) and come back merged in story order: the same figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from storylens.circuits.edges import IG_STEPS, EdgeScores, edge_mask, graph_of
from storylens.circuits.faithfulness import PERCENTAGES, curve_of, top_circuit
from storylens.circuits.oracle import ORACLE_EDGES, oracle_choice, oracle_of, without_each
from storylens.circuits.run import CircuitResult, assemble, smallest_faithful, write_circuit
from storylens.circuits.stability import RESAMPLES, f_with_se, resampled, stability_of
from storylens.circuits.stories import (
    ABLATIONS,
    STORY_METHODS,
    EdgeSums,
    MeanSums,
    RowSums,
    edge_batch,
    loss_batch,
    story_batches,
    story_patterns,
    zero_values,
)
from storylens.core.errors import StorylensError, UsageError
from storylens.core.figures import known, plus_minus, sign_claimed
from storylens.core.files import checked_file
from storylens.core.progress import ProgressLines
from storylens.core.publish import check_target_folder, write_bytes_atomic
from storylens.corpus.ray_engine import run_chunks_on_ray
from storylens.corpus.score import weights_sha256
from storylens.data.sources import chunked
from storylens.engine.encode import BATCH_STORIES, encode_stories
from storylens.lm import AttentionLM
from storylens.viz.circuit import circuit_html

CHECKPOINT_SUFFIX = ".checkpoint.safetensors"
CHECKPOINT_S = 30.0  # the most seconds between checkpoints
CHUNK_STORIES = 64  # stories a chunk: the unit of checkpoints and of Ray work


@dataclass(frozen=True)
class StoryCircuitOptions:
    ablation: str = "mean"
    method: str = "eap"
    ig_steps: int = IG_STEPS
    oracle: int = ORACLE_EDGES
    resamples: int = RESAMPLES
    seed: int = 0
    batch_size: int = BATCH_STORIES
    chunk_stories: int = CHUNK_STORIES
    resume: bool = False
    engine: str = "local"
    workers: int = 2
    address: str | None = None
    model_source: str | None = None  # what Ray actors load (the driver's --model)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.ablation not in ABLATIONS:
            raise UsageError(f"--ablation: one of {', '.join(ABLATIONS)} (got {self.ablation})")
        if self.method not in STORY_METHODS:
            raise UsageError(
                f"--method {self.method}: on stories, one of {', '.join(STORY_METHODS)} (eap-ig-inputs moves the "
                "input from a corrupt prompt, and a corpus has none)"
            )
        if min(self.batch_size, self.chunk_stories, self.ig_steps) < 1 or min(self.oracle, self.resamples) < 0:
            raise UsageError("--batch-size, --chunk-stories, --ig-steps: 1 or more; --oracle, --resamples: 0 or more")
        if self.engine not in ("local", "ray"):
            raise UsageError(f"--engine: local or ray (got {self.engine})")

    def settings(self) -> dict:
        """What a checkpoint's fingerprint holds of them (a resumed run must measure alike)."""
        keys = ("ablation", "method", "ig_steps", "oracle", "resamples", "seed", "batch_size", "chunk_stories")
        return {k: getattr(self, k) for k in keys}


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + CHECKPOINT_SUFFIX)


# ---------------------------------------------------------------- one chunk (here or on a Ray actor)


def chunk_job(lm: AttentionLM, job: dict, start: int, texts: list[str]) -> dict[str, torch.Tensor]:
    """One chunk of stories (``start``: the first's index) through one pass, ``job["phase"]``: ``means``,
    ``scores`` or ``rows`` (each story's summed loss clean and with each of ``job["circuits"]``); its sums."""
    stories = [e.ids for e in encode_stories(lm, texts, frozenset(), start=start)]
    phase, size = job["phase"], job["batch_size"]
    if phase == "means":
        sums = MeanSums()
        for _, ids, valid in story_batches(lm, stories, size):
            sums.add(lm, ids, valid)
        return sums.t
    if phase == "scores":
        graph = graph_of(lm)
        acc = EdgeSums((len(graph.writers), len(graph.receivers)), job["resamples"], job["seed"])
        for rows, ids, valid in story_batches(lm, stories, size):
            c, n = edge_batch(lm, ids, valid, job["values"], job["method"], job["steps"])
            acc.add(c, n, [start + r for r in rows])
        return acc.t
    circuits = job["circuits"]
    losses = torch.zeros(len(stories), 1 + len(circuits), dtype=torch.float64)
    n = torch.zeros(len(stories), dtype=torch.float64)
    seen = torch.zeros(len(stories), dtype=torch.bool)
    every = edge_mask(graph_of(lm))[None]  # the clean run: the pass that makes the circuits' bases
    for rows, ids, valid in story_batches(lm, stories, size):
        losses[rows] = loss_batch(lm, ids, valid, job["values"], torch.cat([every, circuits.to(torch.bool)])).T
        n[rows] = valid[:, 1:].sum(1).to(torch.float64).cpu()
        seen[rows] = True
    return {"losses": losses[seen], "n": n[seen]}  # in story order


# ---------------------------------------------------------------- the passes, checkpointed


def _digest(tensors: dict[str, torch.Tensor], done: dict[str, int]) -> str:
    """SHA-256 of the stories done and every tensor (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256(json.dumps(done, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class _Passes:
    """The run's passes over ``source`` (``total`` stories), each resumed from the checkpoint where it holds it."""

    def __init__(self, lm: AttentionLM, source, total: int, ckpt: Path, fingerprint: dict, opts: StoryCircuitOptions):
        self.lm, self.source, self.total, self.ckpt, self.opts = lm, source, total, ckpt, opts
        self.fingerprint = fingerprint
        self.saved: dict[str, dict[str, torch.Tensor]] = {}  # pass -> its sums (finished or partial)
        self.done: dict[str, int] = {}  # pass -> stories done
        self.last_save = time.monotonic()
        if ckpt.exists():
            self._load()

    def _load(self) -> None:
        if not self.opts.resume:
            raise StorylensError(
                f"{self.ckpt}: an earlier run's checkpoint is there; pass --resume to go on from it "
                "(or delete it to start again)"
            )
        try:
            checked_file(self.ckpt, None, "delete it to start again")
            tensors = load_file(str(self.ckpt))
            with safe_open(str(self.ckpt), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("storylens", "{}"))
        except (OSError, ValueError, SafetensorError) as e:
            raise StorylensError(
                f"{self.ckpt}: not a readable checkpoint ({type(e).__name__}); delete it to start again"
            ) from None
        if not isinstance(meta, dict):
            meta = {}
        if meta.get("fingerprint") != self.fingerprint:
            raise StorylensError(
                f"{self.ckpt}: was made with other settings, model or stories; delete it to start again"
            )
        done = meta.get("done")
        if not isinstance(done, dict) or not all(isinstance(v, int) and 0 <= v <= self.total for v in done.values()):
            raise StorylensError(f"{self.ckpt}: not a valid checkpoint (its stories done); delete it to start again")
        if meta.get("digest") != _digest(tensors, done) or not all(t.isfinite().all() for t in tensors.values()):
            raise StorylensError(
                f"{self.ckpt}: not a valid checkpoint (its digest does not match what it holds: edited after storylens "
                "wrote it); delete it to start again"
            )
        self.done = done
        for key, t in tensors.items():
            name, _, part = key.partition(".")
            self.saved.setdefault(name, {})[part] = t

    def _save(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_save < CHECKPOINT_S:
            return
        tensors = {f"{name}.{k}": t.contiguous().clone() for name, part in self.saved.items() for k, t in part.items()}
        meta = {"storylens": json.dumps({"fingerprint": self.fingerprint, "done": self.done,
                                         "digest": _digest(tensors, self.done)})}  # fmt: skip
        tmp = self.ckpt.with_name(self.ckpt.name + ".part")
        save_file(tensors, str(tmp), metadata=meta)
        write_bytes_atomic(self.ckpt, tmp.read_bytes())
        tmp.unlink()
        self.last_save = time.monotonic()

    def run(self, name: str, job: dict, merge) -> None:
        """Pass ``name``: every chunk from where the checkpoint left it through ``chunk_job(job)``, its sums handed
        to ``merge(sums so far or None, chunk's) -> sums``; ``self.saved[name]`` holds them after."""
        start = self.done.get(name, 0)
        if start >= self.total:
            return
        job = {**job, "phase": name if name in ("means", "scores") else "rows", "batch_size": self.opts.batch_size}
        what = f"circuit: {name}"
        lines = ProgressLines(what, self.total, enabled=self.opts.progress, initial=start)
        bar = tqdm(
            total=self.total, initial=start, unit="story", desc=what, disable=None if self.opts.progress else True
        )

        def merged(part: dict, n: int) -> None:
            self.saved[name] = merge(self.saved.get(name), part)
            self.done[name] = self.done.get(name, 0) + n
            bar.update(n)
            lines.update(n)
            self._save()

        with bar:
            if self.opts.engine == "ray":
                run_chunks_on_ray(
                    self.opts.model_source, self.source, job, chunk_job, merged,
                    workers=self.opts.workers, address=self.opts.address, chunk_stories=self.opts.chunk_stories,
                    total=self.total, start=start, progress=False,
                )  # fmt: skip
            else:
                stories = islice(iter(self.source), start, self.total)
                for first, texts in chunked(stories, self.opts.chunk_stories, start):
                    merged(chunk_job(self.lm, job, first, texts), len(texts))
        self._save(force=True)


# ---------------------------------------------------------------- the run


def _sums(cls, **kw):
    """A merge for :meth:`_Passes.run`: the chunk's sums added to those so far (``cls``'s ``merge``)."""

    def merge(so_far: dict | None, part: dict) -> dict:
        mine = cls(**kw, tensors=part)
        return mine.t if so_far is None else cls(**kw, tensors=so_far).merge(mine).t

    return merge


def count_stories(source) -> tuple[int, str]:
    """How many stories ``source`` holds and a SHA-256 of their text in order (a checkpoint is resumed only over
    these very stories)."""
    n, digest = 0, hashlib.sha256()
    for story in source:
        raw = story.encode("utf-8")
        digest.update(len(raw).to_bytes(8, "little") + raw)
        n += 1
    if n == 0:
        raise StorylensError(f"{source.describe() if hasattr(source, 'describe') else 'stories'}: no stories")
    return n, digest.hexdigest()


def circuit_over_stories(
    lm: AttentionLM, source, out: str | os.PathLike, options: StoryCircuitOptions | None = None, **changes: Any
) -> CircuitResult:
    """Every pass of the module docstring over ``source``, checkpointed beside ``out``, then ``out`` written
    (circuit.json, circuit.csv, circuit.html, circuit.eap-ig.json where the model is ungrouped) and the checkpoint
    removed. ``options`` with any field given as a keyword changed."""
    opts = replace(options or StoryCircuitOptions(), **changes)
    out = Path(out)
    check_target_folder(out, kind="circuit")  # before any story: a bad one costs nothing
    result = _measured(lm, source, out, opts)
    page = circuit_html(result.to_dict(), title=f"storylens circuit: {result.model}", pairs=story_patterns(lm, source))
    write_circuit(out, result, page, d_model=lm.head_output_weights(0).shape[-1])
    checkpoint_path(out).unlink(missing_ok=True)
    return result


def _measured(lm: AttentionLM, source, out: Path, opts: StoryCircuitOptions) -> CircuitResult:
    """The passes and the result (:func:`circuit_over_stories`)."""
    total, text_sha = count_stories(source)
    fingerprint = {
        "model": str(lm.name), "weights_sha256": weights_sha256(lm), "stories": total, "stories_sha256": text_sha,
        "source": source.fingerprint() if hasattr(source, "fingerprint") else None, **opts.settings(),
    }  # fmt: skip
    passes = _Passes(lm, source, total, checkpoint_path(out), fingerprint, opts)
    graph = graph_of(lm)
    shape = (len(graph.writers), len(graph.receivers))
    if opts.ablation == "mean":
        passes.run("means", {}, _sums(MeanSums))
        values = MeanSums(passes.saved["means"]).values(lm)
    else:
        values = zero_values(lm)
    job = {"values": values, "method": opts.method, "steps": opts.ig_steps}
    passes.run(
        "scores",
        {**job, "resamples": opts.resamples, "seed": opts.seed},
        _sums(EdgeSums, shape=shape, resamples=opts.resamples, seed=opts.seed),
    )
    sums = EdgeSums(shape, opts.resamples, opts.seed, passes.saved["scores"])
    mean, se = sums.result()
    mask = edge_mask(graph)
    scores = EdgeScores(
        graph, torch.empty(0), mean.masked_fill(~mask, float("nan")), se.masked_fill(~mask, float("nan"))
    )
    sizes = [int(p * graph.n_edges) for p in PERCENTAGES]
    circuits = [top_circuit(scores, n) for n in sizes]
    chosen = oracle_choice(scores, opts.oracle, opts.seed) if opts.oracle else []
    runs = torch.stack([*circuits, torch.zeros_like(mask), *without_each(scores, chosen)])
    passes.run("curve", {**job, "circuits": runs}, _sums(RowSums))
    rows = RowSums(passes.saved["curve"]).t
    losses, n = rows["losses"], rows["n"]  # [story, 1 + run]: the clean run first
    clean, empty = losses[:, 0], losses[:, 1 + len(sizes)]
    f = curve_of(losses[:, 1 : 1 + len(sizes)].T, clean, empty, n, sizes, [int(c.sum()) for c in circuits],
                 PERCENTAGES, opts.seed)  # fmt: skip
    audit = None
    if chosen:
        audit = oracle_of(scores, chosen, losses[:, 2 + len(sizes) :].T - clean, n)
    stable, size = None, smallest_faithful(f)
    if opts.resamples and size and len(n) > 1:  # resamples of one story are that story: nothing to compare
        whole, jac, core = resampled(graph, scores.mean, sums.resampled(), size)
        passes.run("core", {**job, "circuits": core[None]}, _sums(RowSums))
        core_losses = RowSums(passes.saved["core"]).t["losses"][:, 1]
        gen = torch.Generator().manual_seed(opts.seed)  # stories' summed losses: the token counts cancel in f
        stable = stability_of(
            size, whole, jac, core, *f_with_se(torch.stack([core_losses, empty, clean]), 0, 1, 2, gen)
        )
    head: dict = dict(
        task="stories", ablation=opts.ablation, pairs=None, stories=int(len(n)), tokens=int(n.sum()),
        metric="summed next-token loss, pooled per predicted token (nats)",
        verdict=story_verdict(f.clean, f.clean_se, f.corrupt, f.corrupt_se, opts.ablation),
    )  # fmt: skip
    return assemble(lm, scores, f, audit, stable, method=opts.method, ig_steps=opts.ig_steps, **head)


def story_verdict(clean: float, clean_se: float, empty: float, empty_se: float, ablation: str) -> str:
    """Whether ablating every edge moves the loss beyond two standard errors: the gap every circuit is a share of."""
    gap, gap_se = empty - clean, (clean_se**2 + empty_se**2) ** 0.5
    said = (
        f"The model's loss is {plus_minus(clean, clean_se, one='story')[1:]} nats per token; with every edge "
        f"{ablation}-ablated {plus_minus(empty, empty_se, one='story')[1:]}: "
    )
    if not known(gap_se):
        return said + "with no error from one story, whether the gap is real is not known."
    return said + (
        "a gap beyond two standard errors, which each circuit keeps a share of." if sign_claimed(gap, gap_se)
        else "within two standard errors of it, so no circuit's share of the gap means anything."
    )  # fmt: skip
