"""storylens score on Ray: a real local Ray (no mocks). Whatever the number of actors the result equals
the single-process one within 1e-9, a stories file is read by the workers (the driver never reads
it), and an actor killed mid-run loses and double-counts nothing."""

import gzip
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from storylens.corpus.ray_engine import score_with_ray
from storylens.data.names import name_vocabulary
from storylens.data.sources import StorySource, open_source
from storylens.engine.record import record
from storylens.lm import NativeLM
from storylens.table.accumulator import HeadScoreAccumulator

BATCH, CHUNK = 4, 8
EXAMPLES = 8


@pytest.fixture(scope="module")
def local_ray():
    # a Ray of this test's own ("local"), never one another test or user started on the machine
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def single(model, stories, start=0, causal=False, exact=None, **effects):
    """One process with one torch thread, as each actor runs: the same kernels, so every chunk's float32
    maps are the same bits and only the order of the float64 sums differs (well inside 1e-9)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        acc = HeadScoreAccumulator(6, 4, examples=EXAMPLES, causal=causal, exact=exact, **effects)
        stats = record(
            NativeLM(model), stories, [acc], batch_size=BATCH, chunk_stories=CHUNK, progress=False, start=start
        )
    finally:
        torch.set_num_threads(threads)
    return acc, stats


def on_ray(stories, workers, names=None, causal=False, exact=None, effects=None, **kw):
    acc = HeadScoreAccumulator(6, 4, examples=EXAMPLES, causal=causal, exact=exact, **(effects or {}))
    stats = score_with_ray(
        None,
        stories,
        name_vocabulary(stories) if names is None else names,
        acc,
        workers=workers,
        batch_size=BATCH,
        chunk_stories=CHUNK,
        progress=False,
        examples=EXAMPLES,
        **kw,
    )
    return acc, stats


def assert_same(a, b):
    for k, x in a.columns(True).items():
        y = b.columns(True)[k]
        assert x is not None and y is not None, k  # every column computed here, the sink columns too
        assert (x - y).abs().nan_to_num(0.0).max().item() <= 1e-9, k
    assert {k: v.count for k, v in a.means.items()} == {k: v.count for k, v in b.means.items()}
    # the top examples: a top k of the union, so the very same lists whatever the order of merging
    assert a.examples.state() == b.examples.state()


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_any_number_of_workers_equals_one_process(local_ray, shipped_model, corpus_split, workers):
    stories = corpus_split.quiz[:40]
    ref, ref_stats = single(shipped_model, stories)
    got, stats = on_ray(stories, workers)
    assert stats == ref_stats
    assert_same(got, ref)


def test_the_causal_columns_on_ray_equal_one_process(local_ray, shipped_model, corpus_split):
    """AtP and DLA (--causal): the workers' causal sums travel in their states and merge in story order."""
    stories = corpus_split.quiz[:16]
    ref, ref_stats = single(shipped_model, stories, causal=True)
    got, stats = on_ray(stories, 2, causal=True)
    assert stats == ref_stats
    assert_same(got, ref)
    assert ref.columns(True)["atp_mean"].abs().max() > 0  # computed, not zeros


def test_the_exact_columns_on_ray_equal_one_process(local_ray, shipped_model, corpus_split):
    """Every head's exact effect (--exact mean,zero,resample) and an estimator beside it (--estimator, its
    audit's sums too): each actor reruns its chunks' batches, the donors drawn from the chunk by seed and story
    index, and the sums merge in story order."""
    from storylens.effects.ablation import head_output_means
    from storylens.effects.exact import EXACT_MODES, ExactPlan

    stories = [" ".join(s.split()[:40]) for s in corpus_split.quiz[:16]]  # short: every head, three modes
    lm = NativeLM(shipped_model)
    means = head_output_means(lm, [lm.encode(s) for s in stories], include_marker=False)
    plan = ExactPlan(EXACT_MODES, means, 16, stories=12, seed=5)  # the exact effect on the first 12
    ref, ref_stats = single(shipped_model, stories, exact=plan, estimator="atp")
    got, stats = on_ray(stories, 2, exact=plan, effects={"estimator": "atp"})
    assert stats == ref_stats
    assert_same(got, ref)
    assert got.exact.acc.counts() == dict.fromkeys(EXACT_MODES, 12)
    assert got.estimate.acc.counts() == dict.fromkeys(EXACT_MODES, 16)  # the estimate: every story
    assert got.estimate.audited.counts() == dict.fromkeys(EXACT_MODES, 12)  # its audit: those exact covers
    for name, col in ref.estimate.audited.columns().items():
        assert (got.estimate.audited.columns()[name] - col).abs().max().item() <= 1e-9, name


def test_a_stories_file_is_read_by_the_workers_from_where_a_run_resumes(
    local_ray, shipped_model, corpus_split, tmp_path, monkeypatch
):
    stories = corpus_split.quiz[:45]  # 5 chunks of 8 after the first, the last one short
    path = tmp_path / "stories.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(f"{s}\n<|endoftext|>\n" for s in stories)
    source = open_source(path)
    assert list(source) == stories
    names = name_vocabulary(stories)
    ref, ref_stats = single(shipped_model, stories[CHUNK:], start=CHUNK)  # resumed after the first chunk

    def driver_reads(self):
        raise AssertionError("the driver read the stories")

    monkeypatch.setattr(StorySource, "__iter__", driver_reads)  # this process only: the workers import their own
    details = {}
    got, stats = on_ray(source, 2, names=names, total=len(stories), start=CHUNK, details=details)
    assert details["read_on_workers"]
    assert stats == ref_stats
    assert_same(got, ref)  # the examples too: their stories counted from where the run resumed


def _scorer_pids() -> set[int]:
    pids = set()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            if "ray::" in cmd and ("ChunkScorer" in cmd or "MapWorker" in cmd):
                pids.add(int(p))
    return pids


def test_a_killed_actor_loses_and_doubles_nothing(local_ray, shipped_model, corpus_split):
    stories = corpus_split.quiz[:96]
    ref, ref_stats = single(shipped_model, stories)
    result = {}

    def run():
        result["value"] = on_ray(stories, 2)

    t = threading.Thread(target=run)
    t.start()
    killed = None
    deadline = time.time() + 120
    while killed is None and time.time() < deadline and t.is_alive():
        pids = _scorer_pids()
        if pids:
            time.sleep(3)  # let it get into its chunks
            victim = min(_scorer_pids() or pids)
            os.kill(victim, signal.SIGKILL)
            killed = victim
        time.sleep(0.2)
    t.join(timeout=600)
    assert killed is not None, "no scoring actor process was found to kill"
    got, stats = result["value"]
    assert stats == ref_stats  # every story once
    assert_same(got, ref)


def test_score_audit_on_ray_runs_in_the_driver_and_equals_one_process(local_ray, corpus_split, tmp_path):
    """score --causal --audit on Ray: the audit runs in the driver after the workers' sums merge, on the
    same first stories, and writes what one process writes."""
    import json

    from storylens.cli import main

    path = tmp_path / "s.txt"
    path.write_text("".join(f"{s}\n<|endoftext|>\n" for s in corpus_split.quiz[:12]))
    common = ["score", "--stories", str(path), "--no-progress", "--examples", "0", "--causal", "--audit", "1",
              "--audit-stories", "2", "--batch-size", str(BATCH), "--chunk-stories", str(CHUNK)]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    assert main([*common, "--out", str(tmp_path / "ray"), "--engine", "ray", "--workers", "2"]) == 0
    local, on_ray = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("local", "ray"))
    assert on_ray["engine"]["name"] == "ray" and on_ray["audit"]["n_stories"] == 2
    assert on_ray["audit"] == local["audit"]  # the same model in the driver, the same stories: the same bits
    assert (tmp_path / "ray" / "audit.csv").read_text() == (tmp_path / "local" / "audit.csv").read_text()


def test_a_circuit_over_stories_on_ray_equals_one_process(local_ray, shipped_model, corpus_split, tmp_path):
    """``circuit --stories --engine ray``: every pass's chunks scored by actors and merged in story order give the
    figures one process gives with one torch thread (the actors' kernels), within 1e-9 of each."""
    import torch

    from storylens.corpus.circuit import circuit_over_stories
    from storylens.lm import NativeLM

    stories = list(corpus_split.quiz[:6])
    kw = dict(chunk_stories=2, oracle=2, resamples=3, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = circuit_over_stories(NativeLM(shipped_model), stories, tmp_path / "one", **kw)
    finally:
        torch.set_num_threads(threads)
    many = circuit_over_stories(NativeLM(shipped_model), stories, tmp_path / "ray", engine="ray", workers=2, **kw)
    a, b = one.to_pandas(), many.to_pandas()
    assert list(a.receiver) == list(b.receiver) and list(a.in_circuit) == list(b.in_circuit)
    scale = a.score.abs().max()
    assert (a.score - b.score).abs().max() <= 1e-9 * scale and (a.score_se - b.score_se).abs().max() <= 1e-9 * scale
    for x, y in zip(one.faithfulness.f, many.faithfulness.f):
        assert abs(x - y) <= 1e-9
    assert one.stability.jaccard == many.stability.jaccard and one.stories == many.stories == 6
