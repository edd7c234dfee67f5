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
* the causal columns (``score_heads(..., causal=True)``: AtP and DLA, a backward pass per batch) on the
  same model and the first ``--causal-stories`` stories, CUDA against the CPU, and the causal pass's time
  over the plain scoring's;
* ``storylens patch`` on the shipped model and the shipped example pairs (AtP and exact for every head),
  CUDA against the CPU: the clean and corrupt metrics, the largest differences of AtP and exact, and
  the time per pair and head against one forward of the pairs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_record import build  # noqa: E402

from storylens.analysis import score_heads  # noqa: E402
from storylens.core.batching import BATCH_TOKENS, length_batches  # noqa: E402
from storylens.data.names import name_vocabulary  # noqa: E402
from storylens.effects.patching import encode_pairs, pair_batches, patch_heads, read_pairs  # noqa: E402
from storylens.engine.encode import batch_of, encode_stories  # noqa: E402
from storylens.engine.ranks import rank_correlation  # noqa: E402
from storylens.engine.record import record  # noqa: E402
from storylens.lesson.inputs import lesson_quiz  # noqa: E402
from storylens.lm import load_lm  # noqa: E402
from storylens.model.hub import load_model  # noqa: E402
from storylens.table.accumulator import HeadScoreAccumulator  # noqa: E402

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


CAUSAL = ("atp_mean", "atp_zero", "dla")


def causal(folder: Path, stories: list[str], device: str) -> dict:
    """AtP and DLA on the CPU (float32, the reference) and on ``device`` in float32 and bfloat16."""
    out: dict = {}
    ref = None
    for name, dev, dtype in (
        ("cpu_float32", "cpu", torch.float32),
        ("float32", device, torch.float32),
        ("bfloat16", device, torch.bfloat16),
    ):
        lm = load_lm(str(folder), dtype=dtype, device=dev)
        score_heads(lm, stories[:2], progress=False, causal=True)  # warm-up: kernels chosen, memory taken
        _sync(dev)
        t = time.perf_counter()
        plain = score_heads(lm, stories, progress=False)
        _sync(dev)
        t_plain = time.perf_counter() - t
        t = time.perf_counter()
        got = score_heads(lm, stories, progress=False, causal=True)
        _sync(dev)
        t_causal = time.perf_counter() - t
        row = {"plain_seconds": t_plain, "causal_seconds": t_causal, "causal_over_plain": t_causal / t_plain}
        del plain
        if ref is None:
            ref = got
        else:
            cols_ref, cols_got = _columns(ref), _columns(got)
            for c in CAUSAL:
                pairs = [(x, y) for x, y in zip(cols_ref[c], cols_got[c]) if x is not None and y is not None]
                row[c] = {
                    "max_abs_diff": max(abs(x - y) for x, y in pairs),
                    "largest_abs": max(abs(x) for x, _ in pairs),
                    "rank_rho": rank_correlation([x for x, _ in pairs], [y for _, y in pairs]),
                }
        out[name] = row
        print("causal", name, json.dumps(row), flush=True)
    return out


def patch(device: str) -> dict:
    """``storylens patch`` on the shipped model and example pairs, CPU (float32) against ``device``."""
    rows = read_pairs(Path(__file__).resolve().parents[1] / "storylens" / "data" / "example_pairs.jsonl")
    out: dict = {}
    ref = None
    for name, dev, dtype in (
        ("cpu_float32", "cpu", torch.float32),
        ("float32", device, torch.float32),
        ("bfloat16", device, torch.bfloat16),
    ):
        lm = load_lm(None, dtype=dtype, device=dev)
        pairs = encode_pairs(lm, rows)
        batches = pair_batches(lm, pairs)  # the clean forwards patch_heads makes, timed alone

        def forward(lm=lm, batches=batches) -> None:
            with torch.inference_mode():
                for b in batches:
                    lm.forward(b.clean, logits=True)

        forward()
        _sync(dev)
        t = time.perf_counter()
        forward()
        _sync(dev)
        t_fwd = time.perf_counter() - t
        _sync(dev)
        t = time.perf_counter()
        res = patch_heads(lm, pairs, exact="all")
        _sync(dev)
        secs = time.perf_counter() - t
        n = len(res.heads)
        row = {
            "seconds": secs,
            "pairs": res.pairs,
            "heads": n,
            "clean_metric": res.clean_metric,
            "corrupt_metric": res.corrupt_metric,
            "spearman_atp_exact": res.spearman,
            "one_forward_seconds": t_fwd,
            "seconds_per_head_over_one_forward": secs / n / t_fwd,
        }
        if ref is None:
            ref = res
        else:
            row["max_abs_diff_atp"] = max(abs(a.atp - b.atp) for a, b in zip(ref.heads, res.heads))
            row["max_abs_diff_exact"] = max(abs(a.exact - b.exact) for a, b in zip(ref.heads, res.heads))
            row["largest_abs_exact"] = max(abs(a.exact) for a in ref.heads)
            row["metric_diff"] = abs(ref.clean_metric - res.clean_metric)
        out[name] = row
        print("patch", name, json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stories", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--causal-stories", type=int, default=20)
    ap.add_argument("--parts", default="score,causal,patch", help="which parts to run, comma-separated")
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
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        folder = build("llama-30x9", Path(tmp))
        for part, run in (
            ("patch", lambda: patch(args.device)),
            ("causal", lambda: causal(folder, stories[: args.causal_stories], args.device)),
        ):
            if part in parts:
                try:  # one part's failure leaves the others' figures
                    result[part] = run()
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    result[part] = {"error": repr(e)}
        if "score" not in parts:
            print(json.dumps(result, indent=1))
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            return
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
