"""Where attribution patching's time goes: the gradient pass's stages, timed around a real run.

    python benchmarks/profile_causal.py [--layers 30] [--stories 16] [--rounds 2] [--threads 2]

``bench_causal.py``'s seeded random Llama of SmolLM-135M's shape (``--layers`` blocks), the first
``--stories`` quiz stories. Per round, the model's bare forward over the same batches, then
:func:`storylens.effects.audit.attribution` with each stage of :mod:`storylens.engine.gradients`
timed where it is called: the first forward (no graph but the last block's), the logits' gradient
formed a few rows at a time, every block's rerun, autograd's backward, the rerun check, and the
accumulator's AtP and DLA sums. A tool for finding what to speed up, not a benchmark: the ratios
are ``bench_causal.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_causal import _batches, build  # noqa: E402

from storylens.data.stories import load_split  # noqa: E402
from storylens.effects import attribution as causal  # noqa: E402
from storylens.effects.audit import attribution  # noqa: E402
from storylens.engine import gradients  # noqa: E402
from storylens.engine.encode import BATCH_STORIES  # noqa: E402
from storylens.engine.gradients import GRAPH_BYTES  # noqa: E402
from storylens.lm import load_lm  # noqa: E402

STAGES = {  # what is timed: (owner, attribute) -> its name in the output
    (gradients, "_first_pass"): "first forward",
    (gradients, "_head_gradient"): "logits' gradient",
    (gradients, "_rerun"): "reruns",
    (torch.autograd, "grad"): "backward",
    (gradients, "_differs"): "rerun check",
    (causal.CausalAccumulator, "gradients"): "AtP and DLA sums",
}


def timed(spent: dict[str, float]) -> None:
    """Wrap every stage so that its time adds to ``spent`` (for this process's run)."""

    def timer(inner, name: str):
        @functools.wraps(inner)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    for (owner, attr), name in STAGES.items():
        setattr(owner, attr, timer(getattr(owner, attr), name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--stories", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=BATCH_STORIES, help="stories a batch (default: score's)")
    ap.add_argument("--graph-mb", type=int, default=GRAPH_BYTES >> 20, help="the pass's kept graphs at most, MiB")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stories = load_split().quiz[: args.stories]
    with tempfile.TemporaryDirectory() as tmp:
        lm = load_lm(build(Path(tmp), "llama", args.layers, 4096))
        batches = _batches(lm, stories, args.batch_size)
        run = functools.partial(attribution, batch_size=args.batch_size, graph_bytes=args.graph_mb << 20)

        def bare() -> None:
            with torch.inference_mode():
                for b in batches:
                    lm.forward(b.ids, logits=True)

        bare()
        run(lm, stories)  # warm, and the pass's way chosen once
        spent: dict[str, float] = {}
        timed(spent)
        print(f"Llama, {args.layers} blocks, {len(stories)} quiz stories in {len(batches)} batches, "
              f"{torch.get_num_threads()} threads, kept graphs at most {args.graph_mb} MiB")  # fmt: skip
        for r in range(args.rounds):
            spent.clear()
            t0 = time.perf_counter()
            bare()
            t1 = time.perf_counter()
            run(lm, stories)
            t2 = time.perf_counter()
            parts = ", ".join(f"{name} {spent.get(name, 0.0):.2f} s" for name in STAGES.values())
            print(f"  round {r + 1}: bare {t1 - t0:.2f} s, AtP {t2 - t1:.2f} s ({(t2 - t1) / (t1 - t0):.2f}x): {parts}")


if __name__ == "__main__":
    main()
