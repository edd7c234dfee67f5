"""Corpus scale, measured: memory flat in the number of stories, and one process against Ray.

    python benchmarks/bench_corpus.py [--json benchmarks/corpus.json] [--memory 200 8000 100000] [--time 2000 20000]
                                      [--batch 200 8000] [--before 7407302] [--merge]

Stories: the shared TinyStories corpus (``../shared``), repeated in file order until there are
enough, written once to a temporary text file; every run reads it with ``storylens.data.sources``
(streamed) and scores every head with every built-in detector (``storylens.corpus.score.score_corpus``),
each run in a fresh process so that its peak resident memory (``VmHWM``) is its own.

* ``memory``: one process (the local engine, ``storylens score``'s default batch of 4 stories) at
  each size: peak RSS, and the ratio to the smallest.
* ``batch``: the same with 16 stories a batch (the earlier default), to show what the batch size
  costs in memory and buys in time.
* ``time``: at each size, one process (2 torch threads) against Ray with 2 actors (one thread each)
  started on this machine, the engine as it is (one pipeline, the workers read the file) and as it
  was at ``--before`` (a commit: a window of chunks per actor pool, the driver sending every
  story): wall time of the scoring pass (the first pass over the text is timed apart), and peak
  memory (driver, and each actor's own peak).

Then an estimate, from the measured cost per story, of the whole TinyStories training split
(2.1 M stories) on the shipped model, and of 1 M documents on GPT-2 small (from
``benchmarks/detectors.json``, the measured cost per token of the 124M model), on this machine and
on a 32-node cluster of such machines (no scaling loss assumed: the work is independent chunks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from storylens.engine.encode import BATCH_STORIES

ROOT = Path(__file__).resolve().parents[1]
TINYSTORIES_TRAIN = 2_119_719  # stories in TinyStories-train.txt (the lesson's corpus)
BIG_BATCH = 16  # the batch compared with the default


def write_corpus(path: Path, n: int) -> None:
    from storylens.data.stories import EOT, load_split

    split = load_split()
    stories = split.train + split.quiz
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(f"{stories[i % len(stories)]}\n{EOT}\n")


def _engine_before(rev: str):
    """``score_with_ray`` as it was at commit ``rev`` (its ``ray_engine.py`` from git, pickled by value
    for its actors), called as today's ``score_corpus`` calls the engine: that engine took the
    stories after ``start`` as an iterable the driver reads, and ``on_window``."""
    import importlib.util
    from itertools import islice

    from ray import cloudpickle

    text = subprocess.run(
        ["git", "show", f"{rev}:storylens/corpus/ray_engine.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="bench_corpus_before_")) / "ray_engine_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("ray_engine_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_engine_before"] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # its ChunkScorer goes to the actors as code

    def engine(model_source, source, names, acc, *, start=0, on_progress=None, **kw):
        rest = islice(iter(source), start, None)
        return module.score_with_ray(model_source, rest, names, acc, start=start, on_window=on_progress, **kw)

    return engine


def child(corpus: str, n: int, engine: str, workers: int, batch_size: int, before: str = "") -> None:
    import torch

    from storylens.corpus.ray_engine import peak_rss_mb
    from storylens.corpus.score import score_corpus
    from storylens.data.sources import open_source
    from storylens.lm import load_lm

    out = tempfile.mkdtemp(prefix="bench_corpus_") + "/out"
    details: dict = {}
    lm = load_lm()
    t = time.perf_counter()
    if engine in ("ray", "ray-before"):
        from storylens.corpus import score as score_module

        original = score_module.score_with_ray if engine == "ray" else _engine_before(before)

        def with_details(*a, **kw):  # score_corpus passes its own dict: read it back
            out = original(*a, **kw)
            details.update(kw.get("details") or {})
            return out

        score_module.score_with_ray = with_details
    run = score_corpus(
        lm,
        open_source(corpus, limit=n),
        out,
        engine="local" if engine == "local" else "ray",
        workers=workers,
        progress=False,
        batch_size=batch_size,
    )
    wall = time.perf_counter() - t
    print(
        json.dumps(
            {
                "n": n,
                "engine": engine,
                "workers": workers if engine == "ray" else 1,
                "batch_size": batch_size,
                "threads": torch.get_num_threads(),
                "wall_s": wall,
                "first_pass_s": run.summary.timings_s["first_pass"],
                "scoring_s": run.summary.timings_s["scoring"],
                "driver_peak_mb": peak_rss_mb(),
                "actor_peak_mb": sorted(details.get("actor_peak_mb", {}).values()),
            }
        )
    )


def run_child(
    corpus: Path, n: int, engine: str, workers: int = 2, batch_size: int = BATCH_STORIES, before: str = ""
) -> dict:
    cmd = [sys.executable, __file__, "--child", str(corpus), str(n), engine, str(workers), str(batch_size), before]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(
        f"  {engine:10} {n:>7,} stories, batch {batch_size:2}: scoring {r['scoring_s']:8.1f} s, first pass {r['first_pass_s']:5.1f} s, "
        f"driver peak {r['driver_peak_mb']:6.0f} MB"
        + (f", actors {', '.join(f'{x:.0f}' for x in r['actor_peak_mb'])} MB" if r["actor_peak_mb"] else ""),
        flush=True,
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory", type=int, nargs="*", default=[200, 8000, 100_000])
    ap.add_argument("--time", type=int, nargs="*", default=[2000, 20_000])
    ap.add_argument("--batch", type=int, nargs="*", default=[200, 8000])
    ap.add_argument("--before", default="7407302", help="the commit whose Ray engine is measured beside today's")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep --json's sections that are not run now (an empty list), and its time rows of other sizes "
        "measured on the same machine",
    )
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        corpus, n, engine, workers, batch_size, before = args.child
        return child(corpus, int(n), engine, int(workers), int(batch_size), before)

    biggest = max(args.memory + args.time + args.batch)
    res: dict = {
        "machine": {"cpu": _cpu(), "cores": os.cpu_count()},
        "batch_size": BATCH_STORIES,
        "memory": [],
        "batch": [],
        "time": [],
    }
    with tempfile.TemporaryDirectory() as d:
        corpus = Path(d) / "stories.txt"
        write_corpus(corpus, biggest)
        print("memory (one process, fresh each):", flush=True)
        for n in args.memory:
            res["memory"].append(run_child(corpus, n, "local"))
        _ratios(res["memory"])
        print(f"batch of {BIG_BATCH} stories (one process, fresh each):", flush=True)
        for n in args.batch:
            res["batch"].append(run_child(corpus, n, "local", batch_size=BIG_BATCH))
        _ratios(res["batch"])
        print(f"time (one process vs Ray with 2 actors, today's engine and {args.before}'s):", flush=True)
        for n in args.time:
            res["time"].append(
                {
                    "n": n,
                    "local": run_child(corpus, n, "local"),
                    "ray": run_child(corpus, n, "ray", 2),
                    "ray_before": run_child(corpus, n, "ray-before", 2, before=args.before),
                    "before": args.before,
                }
            )
    res["machines"] = {k: res["machine"]["cpu"] for k in ("memory", "batch", "time") if res[k]}
    if args.merge and args.json and Path(args.json).exists():  # the sections not run now, as they were measured
        old = json.loads(Path(args.json).read_text())
        for k in ("memory", "batch", "time"):
            if not res[k] and old.get(k):
                res[k] = old[k]
                res["machines"][k] = old.get("machines", {}).get(k, old["machine"]["cpu"])
        old_time = old.get("machines", {}).get("time", old["machine"]["cpu"])
        if res["time"] and old.get("time") and old_time == res["machine"]["cpu"]:  # other sizes, same machine
            done = {r["n"] for r in res["time"]}
            res["time"] = sorted(res["time"] + [r for r in old["time"] if r["n"] not in done], key=lambda r: r["n"])
    res["estimate"] = estimate(res)
    for line in res["estimate"]["lines"]:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


def _ratios(rows: list[dict]) -> None:
    """Each run's peak as a multiple of the first (smallest) run's."""
    for r in rows:
        r["ratio_to_smallest"] = r["driver_peak_mb"] / rows[0]["driver_peak_mb"]


def estimate(res: dict) -> dict:
    """Whole-corpus estimates from the largest measured runs (per-story cost x stories)."""
    t = res["time"][-1]
    per_story = {k: t[k]["scoring_s"] / t["n"] for k in ("local", "ray")}
    day = 86400.0
    lines = [
        f"estimate: {TINYSTORIES_TRAIN:,} TinyStories on the shipped model: "
        f"{per_story['local'] * TINYSTORIES_TRAIN / 3600:.1f} h on this machine (one process), "
        f"{per_story['ray'] * TINYSTORIES_TRAIN / 3600 / 32:.2f} h on 32 such machines with Ray"
    ]
    out = {
        "per_story_s": per_story,
        "tinystories_hours_one_machine": per_story["local"] * TINYSTORIES_TRAIN / 3600,
        "tinystories_hours_32_nodes": per_story["ray"] * TINYSTORIES_TRAIN / 3600 / 32,
    }
    det = ROOT / "benchmarks" / "detectors.json"
    if det.exists():
        g = json.loads(det.read_text())["models"].get("gpt2-124m")
        if g:
            per_token = g["seconds"]["storylens"] / g["inputs"]["tokens"]
            doc_tokens = 1024  # a GPT-2 document filling its window
            one = per_token * doc_tokens * 1e6
            out.update(gpt2_per_token_s=per_token, gpt2_days_one_machine=one / day, gpt2_days_32_nodes=one / day / 32)
            lines.append(
                f"estimate: 1 M documents of {doc_tokens} tokens on GPT-2 small: {one / day:.0f} days on this "
                f"machine, {one / day / 32:.1f} days on 32 (from {per_token * 1000:.2f} ms/token measured on "
                f"{g['inputs']['tokens']:,} tokens of TinyStories-length text; attention grows with length, so "
                "full 1,024-token documents cost more per token)"
            )
    out["lines"] = lines
    return out


def _cpu() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_perf import _cpu as cpu

    return cpu()


if __name__ == "__main__":
    main()
