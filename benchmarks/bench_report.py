"""The report's costs, measured side by side in one run.

    python benchmarks/bench_report.py [--big 2000]

1. `storylens report` wall time (in a subprocess, as a user runs it);
2. scoring the quiz (record attention + streaming scores) vs a bare fused-attention forward
   over the same stories, same batches: the ratio is the cost of recording and scoring;
3. peak memory (RSS high-water mark, each in its own subprocess) scoring 200 vs --big stories:
   streaming keeps it flat.
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time


def child(n: int) -> None:
    from storylens.analysis import score_heads
    from storylens.data import load_split
    from storylens.hub import load_model

    model = load_model()
    split = load_split()
    stories = (split.quiz + split.train)[:n]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    score_heads(model, stories, progress=False)
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"n": n, "seconds": dt, "rss_before_mb": base / 1024, "rss_peak_mb": peak / 1024}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", type=int, default=2000)
    ap.add_argument("--child", type=int, default=None)
    args = ap.parse_args()
    if args.child:
        return child(args.child)

    import torch

    from storylens.analysis import score_heads
    from storylens.analysis.ablation import _pad
    from storylens.analysis.scores import length_batches
    from storylens.data import load_split
    from storylens.hub import load_model
    from storylens.tokenizer import encode_story

    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "storylens", "report", "--out", out, "--no-progress"], check=True,
                       stdout=subprocess.DEVNULL)
        report_wall = time.perf_counter() - t

    model = load_model()
    quiz = load_split().quiz
    ids = [encode_story(model.tokenizer, s).ids for s in quiz]

    @torch.inference_mode()
    def bare():
        for chunk in length_batches([len(i) for i in ids], 16):
            x, _ = _pad([ids[i] for i in chunk], "cpu")
            model(x)

    bare_s = min(_timed(bare) for _ in range(2))
    score_s = min(_timed(lambda: score_heads(model, quiz, progress=False)) for _ in range(2))
    mem = [json.loads(subprocess.run([sys.executable, __file__, "--child", str(n)], check=True,
                                     capture_output=True, text=True).stdout) for n in (200, args.big)]
    print(f"storylens report wall time (subprocess, imports included): {report_wall:.1f} s")
    print(f"quiz: bare fused forward {bare_s:.2f} s, record + score {score_s:.2f} s, ratio {score_s / bare_s:.2f}x")
    for m in mem:
        print(f"scoring {m['n']:>5} stories: {m['seconds']:6.1f} s, RSS before {m['rss_before_mb']:.0f} MB, "
              f"peak {m['rss_peak_mb']:.0f} MB (+{m['rss_peak_mb'] - m['rss_before_mb']:.0f} MB)")


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
