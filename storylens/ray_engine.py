"""Scoring on Ray: Ray Data hands chunks of stories to a pool of actors, each holding the model.

The driver streams the source (:mod:`storylens.sources`) in chunks of ``chunk_stories`` stories,
numbered by the index of their first story, and gives Ray Data a window of chunks at a time
(``ray.data.from_items``). ``map_batches`` runs :class:`ChunkScorer` actors (``concurrency``
actors, one CPU and one torch thread each) that load the model once; each call scores one whole
chunk, exactly as the single-process run batches it, and returns that chunk's accumulator state
(float64 sums and counts), never a running total. The driver merges the states as they come (sums
of float64, in any order). A chunk is therefore counted once however the chunks are spread over
the actors; an actor killed mid-chunk is restarted by Ray Data (its actors have
``max_restarts=-1``, ``max_task_retries=-1``) and the chunk is scored again from the start, so
nothing is lost or counted twice.

Without ``address`` a local Ray is started on this machine; with one, the driver joins that
cluster (every node needs storylens, torch and the model: see the README).
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from .errors import StorylensError
from .score import BATCH_STORIES, CHUNK_STORIES

WINDOW_CHUNKS_PER_WORKER = 8  # chunks given to Ray Data at a time, per worker (bounds the driver's memory)


class ChunkScorer:
    """A Ray Data actor: the model, loaded once; each call scores one chunk of stories."""

    def __init__(self, model_source, names, batch_size: int, detectors=None):
        import torch

        from .analysis.detectors import BUILTIN_DETECTORS
        from .lm import load_lm

        torch.set_num_threads(1)  # one thread per actor: the pool is the parallelism
        self.lm = load_lm(model_source)
        self.names = frozenset(names)
        self.batch_size = batch_size
        self.detectors = tuple(detectors) if detectors is not None else BUILTIN_DETECTORS

    def __call__(self, batch: dict) -> dict:
        from .analysis.record import record
        from .analysis.scores import HeadScoreAccumulator

        out = {"start": [], "state": [], "n": [], "cut": [], "main": [], "pid": [], "peak_mb": []}
        for start, texts in zip(batch["start"], batch["texts"]):
            texts = [str(t) for t in texts]
            acc = HeadScoreAccumulator(self.lm.n_layer, self.lm.n_head, self.detectors)
            stats = record(self.lm, texts, [acc], batch_size=self.batch_size, names=self.names, progress=False,
                           chunk_stories=len(texts), start=int(start))
            out["start"].append(int(start))
            out["state"].append(json.dumps(acc.state()))
            out["n"].append(stats.n_stories)
            out["cut"].append(stats.n_cut)
            out["main"].append(stats.n_main_character)
            out["pid"].append(os.getpid())
            out["peak_mb"].append(peak_rss_mb())
        return out


def peak_rss_mb() -> float:
    """This process's resident-memory high-water mark, from the OS: ``VmHWM`` (Linux; it starts
    afresh at exec, where ``ru_maxrss`` carries the parent's peak over), else ``ru_maxrss``."""
    import resource
    import sys

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def _init_ray(address: str | None, workers: int):
    try:
        import ray
    except ImportError:
        raise StorylensError("--engine ray needs Ray: pip install 'storylens[ray]'") from None
    if not ray.is_initialized():
        kw = {"address": address} if address else {"num_cpus": workers}
        try:
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                     ignore_reinit_error=True, **kw)
        except Exception as e:  # connection refused, bad address, ...
            raise StorylensError(f"ray: cannot {'join ' + address if address else 'start a local Ray'} "
                                 f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    return ray


def score_with_ray(model_source, source: Iterable[str], names, acc, *, workers: int = 2, address: str | None = None,
                   batch_size: int = BATCH_STORIES, chunk_stories: int = CHUNK_STORIES, total: int | None = None, progress: bool = True,
                   detectors=None, details: dict | None = None, start: int = 0, on_window=None):
    """Score every chunk of ``source`` on Ray and merge the chunks' states into ``acc``; returns the
    :class:`~storylens.analysis.record.RecordStats` of the stories it scored (see the module docstring).
    ``start``: the index of the first story of ``source`` (a resumed run); ``on_window(stats)`` is
    called whenever every chunk given to Ray so far has come back (where a long run checkpoints)."""
    from tqdm.auto import tqdm

    from .analysis.encode import chunked
    from .analysis.record import RecordStats
    from .analysis.scores import HeadScoreAccumulator

    if workers < 1:
        raise StorylensError(f"--workers: must be at least 1 (got {workers})")
    ray = _init_ray(address, workers)
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.preserve_order = False
    stats = RecordStats(0, 0, 0)
    names = sorted(names)
    actor_peaks: dict[int, float] = {}
    window = WINDOW_CHUNKS_PER_WORKER * workers
    seen: set[int] = set()
    with tqdm(total=total, initial=start, unit="story", desc=f"recording attention on Ray ({workers} workers)",
              disable=None if progress else True) as bar:
        items: list[dict] = []
        pieces = chunked(source, chunk_stories, start)
        while True:
            items = [{"start": s, "texts": t} for s, t in _take(pieces, window)]
            if not items:
                break
            ds = ray.data.from_items(items, override_num_blocks=len(items))
            ds = ds.map_batches(ChunkScorer, batch_size=1, concurrency=workers, num_cpus=1,
                                fn_constructor_kwargs={"model_source": model_source, "names": names,
                                                       "batch_size": batch_size, "detectors": detectors})
            for row in ds.iter_rows():
                start = int(row["start"])
                if start in seen:  # Ray Data returns each chunk once; a repeat would be a bug, not a sum
                    raise StorylensError(f"ray: chunk at story {start} came back twice")
                seen.add(start)
                part = HeadScoreAccumulator(acc.n_layer, acc.n_head, acc.detectors).load_state(json.loads(row["state"]))
                acc.merge(part)
                stats = stats + RecordStats(int(row["n"]), int(row["cut"]), int(row["main"]))
                pid = int(row["pid"])
                actor_peaks[pid] = max(actor_peaks.get(pid, 0.0), float(row["peak_mb"]))
                bar.update(int(row["n"]))
            if on_window is not None:
                on_window(stats)
    if stats.n_stories == 0:
        raise StorylensError("stories: nothing to score (no story)")
    if details is not None:
        details["actor_peak_mb"] = actor_peaks  # each actor process's peak memory (benchmarks)
    return stats


def _take(it, n: int) -> list:
    out = []
    for x in it:
        out.append(x)
        if len(out) == n:
            break
    return out
