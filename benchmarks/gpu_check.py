"""storylens on a CUDA device, in float32 and bfloat16: agreement with the CPU and speed, side by side.

    python benchmarks/gpu_check.py --json gpu.json [--stories 60] [--rounds 3]

Run where a GPU is lent (storylens's tests and CI never need one). A seeded random Llama of the 30 x 9-head
shape (3 key/value heads; benchmarks/bench_record.py's) over the first ``--stories`` of the shipped quiz:

* agreement: every head-table column scored on the CPU in float32 (the reference) against CUDA in float32
  and in bfloat16: the largest absolute difference per column, and the ranks' agreement (Spearman's rho)
  of the columns a reader ranks heads by;
* speed: on CUDA, per dtype, the model's bare forward (sdpa, no output head) and the scoring pass
  (``score_heads``' recording) over the same length-packed batches, interleaved batch by batch, the best of
  ``--rounds``; each ratio is the scoring pass's time over the bare forward's in the same round;
* the causal columns (``score_heads(..., causal=True)``) and ``storylens patch`` where this checkout has them.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_record import build  # noqa: E402

from storylens.analysis import score_heads  # noqa: E402
from storylens.analysis.encode import batch_of, encode_stories  # noqa: E402
from storylens.analysis.faithful import rank_correlation  # noqa: E402
from storylens.analysis.names import name_vocabulary  # noqa: E402
from storylens.analysis.record import record  # noqa: E402
from storylens.analysis.scores import HeadScoreAccumulator  # noqa: E402
from storylens.core.batching import BATCH_TOKENS, length_batches  # noqa: E402
from storylens.lesson.inputs import lesson_quiz  # noqa: E402
from storylens.lm import load_lm  # noqa: E402
from storylens.model.hub import load_model  # noqa: E402

RANKED = ("name_mass", "prev_token", "first_mass", "norm_prev_token", "output_share", "context_share")


def _columns(scores) -> dict[str, list]:
    return {c.name: scores.column(c.name) for c in scores.columns if c.name != "dormant"}


def agreement(ref, other) -> dict:
    a, b = _columns(ref), _columns(other)
    out = {}
    for k, xs in a.items():
        pairs = [(x, y) for x, y in zip(xs, b[k]) if x is not None and y is not None]
        if pairs:
            out[k] = {"max_abs_diff": max(abs(x - y) for x, y in pairs)}
            if k in RANKED:
                out[k]["rank_rho"] = rank_correlation([x for x, _ in pairs], [y for _, y in pairs])
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def speed(folder: Path, stories: list[str], dtype: torch.dtype, rounds: int, device: str = "cuda") -> dict:
    lm = load_lm(str(folder), dtype=dtype, device=device)
    encoded = encode_stories(lm, stories, name_vocabulary(stories))
    order = length_batches([len(s.ids) for s in encoded], 16, BATCH_TOKENS)
    groups = [[encoded[i] for i in idx] for idx in order]
    batches = [batch_of(g, lm.marker_id, lm.device).ids for g in groups]

    def bare(i: int) -> None:
        with torch.inference_mode():
            lm.forward(batches[i], logits=False)

    def scored(i: int) -> None:
        record(lm, groups[i], [HeadScoreAccumulator(lm.n_layer, lm.n_head)], progress=False)

    sides = {"bare": bare, "score": scored}
    for i in range(len(batches)):  # warm-up: kernels chosen, memory taken
        bare(i)
        scored(i)
    best: dict[str, float] = {}
    ratios = []
    for _ in range(rounds):
        times = dict.fromkeys(sides, 0.0)
        for i in range(len(batches)):
            for name, fn in sides.items():
                _sync(device)
                t = time.perf_counter()
                fn(i)
                _sync(device)
                times[name] += time.perf_counter() - t
        ratios.append(times["score"] / times["bare"])
        for k, v in times.items():
            best[k] = min(best.get(k, float("inf")), v)
    return {"seconds": best, "ratio_best": min(ratios), "ratios": ratios, "batches": len(batches)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stories", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (a smoke test of this script: cpu)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here")
    stories = lesson_quiz(load_model())[0][: args.stories]
    result: dict = {
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "stories": len(stories),
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = build("llama-30x9", Path(tmp))
        t = time.perf_counter()
        ref = score_heads(load_lm(str(folder), dtype=torch.float32), stories, progress=False)
        result["cpu_float32_seconds"] = time.perf_counter() - t
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            t = time.perf_counter()
            got = score_heads(load_lm(str(folder), dtype=dtype, device=args.device), stories, progress=False)
            result[f"cuda_{name}_seconds"] = time.perf_counter() - t
            result[f"agreement_{name}"] = agreement(ref, got)
            result[f"speed_{name}"] = speed(folder, stories, dtype, args.rounds, args.device)
            print(name, json.dumps(result[f"speed_{name}"]), flush=True)
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("agreement")}, indent=1))
    for name in ("float32", "bfloat16"):
        worst = max(result[f"agreement_{name}"].items(), key=lambda kv: kv[1]["max_abs_diff"])
        print(f"{name}: largest difference from the CPU: {worst[0]} {worst[1]['max_abs_diff']:.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
