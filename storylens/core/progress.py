"""Progress a long loop shows when no tqdm bar can (stderr is not a terminal: a log, a notebook's
captured output, CI): a line every few seconds with an estimate of the time left."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import time

from storylens.core.errors import StorylensError

PROGRESS_EVERY_ENV = "STORYLENS_PROGRESS_SECONDS"  # seconds between progress lines (default 10)
PROGRESS_EVERY = 10.0
NO_PROGRESS_HELP = (
    "no progress: no bar on a terminal, and off one (a log, CI) no line every "
    f"${PROGRESS_EVERY_ENV} seconds (default {PROGRESS_EVERY:g})"
)
_COMMAND: contextvars.ContextVar[str | None] = contextvars.ContextVar("storylens_command", default=None)


@contextlib.contextmanager
def progress_command(name: str):
    """Progress lines inside the ``with`` block name the command: ``storylens: report: ...``."""
    token = _COMMAND.set(name)
    try:
        yield
    finally:
        _COMMAND.reset(token)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


class ProgressLines:
    """``storylens: report: scoring 120/200 stories, about 30 s left`` on stderr every ``every``
    seconds (default ``$STORYLENS_PROGRESS_SECONDS``, else 10), only where no tqdm bar shows:
    ``enabled`` (the caller's progress switch) and the stream is not a terminal. Call
    :meth:`update` with the stories just done (``initial``: how many were done before, as a resumed
    run starts); a loop shorter than ``every`` prints nothing. A recording pass counts its batches
    with it (``record(..., [..., Counter(lines.update)])``, :class:`storylens.engine.record.Counter`)."""

    def __init__(
        self,
        what: str,
        total: int | None,
        *,
        unit: str = "stories",
        enabled: bool = True,
        every: float | None = None,
        stream=None,
        initial: int = 0,
    ):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(enabled) and not (isatty is not None and isatty())
        if every is None:
            raw = os.environ.get(PROGRESS_EVERY_ENV)
            try:
                every = float(raw) if raw else PROGRESS_EVERY
            except ValueError:
                raise StorylensError(
                    f"${PROGRESS_EVERY_ENV}: seconds between progress lines, a number (got {raw!r})"
                ) from None
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.done = self.initial = initial  # initial: done before this run (a resumed run's), not timed
        self.start = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        command = _COMMAND.get()
        line = f"storylens: {command + ': ' if command else ''}{self.what} {self.done}"
        if self.total:
            line += f"/{self.total} {self.unit}"
            if self.initial < self.done < self.total:
                left = (now - self.start) / (self.done - self.initial) * (self.total - self.done)
                line += f", about {_duration(left)} left"
        else:
            line += f" {self.unit}"
        print(line, file=self.stream, flush=True)
