"""Where ``storylens score``'s time goes: cProfile over ``score_heads`` as the command runs it.

    python benchmarks/profile_score.py [--device cuda] [--dtype float32] [--stories 40] [--top 30]

A seeded random Llama of the 30 x 9-head shape (``bench_record.py``'s), the first ``--stories`` quiz
stories, one warm-up run, then one profiled run; prints the functions with the most time of their own
and the most time under them. A tool for finding what to speed up, not a benchmark: the ratios to
the bare forward are ``bench_record.py``'s and ``gpu_check.py``'s.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_record import build  # noqa: E402

from storylens.analysis import score_heads  # noqa: E402
from storylens.corpus.options import EXAMPLES  # noqa: E402
from storylens.data.stories import load_split  # noqa: E402
from storylens.engine.encode import BATCH_STORIES  # noqa: E402
from storylens.lm import load_lm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--stories", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stories = load_split().quiz[: args.stories]
    with tempfile.TemporaryDirectory() as tmp:
        lm = load_lm(str(build("llama-30x9", Path(tmp))), dtype=args.dtype, device=args.device)

        def run() -> None:
            score_heads(lm, stories, batch_size=BATCH_STORIES, examples=EXAMPLES, progress=False)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()

        run()  # warm-up
        prof = cProfile.Profile()
        prof.runcall(run)
    stats = pstats.Stats(prof).strip_dirs()
    for key in ("tottime", "cumulative"):
        print(f"--- by {key}")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
