"""run_beside: a job in a forked child, its result or its very exception back here."""

import os
import signal

import pytest

from storylens.core.background import run_beside
from storylens.core.errors import StorylensError


def _square(x):
    return x * x, os.getpid()


def _fail():
    raise OSError(28, "No space left on device")


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def test_result_comes_back_from_another_process():
    with run_beside(_square, 7) as job:
        here = os.getpid()
    value, pid = job.result
    assert value == 49 and job.forked and pid != here and job.seconds >= 0


def test_the_childs_exception_is_raised_here_as_it_was():
    with pytest.raises(OSError) as e:
        with run_beside(_fail):
            pass
    assert e.value.errno == 28 and e.value.strerror == "No space left on device"


def test_a_killed_child_is_one_line_not_a_hang():
    with pytest.raises(
        StorylensError,
        match="drawing the figures: the child process ended without a result "
        r"\(killed by signal 9\)",
    ):
        with run_beside(_die):
            pass


def test_an_error_here_stops_the_child(tmp_path):
    with pytest.raises(KeyError):
        with run_beside(_square, 3):
            raise KeyError("here")


def test_without_fork_it_runs_here(monkeypatch):
    monkeypatch.setenv("STORYLENS_NO_FORK", "1")
    with run_beside(_square, 5) as job:
        pass
    assert job.result == (25, os.getpid()) and not job.forked
