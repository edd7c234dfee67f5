"""storylens score --engine ray when something is off, on a real local Ray (no mocks): an --address
with nothing there fails in seconds, more workers than CPUs are capped, a user detector that raises
in an actor is one line, and a local Ray listens on the loopback address and keeps its logs to itself."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
import psutil
from cli_lines import one_line
from test_ray import BATCH, CHUNK, single

from storylens.corpus.ray_engine import score_with_ray
from storylens.data.names import name_vocabulary
from storylens.data.stories import EOT
from storylens.table.accumulator import HeadScoreAccumulator

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


@pytest.fixture(scope="module", autouse=True)
def no_ray_before_or_after():
    """Each test here starts (or fails to start) Ray through storylens itself."""
    ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def stories_file(corpus_split, tmp_path_factory):
    f = tmp_path_factory.mktemp("ray_robust") / "s.txt"
    f.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:24]))
    return f


def score(stories_file, out, *argv) -> list[str]:
    return ["score", "--stories", str(stories_file), "--out", str(out), "--engine", "ray", "--no-progress", *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_with_nothing_listening_fails_in_seconds(capsys, stories_file, tmp_path):
    port = free_port()
    t0 = time.monotonic()
    line = one_line(capsys, score(stories_file, tmp_path / "out", "--address", f"127.0.0.1:{port}"), 1)
    assert time.monotonic() - t0 < 60
    assert line == f"storylens: error: --address 127.0.0.1:{port}: no Ray cluster answers there (Connection refused)"
    assert not ray.is_initialized() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_fewer_than_one_worker_is_a_usage_error(capsys, stories_file, tmp_path, workers):
    line = one_line(capsys, score(stories_file, tmp_path / "out", "--workers", workers), 2)
    assert line == f"storylens: error: --workers: must be at least 1 (got {workers})"
    assert not ray.is_initialized()


@pytest.fixture
def stale_ray_tmpdir():
    """A Ray temp folder (short: Ray's socket paths live in it) whose "current cluster" file names a
    cluster long gone, as the last Ray started on a machine leaves it."""
    folder = tempfile.mkdtemp(prefix="slray")
    (Path(folder) / "ray").mkdir()
    dead = f"127.0.0.1:{free_port()}"
    (Path(folder) / "ray" / "ray_current_cluster").write_text(dead)
    yield folder, dead
    shutil.rmtree(folder, ignore_errors=True)


def test_a_successful_run_prints_only_storylens_lines(stories_file, tmp_path, stale_ray_tmpdir):
    """Ray's INFO lines, its C++ log lines and Ray Data's notes stay in Ray's session logs. Without
    --address the run starts its own Ray: the "current cluster" file a dead Ray left is not joined."""
    folder, dead = stale_ray_tmpdir
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_TMPDIR": folder}
    p = subprocess.run(
        [sys.executable, "-m", "storylens", *score(stories_file, tmp_path / "out", "--workers", "2")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    assert list((Path(folder) / "ray").glob("session_*"))  # Ray used this temp folder: it saw the file
    assert (Path(folder) / "ray" / "ray_current_cluster").read_text() == dead  # neither joined nor replaced
    assert [line for line in p.stderr.splitlines() if not line.startswith("storylens: ")] == [], p.stderr
    out = p.stdout.splitlines()
    assert out[0].startswith("24 stories from ") and out[-1].startswith(f"written to {tmp_path / 'out'} ")
    assert all(line.startswith("  ") and " highest L" in line for line in out[1:-1]), p.stdout
    assert (tmp_path / "out" / "heads.json").is_file()


def listening_addresses() -> set[str]:
    """The addresses every process of this test run (this driver and the Ray it started) listens on."""
    me = psutil.Process()
    found = set()
    for p in [me, *me.children(recursive=True)]:
        try:
            found |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    return found


def test_more_workers_than_cpus_are_capped_on_a_local_ray_that_listens_on_loopback(
    capsys, monkeypatch, shipped_model, corpus_split
):
    """Also: $RAY_ADDRESS naming a dead cluster is not joined (nor left to the processes Ray
    starts); the run starts its own local Ray."""
    assert not ray.is_initialized()  # storylens starts this test's Ray
    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", dead)
    stories = corpus_split.quiz[:40]
    ref, ref_stats = single(shipped_model, stories)
    acc, details = HeadScoreAccumulator(6, 4), {}
    stats = score_with_ray(
        None,
        stories,
        name_vocabulary(stories),
        acc,
        workers=64,
        batch_size=BATCH,
        chunk_stories=CHUNK,
        progress=False,
        details=details,
    )
    cpus = int(ray.cluster_resources()["CPU"])
    err = capsys.readouterr().err
    if cpus < 64:
        assert err == f"storylens: --workers 64: this Ray cluster has {cpus} CPUs; using {cpus} actors\n"
    else:
        assert err == ""
    assert 1 <= len(details["actor_peak_mb"]) <= min(cpus, 64)  # one pid per actor that scored
    assert details["workers"] == min(cpus, 64)  # what summary.json records as the engine's workers
    assert stats == ref_stats
    for k, x in acc.columns(True).items():
        assert (x - ref.columns(True)[k]).abs().nan_to_num(0.0).max().item() <= 1e-9, k
    assert {k: v.count for k, v in acc.means.items()} == {k: v.count for k, v in ref.means.items()}
    addresses = listening_addresses()
    assert addresses and addresses <= LOOPBACK, addresses
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert ray.get_runtime_context().gcs_address != dead and os.environ["RAY_ADDRESS"] == dead


def test_a_detector_that_raises_in_an_actor_is_one_line(capsys, stories_file, tmp_path):
    det = tmp_path / "boom.py"
    det.write_text("def pattern(ids):\n    raise ValueError('boom')\n")
    line = one_line(capsys, score(stories_file, tmp_path / "out", "--workers", "2", "--detector", str(det)), 1)
    assert line == (
        f"storylens: error: --detector {det}: detector boom: pattern(ids) raised ValueError: boom (in a Ray actor)"
    )
    assert not (tmp_path / "out").exists()


def test_an_actor_that_dies_on_every_chunk_ends_the_run_in_one_line(stories_file, tmp_path):
    """Issue 61, class 12: Ray Data restarts a dead actor forever by default, so an actor killed on every chunk (out
    of memory, say) hung the run. Restarts are bounded: the run ends, one line, exit 1, nothing published."""
    env = {**os.environ, "STORYLENS_INJECT_KILL": "ray-chunk", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "storylens", *score(stories_file, tmp_path / "out", "--workers", "1")]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 1 and lines and lines[-1].startswith("storylens: error: ray: an actor died"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_a_control_store_that_dies_ends_the_run_in_one_line(stories_file, tmp_path):
    """Issue 61, class 12: the cluster's control store (GCS) killed under a running score: the driver says so in one
    line and exits 1 (it used to exit 1 with nothing said)."""
    big = tmp_path / "big.txt"
    big.write_text(stories_file.read_text() * 40)  # long enough to be running when the GCS goes
    argv = [sys.executable, "-m", "storylens", *score(big, tmp_path / "out", "--workers", "1")]
    p = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE, text=True)
    me = psutil.Process(p.pid)

    def child(part: str) -> psutil.Process | None:
        for c in me.children(recursive=True):
            try:
                if part in " ".join(c.cmdline()):
                    return c
            except psutil.Error:  # gone between the listing and the look
                pass
        return None

    # The GCS is killed once an actor is at work, not at a fixed time after the GCS appears: on a loaded machine
    # the node may still be starting then, and the run ends on "cannot start a local Ray" instead (a CI failure).
    deadline, gcs, actor = time.time() + 300, None, None
    while actor is None and time.time() < deadline and p.poll() is None:
        time.sleep(0.5)
        gcs, actor = child("gcs_server"), child("MapWorker")
    assert gcs is not None and actor is not None, "no GCS or no scoring actor started"
    time.sleep(2)  # the actor at work
    gcs.kill()
    _, err = p.communicate(timeout=300)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert p.returncode == 1 and lines and "control store" in lines[-1], err
    assert not (tmp_path / "out").exists()
