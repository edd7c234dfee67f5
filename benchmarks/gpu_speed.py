"""Issue 60's device checks in one run: ``storylens score`` at the accelerator's speed, side by side.

    python benchmarks/gpu_speed.py --json benchmarks/gpu_speed.json            # every part, on CUDA
    python benchmarks/gpu_speed.py --parts shapes --shapes llama-30x9 --rounds 2
    python benchmarks/gpu_speed.py --device cpu --small                        # a smoke test, any machine

Run where a GPU is lent (the tests and CI never need one); ``benchmarks/gpu_check.py`` checks the columns'
agreement with the CPU, this script the time and the memory. Seeded random Llamas, built and saved here with
storylens's tokenizer (no hub is reached): the 30 x 9-head shape (3 key/value heads, 576 wide) and a shape of
about 1 B parameters (16 blocks of 32 heads, 8 key/value heads, 2,048 wide, 8,192 in the MLP). Parts
(``--parts``):

* ``shapes``: per shape and dtype (float32, bfloat16), over the first ``--stories`` quiz stories:
  ``storylens score`` as the command runs it (:func:`~storylens.analysis.score_heads`: the name vocabulary,
  the encoding, every column, the top examples), the same with ``--causal``, and the model's bare forward
  (sdpa, no output head) over the same length-packed batches. Sides alternate, round by round (the first
  side rotating); the ratio is a side's time over the bare forward's in the same round, the best of
  ``--rounds``; throughput in tokens per second. Targets: score <= 1.3x, ``--causal`` <= 3x.
* ``syncs``: one scoring run on the device under ``torch.cuda.set_sync_debug_mode("warn")``: every
  synchronising call is a warning, counted per story (the CPU test counts them by hand; target <= 0.25).
* ``commands``: ``storylens report --model`` against ``storylens score --model`` on the 30 x 9 shape, each a
  whole process on the device (target report <= 1.5x score).
* ``long``: one ``--long-tokens`` story (the quiz joined) on the 1 B shape in bfloat16: ``score`` and
  ``score --causal`` against the bare forward, and the device's peak memory above the model's weights
  (targets 2x and 4x the time; memory linear in the length).

``--chunk-mb`` sets the streamed attention's chunk (``lm.chunk_bytes``; default storylens's own, and 1,024 MB
for the long story on CUDA, where the default's 7 rows a chunk would cost more in kernel launches than in
arithmetic); the figures say which was used. Every part's failure is kept in the JSON and the others still run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_long import build as build_llama  # noqa: E402
from bench_long import long_story  # noqa: E402

from storylens.analysis import score_heads  # noqa: E402
from storylens.core.batching import BATCH_TOKENS, length_batches  # noqa: E402
from storylens.corpus.options import EXAMPLES  # noqa: E402
from storylens.data.names import name_vocabulary  # noqa: E402
from storylens.data.stories import EOT, load_split  # noqa: E402
from storylens.engine.encode import BATCH_STORIES, batch_of, encode_stories  # noqa: E402
from storylens.lm import load_lm  # noqa: E402

SHAPES = {
    "llama-30x9": {"layers": 30, "heads": 9, "kv_heads": 3, "hidden": 576, "intermediate": 1536},
    "llama-1b": {"layers": 16, "heads": 32, "kv_heads": 8, "hidden": 2048, "intermediate": 8192},
    "small": {"layers": 2, "heads": 4, "kv_heads": 2, "hidden": 64, "intermediate": 128},  # --small
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LONG_CHUNK_MB = 1024  # the long story's streamed chunk on CUDA, unless --chunk-mb says otherwise


def build(folder: Path, shape: str, window: int, device: str) -> Path:
    """:func:`bench_long.build` of ``shape`` with a window of ``window``, made on ``device`` in bfloat16."""
    return build_llama(folder, argparse.Namespace(**SHAPES[shape], tokens=window), device, torch.bfloat16)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(sides: dict[str, Callable[[], object]], rounds: int, device: str, warm: bool = True) -> dict:
    """Each side once to warm up (``warm``), then ``rounds`` rounds, the first side rotating: every side's
    seconds per round, and each side's ratio to ``bare`` in the same round (best and every round's)."""
    for fn in sides.values() if warm else ():
        fn()
    names = list(sides)
    seconds: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _sync(device)
            t = time.perf_counter()
            sides[name]()
            _sync(device)
            seconds[name].append(time.perf_counter() - t)
        print("   ", ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()), flush=True)
    ratios = {k: [s / b for s, b in zip(v, seconds["bare"])] for k, v in seconds.items() if k != "bare"}
    return {"seconds": seconds, "ratios": ratios, "best": {k: min(v) for k, v in ratios.items()}}


def _lm(folder: Path, dtype: torch.dtype, device: str, chunk_mb: int | None):
    lm = load_lm(str(folder), dtype=dtype, device=device)
    if chunk_mb:
        lm.chunk_bytes = chunk_mb << 20
    return lm


def part_shapes(folders: dict[str, Path], stories: list[str], args) -> dict:
    out: dict = {}
    for shape, folder in folders.items():
        for dname, dtype in DTYPES.items():
            print(f"  {shape}, {dname}:", flush=True)
            lm = _lm(folder, dtype, args.device, args.chunk_mb)
            encoded = encode_stories(lm, stories, name_vocabulary(stories))
            order = length_batches([len(s.ids) for s in encoded], BATCH_STORIES, BATCH_TOKENS)
            made = [batch_of([encoded[i] for i in idx], lm.marker_id, lm.device) for idx in order]
            tokens = int(sum(int(b.lengths.sum()) for b in made))

            def bare(lm=lm, made=made) -> None:
                with torch.inference_mode():
                    for b in made:
                        lm.forward(b.ids, logits=False)

            def score(lm=lm, causal: bool = False) -> None:
                score_heads(lm, stories, batch_size=BATCH_STORIES, examples=EXAMPLES, progress=False, causal=causal)

            got = timed(
                {"bare": bare, "score": score, "causal": lambda s=score: s(causal=True)}, args.rounds, args.device
            )
            best_bare = min(got["seconds"]["bare"])
            got["tokens"], got["batches"] = tokens, len(made)
            got["tokens_per_second"] = {k: tokens / min(v) for k, v in got["seconds"].items()}
            got["bare_best_seconds"] = best_bare
            out[f"{shape} {dname}"] = got
            del lm
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return out


def part_syncs(folder: Path, stories: list[str], args) -> dict:
    """Synchronising calls of one scoring run on CUDA (``set_sync_debug_mode("warn")``), per story."""
    if not args.device.startswith("cuda"):
        return {"skipped": "needs CUDA (the CPU test counts the calls by hand: tests/test_syncs.py)"}
    lm = _lm(folder, torch.float32, args.device, args.chunk_mb)
    score_heads(lm, stories[:4], progress=False)  # warm: what is made once is not counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            score_heads(lm, stories, batch_size=BATCH_STORIES, examples=EXAMPLES, progress=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    where = statistics.multimode(syncs)[:3] if syncs else []
    return {"stories": len(stories), "syncs": len(syncs), "per_story": len(syncs) / len(stories), "most": where}


def part_commands(folder: Path, args) -> dict:
    """``storylens report`` against ``storylens score`` on the device, whole processes, interleaved."""
    with tempfile.TemporaryDirectory() as tmp:
        quiz = Path(tmp) / "quiz.txt"
        quiz.write_text("".join(f"{s}\n{EOT}\n" for s in load_split().quiz[: args.stories]), encoding="utf-8")
        exe = str(Path(sys.executable).with_name("storylens"))
        common = ["--model", str(folder), "--device", args.device, "--no-progress"]
        commands = {
            "score": [exe, "score", *common, "--stories", str(quiz)],
            "report": [exe, "report", *common, "--quiz", str(quiz)],
        }
        seconds: dict[str, list[float]] = {k: [] for k in commands}
        for r in range(args.rounds):
            for name, cmd in commands.items():
                t = time.perf_counter()
                subprocess.run([*cmd, "--out", str(Path(tmp) / f"{name}{r}")], check=True, capture_output=True)
                seconds[name].append(time.perf_counter() - t)
    return {"seconds": seconds, "report_over_score": min(seconds["report"]) / min(seconds["score"])}


def part_long(folder: Path, args) -> dict:
    """One long story on the 1 B shape in bfloat16: time against the bare forward, peak memory above the weights."""
    # a larger chunk than storylens's default where the device has the memory: 32 MB of a 32,000-token story's
    # scores on 32 heads is 7 rows, and a chunk's launches would outweigh its arithmetic
    chunk_mb = args.chunk_mb or (LONG_CHUNK_MB if args.device.startswith("cuda") else None)
    lm = _lm(folder, torch.bfloat16, args.device, chunk_mb)
    text = long_story(lm, args.long_tokens)
    ids = torch.tensor([[lm.marker_id, *lm.encode(text)]], dtype=torch.long, device=lm.device)
    weights = sum(p.numel() * p.element_size() for p in lm.module.parameters())

    def bare() -> None:
        with torch.inference_mode():
            lm.forward(ids, logits=False)

    def score(causal: bool = False) -> None:
        score_heads(lm, [text], batch_size=BATCH_STORIES, examples=EXAMPLES, progress=False, causal=causal)

    peaks = {}
    for name, fn in (("bare", bare), ("score", score), ("causal", lambda: score(True))):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        fn()
        if args.device.startswith("cuda"):
            peaks[name] = (torch.cuda.max_memory_allocated() - weights) / 2**20
    # the peak runs above were the warm-up
    got = timed({"bare": bare, "score": score, "causal": lambda: score(True)}, args.rounds, args.device, warm=False)
    return {
        **got, "tokens": int(ids.shape[1]), "chunk_mb": chunk_mb, "peak_mb_above_weights": peaks,
        "weights_mb": weights / 2**20,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="shapes,syncs,commands,long", help="comma-separated")
    ap.add_argument("--shapes", default="llama-30x9,llama-1b", help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--stories", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=32000)
    ap.add_argument("--chunk-mb", type=int, default=None, help="the streamed attention's chunk (default: storylens's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a smoke test: the small shape, 4 stories, a 300-token story")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_speed: no CUDA device here")
    unknown = set(args.parts.split(",")) - {"shapes", "syncs", "commands", "long"}
    if unknown or not set(args.shapes.split(",")) <= set(SHAPES):
        sys.exit(f"gpu_speed: unknown parts or shapes: {args.parts} / {args.shapes}")
    shapes = ["small"] if args.small else args.shapes.split(",")
    if args.small:
        args.stories, args.long_tokens, args.rounds = 4, 300, 1
    stories = load_split().quiz[: args.stories]
    result: dict = {
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "stories": len(stories),
        "chunk_mb": args.chunk_mb,
    }
    window = max(4096, args.long_tokens + 1)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {s: build(Path(tmp), s, window, args.device) for s in shapes}
        big = folders["small" if args.small else "llama-1b"] if args.small or "llama-1b" in folders else None
        runs = {
            "shapes": lambda: part_shapes(folders, stories, args),
            "syncs": lambda: part_syncs(next(iter(folders.values())), stories, args),
            "commands": lambda: part_commands(next(iter(folders.values())), args),
            "long": lambda: part_long(big, args) if big else {"skipped": "the 1 B shape not built (--shapes)"},
        }
        for part in args.parts.split(","):
            print(f"{part}:", flush=True)
            t = time.perf_counter()
            try:  # one part's failure leaves the others' figures
                result[part] = runs[part]()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                result[part] = {"error": repr(e)}
            result[part]["part_seconds"] = time.perf_counter() - t
            print(json.dumps(result[part], default=str)[:2000], flush=True)
            if args.json:  # written after every part: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
