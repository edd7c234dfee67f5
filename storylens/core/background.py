"""One pure job in a child process, beside the work of this one.

:func:`run_beside` forks a child that runs ``fn(*args)`` while the ``with`` block runs here,
then hands back the child's result (anything picklable) or raises the child's exception here
(so an error reads the same as if the job had run in this process). The report uses it to draw its figures (numpy and
matplotlib only, about a third of the run) while this process runs the model: two cores, two
jobs, no GIL between them.

Where the OS cannot fork (or with ``STORYLENS_NO_FORK=1``) the job simply runs here, after the
block: same result, one core. The child never touches torch (a forked child must not use the
parent's thread pools), never runs the parent's clean-up code (it leaves with ``os._exit``) and
dies with its parent (``PR_SET_PDEATHSIG`` on Linux), so a killed run leaves no orphan writing.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from storylens.core.errors import StorylensError


@dataclass
class Job:
    result: Any = None
    seconds: float = 0.0  # how long fn ran (in the child, or here)
    forked: bool = False


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods() and os.environ.get("STORYLENS_NO_FORK") != "1"


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed when the parent dies
    except (OSError, AttributeError):  # not Linux: the check below still catches most cases
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, StorylensError) else f"{type(e).__name__}: {e}"


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


@contextmanager
def run_beside(fn: Callable[..., Any], *args, what: str = "drawing the figures"):
    """``with run_beside(fn, *args) as job: ...`` then ``job.result`` is ``fn(*args)``."""
    job = Job()
    if not _can_fork():
        yield job
        t = time.perf_counter()
        job.result = fn(*args)
        job.seconds = time.perf_counter() - t
        return
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run fn, send the result, leave without running the parent's clean-up
        code = 1
        try:
            os.close(r)
            _die_with_parent(parent)
            t = time.perf_counter()
            result = fn(*args)
            payload = pickle.dumps(("ok", result, time.perf_counter() - t))
            code = 0
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent, raised there
            try:  # the exception itself (an OSError stays an OSError: the parent words it as usual)
                payload = pickle.dumps(("error", e.with_traceback(None), 0.0))
            except Exception:  # noqa: BLE001 - not picklable: its description
                payload = pickle.dumps(("error", StorylensError(f"{what}: {_describe(e)}"), 0.0))
        try:
            with os.fdopen(w, "wb") as f:
                f.write(payload)
        finally:
            os._exit(code)
    os.close(w)
    job.forked = True
    try:
        yield job
    except BaseException:
        os.close(r)
        _stop(pid)
        raise
    data = _read_all(r)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not data:
        raise StorylensError(f"{what}: the child process ended without a result ({_status(status)})")
    kind, value, seconds = pickle.loads(data)
    if kind != "ok":
        raise value
    job.result, job.seconds = value, seconds


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"
