"""Scoring on Ray: one streaming Ray Data pipeline for the whole run, from the stories to the sums.

* **Reading, on the workers.** A :class:`~storylens.data.sources.StorySource` (a text, JSON-lines or
  Parquet file, a saved or hub dataset) is picklable, so the driver sends only the plan: read tasks
  (``READ_TASKS_PER_WORKER`` per worker), each given a run of consecutive chunks, open the source
  where they run and yield one block per chunk of ``chunk_stories`` stories, numbered by the index
  of its first story. The chunks are cut exactly where one process cuts them (whatever the file's
  own blocks), so every batch is the batch the single-process run makes, and the result equals it
  within 1e-9, not merely within a float32 bound. The source must be readable at the same place on
  every node (a shared file system or a hub id; on one machine, always). A sequence of stories in
  the driver's memory is sent by the driver instead.
* **Scoring, on actors that live for the run.** ``map_batches`` runs one pool of
  :class:`ChunkScorer` actors (``workers``, but no more than the cluster has CPUs: one CPU and one
  torch thread each) that load the model once; each call scores one whole chunk and returns that
  chunk's accumulator state (float64 sums and counts), never a running total.
* **Merging, in order.** The driver merges each chunk's state when every earlier chunk has been
  merged (a chunk that finishes early waits), so the sums are added in story order whatever the
  actors' order, and what is merged is always exactly the first stories: a checkpoint taken there
  (``on_progress``) resumes exactly. A chunk is counted once however the chunks are spread over the
  actors; an actor killed mid-chunk is restarted by Ray Data (at most :data:`RESTARTS` times, the chunk
  tried again as often) and the chunk scored again from the start, so nothing is lost or counted
  twice; an actor that dies every time ends the run in one line. A control store (GCS) that stops answering
  ends it in one line too (Ray's own driver would exit with nothing said while its logs are turned down).

Without ``address`` a new local Ray is started on this machine, listening on 127.0.0.1 only (never
another cluster found through ``$RAY_ADDRESS`` or the last Ray started on the machine); with one,
the driver joins that cluster (every node needs storylens, torch and the model: see the README),
failing within seconds where nothing answers. Ray's own log lines stay in its session logs, and an
error in an actor (a user detector's, say) comes back as one :class:`StorylensError` line.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from tqdm.auto import tqdm

from storylens.core.errors import StorylensError, UsageError, install_hint
from storylens.core.progress import ProgressLines
from storylens.core.publish import fault_point
from storylens.data.sources import StorySource, chunk_spans, chunked, read_chunk_run
from storylens.engine import masks
from storylens.engine.encode import BATCH_STORIES, CHUNK_STORIES
from storylens.engine.record import RecordStats, record
from storylens.lm import load_lm
from storylens.looking.detectors import BUILTIN_DETECTORS
from storylens.table.accumulator import HeadScoreAccumulator

try:
    import resource
except ImportError:  # not on Windows: there peak_rss_mb has no ru_maxrss to fall back on
    resource = None  # type: ignore[assignment]

READ_TASKS_PER_WORKER = 1  # read tasks per actor: each reads its own run of consecutive chunks
IN_FLIGHT = 2  # chunks an actor holds: the one it scores and the next (no wait between chunks)
RESTARTS = 3  # an actor that dies is started again this many times, and a chunk tried again as often (Ray Data's
# default is forever: an actor that dies on every chunk, out of memory say, would hang the run)
GCS_POLL_S, GCS_MISSES = 2.0, 5  # the cluster's control store asked every 2 s; 5 misses in a row: it is gone
ACTORS_START_S = 1800  # how long the actors may take to start and load the model
ADDRESS_TIMEOUT_S = 5  # how long --address may take to accept a connection
GCS_WAIT = "RAY_gcs_server_port_wait_time_s"  # how many tries (about a second apart) ray.init makes at a GCS


class ChunkScorer:
    """A Ray Data actor: the model, loaded once; each call scores one chunk of stories."""

    def __init__(self, model_source, names, batch_size: int, detectors=None, examples: int = 0, effects=None):
        torch.set_num_threads(1)  # one thread per actor: the pool is the parallelism
        self.lm = load_lm(model_source)
        self.names = frozenset(names)
        self.batch_size = batch_size
        self.detectors = tuple(detectors) if detectors is not None else BUILTIN_DETECTORS
        self.examples = examples
        # the effect columns, as the driver's accumulator has them (EffectParts.settings: AtP and DLA, the exact
        # effect's plan, an estimator, the AtP audit)
        self.effects = dict(effects or {})

    def __call__(self, batch: dict) -> dict:
        fault_point("ray-chunk")  # tests/test_ray_robust.py: an actor that dies on every chunk
        try:
            return self._score(batch)
        except Exception as e:  # one line, naming a user detector, for the driver to show
            raise StorylensError(_actor_failure(e)) from None

    def _score(self, batch: dict) -> dict:

        out: dict[str, list] = {"start": [], "state": [], "n": [], "cut": [], "main": [], "pid": [], "peak_mb": []}
        for start, texts in zip(batch["start"], batch["texts"]):
            texts = [str(t) for t in texts]
            acc = HeadScoreAccumulator(
                self.lm.n_layer, self.lm.n_head, self.detectors, examples=self.examples, **self.effects
            )
            stats = record(
                self.lm,
                texts,
                [acc],
                batch_size=self.batch_size,
                names=self.names,
                progress=False,
                chunk_stories=len(texts),
                start=int(start),
            )
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
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def _actor_failure(e: BaseException) -> str:
    """One line for an exception raised while an actor scored a chunk. A user pattern (called from
    :meth:`Masks.pattern_keys <storylens.engine.masks.Masks.pattern_keys>`) is named
    by its file, as ``--detector FILE`` gave it."""

    what = f"{type(e).__name__}: {_one_line(e)}"
    tb, found = e.__traceback__, None
    while tb is not None:  # where the pattern is called: masks._pattern_weights (its local fn)
        frame = tb.tb_frame
        if frame.f_code.co_name == "_pattern_weights" and frame.f_code.co_filename == masks.__file__:
            found = tb
        tb = tb.tb_next
    if found is None:
        return f"ray: an actor failed scoring a chunk: {what}"
    fn = found.tb_frame.f_locals.get("fn")
    code = getattr(fn, "__code__", None)
    where = f"--detector {code.co_filename}" if code is not None else "--detector"
    if found.tb_next is None:  # raised there: the weights were not what a pattern must give
        return f"{where}: {_one_line(e)} (in a Ray actor)"
    return f"{where}: {getattr(fn, '__name__', 'pattern')}() raised {what} (in a Ray actor)"


def _ray_failure(e: BaseException) -> str:
    """One line for an error Ray raised in the driver: an actor's own :class:`StorylensError` line
    where there is one, else the last line of Ray's text (a remote traceback ends with the error)."""
    x: BaseException | None = e
    for _ in range(20):  # the chain of causes, as Ray wraps them
        if x is None:
            break
        if type(x) is StorylensError:  # the actor's line (Ray Data appends its retry advice below it)
            return (str(x).splitlines() or [""])[0]
        x = getattr(x, "cause", None) or x.__cause__
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    last = lines[-1] if lines else type(e).__name__
    for prefix in ("storylens.core.errors.StorylensError: ", "storylens.core.errors.UsageError: "):
        if last.startswith(prefix):  # e.g. an actor that could not load the model on its node
            return f"{last[len(prefix) :]} (in a Ray actor)"
    return f"ray: {type(e).__name__}: {last[:300]}"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def check_address(address: str) -> None:
    """Fail within seconds where nothing listens at ``address`` (``ray.init`` retries for minutes).
    Only a ``[ray://]HOST:PORT`` is checked; ``auto`` and the like are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not (sep and host and port.isdigit()):
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_TIMEOUT_S).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        raise StorylensError(f"--address {address}: no Ray cluster answers there ({why})") from None


@contextmanager
def _quiet_ray():
    """Keep Ray's own log lines off the console while storylens drives it (Ray's session logs keep
    them): the ``ray`` loggers shown from ERROR, Ray Data's console handler only for CRITICAL, and Ray's
    C++ side (which writes to file descriptor 2 itself) at its ``fatal`` level, unless
    ``RAY_BACKEND_LOG_LEVEL`` says otherwise."""
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")  # read when ray.init starts this process's core worker
    ray_logger = logging.getLogger("ray")
    consoles = [h for h in logging.getLogger("ray.data").handlers if isinstance(h, logging.StreamHandler)]
    saved = ray_logger.level, [h.level for h in consoles]
    ray_logger.setLevel(logging.ERROR)
    for h in consoles:
        h.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        ray_logger.setLevel(saved[0])
        for h, level in zip(consoles, saved[1]):
            h.setLevel(level)


@contextmanager
def _stderr_fd_silenced():
    """File descriptor 2 to /dev/null for a moment: Ray's C++ logging, as it starts, announces the
    level it was given there, whatever the level."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def _env_without(name: str, when: bool = True):
    """The environment variable ``name`` unset for the block (where ``when``), restored after it."""
    saved = os.environ.pop(name, None) if when else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401  (sets up Ray Data's loggers, which _quiet_ray turns down)
    except ImportError:
        raise StorylensError(f"--engine ray needs Ray: {install_hint('ray')}") from None
    return ray


def _init_ray(ray, address: str | None) -> None:
    """Join the cluster at ``address``, or start a new Ray of its own on this machine whose servers
    listen on the loopback address only (Ray 2.60 binds every interface unless its node address is
    127.0.0.1, which on Linux it only takes when told there is no cluster: its ``ENABLE_RAY_CLUSTER``).
    Without ``address`` no other cluster is ever joined: ``ray.init`` is given ``address="local"``
    (left out, it would join the cluster named by ``$RAY_ADDRESS`` or by the "current cluster"
    file the last Ray started on the machine left, another user's or a dead one), and
    ``$RAY_ADDRESS`` is set aside while it starts, so the processes it starts do not inherit it."""
    if address:
        check_address(address)
    if ray.is_initialized():
        return
    from ray._private import ray_constants

    clustered, wait = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(GCS_WAIT)
    if address:  # something answers, but maybe not Ray: one try at its GCS (~40 s), not Ray's 20
        os.environ.setdefault(GCS_WAIT, "1")
    else:
        ray_constants.ENABLE_RAY_CLUSTER = False  # this machine's Ray: node address 127.0.0.1
    try:
        with _stderr_fd_silenced(), _env_without(ray_constants.RAY_ADDRESS_ENVIRONMENT_VARIABLE, not address):
            ray.init(
                address=address or "local",
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                ignore_reinit_error=True,
            )
    except Exception as e:  # connection refused, bad address, ...
        where = f"--address {address}: cannot join that Ray cluster" if address else "ray: cannot start a local Ray"
        raise StorylensError(f"{where} ({type(e).__name__}: {_one_line(e)[:160]})") from None
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = clustered
        if wait is None:
            os.environ.pop(GCS_WAIT, None)


def _actors(ray, workers: int) -> int:
    """``workers``, but no more actors than the cluster has CPUs (each takes one), saying so on stderr."""
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if 0 < cpus < workers:
        print(
            f"storylens: --workers {workers}: this Ray cluster has {cpus} CPU{'s' * (cpus != 1)}; "
            f"using {cpus} actor{'s' * (cpus != 1)}",
            file=sys.stderr,
        )
        return cpus
    return workers


def _configure_data(ray) -> None:
    """Ray Data's settings for the run: no bars of its own, chunks back as they finish, an actor's
    own error, and every actor ready before the first chunk is handed out."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.preserve_order = False  # chunks come back as they finish; merged in order below
    ctx.raise_original_map_exception = True  # the actor's own error (its one line), not "UDF failed"
    # every actor has loaded its model before the first chunk is handed out (else the first one
    # ready queues chunks that the others would take)
    ctx.wait_for_min_actors_s = ACTORS_START_S


class ChunkJob:
    """A Ray Data actor for any chunked job: the model, loaded once; each call runs ``run(lm, job, start, texts)``
    on one chunk, which returns that chunk's sums as tensors (sent back as bytes, merged by the driver)."""

    def __init__(self, model_source, job: dict, run):
        torch.set_num_threads(1)
        self.lm, self.job, self.run = load_lm(model_source), job, run

    def __call__(self, batch: dict) -> dict:
        fault_point("ray-chunk")
        out: dict[str, list] = {"start": [], "state": [], "n": [], "cut": [], "main": [], "pid": [], "peak_mb": []}
        for start, texts in zip(batch["start"], batch["texts"]):
            try:
                tensors = self.run(self.lm, self.job, int(start), [str(t) for t in texts])
            except Exception as e:
                raise StorylensError(_actor_failure(e)) from None
            buf = io.BytesIO()
            torch.save(tensors, buf)
            out["start"].append(int(start))
            out["state"].append(buf.getvalue())
            out["n"].append(len(texts))
            out["cut"].append(0)
            out["main"].append(0)
            out["pid"].append(os.getpid())
            out["peak_mb"].append(peak_rss_mb())
        return out


def tensors_of(state: bytes) -> dict:
    """What :class:`ChunkJob` sent back, as tensors again."""
    return torch.load(io.BytesIO(state), weights_only=True)


def _scored(ray, chunks, size: int, scorer: dict, actor=None):
    """``chunks`` mapped through one pool of ``size`` actors (:class:`ChunkScorer`, or ``actor``) for the whole
    run (``scorer``: their arguments), one chunk a call; each actor holds the chunk it scores and the next."""
    common = dict(
        batch_size=1,
        num_cpus=1,
        fn_constructor_kwargs=scorer,
        compute=ray.data.ActorPoolStrategy(size=size, max_tasks_in_flight_per_actor=IN_FLIGHT),
    )
    bounded = {"max_restarts": RESTARTS, "max_task_retries": RESTARTS}  # not Ray Data's default of forever
    try:
        with warnings.catch_warnings():  # Ray 2.60 takes them as extra remote args, and warns that 2.64 will not
            warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
            return chunks.map_batches(actor or ChunkScorer, **common, **bounded)
    except TypeError:  # a Ray without extra remote args: its default restarts
        return chunks.map_batches(actor or ChunkScorer, **common)


class _InOrder:
    """The chunks' states merged into ``acc`` in story order, whatever order they come back in: a
    chunk back before an earlier one waits for its turn, so what is merged is always the first stories."""

    def __init__(self, merge: Callable[[dict], None], start: int):
        self.merge_row = merge
        self.waiting: dict[int, dict] = {}  # chunks back before an earlier one, by their first story
        self.next = start  # the first story not merged yet
        self.stats = RecordStats(0, 0, 0)  # of the stories merged
        self.actor_peaks: dict[int, float] = {}  # each actor process's peak memory (MB)

    def add(self, row: dict) -> bool:
        """Take one chunk's row and merge every chunk whose turn has come; True if any was merged."""
        first = int(row["start"])
        if first < self.next or first in self.waiting:  # Ray Data returns each chunk once; a repeat is a bug
            raise StorylensError(f"ray: chunk at story {first} came back twice")
        self.waiting[first] = row
        pid = int(row["pid"])
        self.actor_peaks[pid] = max(self.actor_peaks.get(pid, 0.0), float(row["peak_mb"]))
        merged = False
        while self.next in self.waiting:
            row = self.waiting.pop(self.next)
            self.merge_row(row)
            self.stats = self.stats + RecordStats(int(row["n"]), int(row["cut"]), int(row["main"]))
            self.next += int(row["n"])
            merged = True
        return merged


def score_with_ray(
    model_source,
    source,
    names,
    acc,
    *,
    workers: int = 2,
    address: str | None = None,
    batch_size: int = BATCH_STORIES,
    chunk_stories: int = CHUNK_STORIES,
    total: int | None = None,
    progress: bool = True,
    detectors=None,
    examples: int = 0,
    details: dict | None = None,
    start: int = 0,
    on_progress=None,
):
    """Score the stories of ``source`` from index ``start`` on, on Ray, in one streaming pipeline, and
    merge the chunks' states into ``acc`` in story order; returns the
    :class:`~storylens.engine.record.RecordStats` of the stories it scored (see the module docstring).

    ``source``: a :class:`~storylens.data.sources.StorySource` (read on the workers) or a sequence of
    stories (sent by the driver). ``total``: how many stories ``source`` holds (counted if not given).
    ``on_progress(stats)`` is called whenever the stories merged so far grow (a run that checkpoints
    saves there: what is merged is always the first stories, exactly). Each chunk's accumulator has
    ``acc``'s effect columns (:meth:`~storylens.table.effect_parts.EffectParts.settings`)."""
    _check_sizes(workers, batch_size, chunk_stories)
    ray = _import_ray()
    with _quiet_ray():
        _init_ray(ray, address)
        workers = _actors(ray, workers)
        _configure_data(ray)
        total = _story_count(source, total, start)
        n_chunks = -(-(total - start) // chunk_stories)
        scorer = dict(  # each actor's ChunkScorer: the model loaded once, the detectors
            model_source=model_source,
            names=sorted(names),
            batch_size=batch_size,
            detectors=detectors,
            examples=examples,
            effects=acc.effects.settings(),
        )
        chunks = chunk_dataset(ray, source, start, total, chunk_stories, workers)
        ds = _scored(ray, chunks, min(workers, n_chunks), scorer)
        merger = _InOrder(lambda row: acc.merge(acc.like().load_state(json.loads(row["state"]))), start)
        _merge_rows(ray, ds, merger, total, start, workers=workers, progress=progress, on_progress=on_progress)
    _check_back(merger, total)
    if details is not None:
        details["actor_peak_mb"] = merger.actor_peaks  # each actor process's peak memory (benchmarks)
        details["workers"] = workers  # as used: --workers capped at the cluster's CPUs
        details["read_on_workers"] = isinstance(source, StorySource)
    return merger.stats


def _check_back(merger: _InOrder, total: int) -> None:
    if merger.waiting or merger.next != total:
        raise StorylensError(f"ray: stories {merger.next:,} to {total:,} did not come back from the actors")


def run_chunks_on_ray(
    model_source, source, job: dict, run, merge: Callable[[dict, int], None], *, workers: int = 2,
    address: str | None = None, chunk_stories: int = CHUNK_STORIES, total: int, start: int = 0,
    progress: bool = True, on_progress=None,
) -> RecordStats:  # fmt: skip
    """Any chunked job on Ray (:class:`ChunkJob`: ``run(lm, job, first, texts)`` per chunk of ``source`` from
    story ``start`` to ``total``), each chunk's tensors and story count handed to ``merge`` in story order (the module docstring:
    the same chunks as one process, merged in the same order; ``on_progress(stats)`` where they grow)."""
    _check_sizes(workers, 1, chunk_stories)
    ray = _import_ray()
    with _quiet_ray():
        _init_ray(ray, address)
        workers = _actors(ray, workers)
        _configure_data(ray)
        n_chunks = -(-(total - start) // chunk_stories)
        chunks = chunk_dataset(ray, source, start, total, chunk_stories, workers)
        kwargs = dict(model_source=model_source, job=job, run=run)
        ds = _scored(ray, chunks, min(workers, n_chunks), kwargs, actor=ChunkJob)
        merger = _InOrder(lambda row: merge(tensors_of(row["state"]), int(row["n"])), start)
        _merge_rows(ray, ds, merger, total, start, workers=workers, progress=progress, on_progress=on_progress)
    _check_back(merger, total)
    return merger.stats


def _check_sizes(workers: int, batch_size: int, chunk_stories: int) -> None:
    """Refuse fewer than one worker, or batches or chunks of fewer than one story."""
    if workers < 1:
        raise UsageError(f"--workers: must be at least 1 (got {workers})")
    if batch_size < 1 or chunk_stories < 1:
        raise UsageError("--batch-size and --chunk-stories: must be at least 1")


def _story_count(source, total: int | None, start: int) -> int:
    """``total``, else how many stories ``source`` holds (counted); refused where none is left from ``start``."""
    if total is None:
        total = len(source) if isinstance(source, Sequence) else sum(1 for _ in source)
    if total <= start:
        raise StorylensError("stories: nothing to score (no story)")
    return total


def _merge_rows(
    ray, ds, merger: _InOrder, total: int, start: int, *, workers: int, progress: bool, on_progress
) -> None:
    """Every chunk's row of ``ds`` into ``merger`` as it comes back, with a bar (lines off a terminal),
    ``on_progress(stats)`` whenever the stories merged grow; an actor's error is one line."""
    lines = ProgressLines(f"scoring on Ray ({workers} workers)", total, enabled=progress, initial=start)
    with tqdm(
        total=total,
        initial=start,
        unit="story",
        desc=f"recording attention on Ray ({workers} workers)",
        disable=None if progress else True,
    ) as bar:
        try:
            with _gcs_watch(ray):
                for row in ds.iter_rows():
                    merged = merger.add(row)
                    bar.update(int(row["n"]))
                    lines.update(int(row["n"]))  # off a terminal, instead of the bar
                    if merged and on_progress is not None:
                        on_progress(merger.stats)
        except ray.exceptions.ActorDiedError as e:
            raise StorylensError(
                f"ray: an actor died {RESTARTS + 1} times scoring a chunk (killed, or out of memory: see Ray's logs; "
                f"fewer --workers or a smaller --batch-size use less) ({_one_line(e)[:120]})"
            ) from None
        except ray.exceptions.RayError as e:  # an actor's error: one line, not Ray's traceback
            raise StorylensError(_ray_failure(e)) from None


@contextmanager
def _gcs_watch(ray):
    """A thread that asks the cluster's control store (GCS) for a connection every :data:`GCS_POLL_S` seconds; after
    :data:`GCS_MISSES` misses in a row it says so in one line and ends the process (exit 1). Ray's driver, without
    its control store, exits by itself after a minute with nothing shown (its logs are turned down here)."""
    address = getattr(ray.get_runtime_context(), "gcs_address", None)
    host, _, port = (address or "").rpartition(":")
    done = threading.Event()

    def watch() -> None:
        misses = 0
        while not done.wait(GCS_POLL_S):
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=GCS_POLL_S).close()
                misses = 0
            except OSError:
                misses += 1
                if misses >= GCS_MISSES and not done.is_set():
                    print(f"storylens: error: ray: the cluster's control store at {address} stopped answering "
                          f"({misses * GCS_POLL_S:.0f} s); the run ends (its checkpoint, if any, is kept)",
                          file=sys.stderr, flush=True)  # fmt: skip
                    os._exit(1)

    thread = threading.Thread(target=watch, name="storylens-gcs-watch", daemon=True)
    if host and port.isdigit():
        thread.start()
    try:
        yield
    finally:
        done.set()


def chunk_dataset(ray, source, start: int, total: int, chunk_stories: int, workers: int):
    """The chunks as a Ray Dataset, one row each: a :class:`StorySource` read by ``READ_TASKS_PER_WORKER``
    read tasks a worker, each reading its run of chunks where it runs; a sequence sent by the driver."""
    if not isinstance(source, StorySource):
        items = [
            {"start": i, "texts": [str(t) for t in texts]}
            for i, texts in chunked(source[start:total], chunk_stories, start)
        ]
        return ray.data.from_items(items, override_num_blocks=len(items))
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    def read(firsts: list[int]):  # runs in a read task, so it imports only what reading needs (no torch)
        import pyarrow as pa

        for first, texts in read_chunk_run(source, firsts, total, chunk_stories):
            yield pa.table({"start": [first], "texts": [[str(t) for t in texts]]})

    class StoryChunks(Datasource):
        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            spans = chunk_spans(start, total, chunk_stories, READ_TASKS_PER_WORKER * workers)
            return [
                ReadTask(
                    partial(read, firsts),
                    BlockMetadata(num_rows=len(firsts), size_bytes=None, exec_stats=None, input_files=None),
                )
                for firsts in spans
            ]

    # read tasks take no CPU of their own: the actors hold every CPU, and reading costs little beside scoring
    return ray.data.read_datasource(StoryChunks(), num_cpus=0)
