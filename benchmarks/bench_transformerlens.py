"""storylens streaming head scores vs TransformerLens run_with_cache, side by side.

    python benchmarks/bench_transformerlens.py [--stories 200] [--batch-size 16] [--repeats 1]

The same weights (storylens's shipped model; TransformerLens boots its HF export
offline through ``TransformerBridge.boot_transformers``), the same quiz stories, the
same batches (longest first) and the same metrics (every column of
``storylens.table.scores``: name mass, previous-token scores, marker):

* ``storylens``: ``score_heads``, one recording pass, per-story means summed batch by batch;
* ``TL full cache``: ``bridge.run_with_cache(batch)`` caching every hook (the usual way),
  then the same per-batch metric code on ``blocks.{i}.attn.hook_pattern``;
* ``TL patterns only``: the same with ``names_filter`` keeping only the patterns.

Each side runs in its own subprocess so that peak memory is its own. Reported: time to
import and load, time to score (best of ``--repeats``), the process's resident memory
after loading, and its peak during scoring (resident memory sampled every 5 ms from
/proc, plus ``ru_maxrss`` as a check). Needs transformer-lens (tests/analysis/TL_SETUP.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

SIDES = ("storylens", "tl-full", "tl-patterns")
LABELS = {
    "storylens": "storylens score_heads",
    "tl-full": "TL run_with_cache (full cache)",
    "tl-patterns": "TL run_with_cache (patterns only)",
}


def rss_mb() -> float:
    """Resident memory of this process now, MB (Linux /proc; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


class PeakSampler:
    """Samples resident memory in a thread while a block runs; ``peak`` in MB."""

    def __init__(self, every_s: float = 0.005):
        self.every_s, self.peak, self._stop = every_s, 0.0, threading.Event()

    def __enter__(self):
        self.peak = rss_mb()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb())
            time.sleep(self.every_s)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_mb())


def child(side: str, hf_dir: str, n_stories: int, batch_size: int, repeats: int) -> dict:
    t0 = time.perf_counter()
    import torch

    from storylens.data.names import find_main_characters
    from storylens.data.stories import load_split
    from storylens.engine.encode import length_batches, make_batch
    from storylens.model.hub import SHIPPED_MODEL, TOKENIZER, load_model
    from storylens.model.tokenizer import encode_story, eot_id, load_tokenizer
    from storylens.table.accumulator import HeadScoreAccumulator
    from storylens.table.scores import score_heads

    stories = load_split().quiz[:n_stories]
    if side == "storylens":
        model = load_model()
        tok = model.tokenizer
        n_layer, n_head, window = model.config.n_layer, model.config.n_head, model.config.block_size
    else:  # the weights come from the HF export only; storylens's tokenizer for the inputs
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers(hf_dir, device="cpu")
        bridge.eval()
        tok = load_tokenizer(SHIPPED_MODEL / TOKENIZER)
        n_layer, n_head, window = bridge.cfg.n_layers, bridge.cfg.n_heads, bridge.cfg.n_ctx
    load_s = time.perf_counter() - t0
    rss_loaded = rss_mb()

    def run_storylens():
        t = score_heads(model, stories, batch_size=batch_size, progress=False)
        return {"prev_token": t.column("prev_token"), "name_mass": t.column("name_mass")}

    def run_tl():
        # everything score_heads does besides the forward pass, done the same way
        ids = [encode_story(tok, s, window).ids for s in stories]
        mains = find_main_characters(tok, stories, window=window)
        marker = eot_id(tok)
        names = [f"blocks.{i}.attn.hook_pattern" for i in range(n_layer)]
        keep = None if side == "tl-full" else (lambda n: n in names)
        acc = HeadScoreAccumulator(n_layer, n_head)
        with torch.inference_mode():
            for idx in length_batches([len(x) for x in ids], batch_size):
                batch = make_batch([ids[i] for i in idx], [mains[i] for i in idx], [True] * len(idx), marker)
                _, cache = bridge.run_with_cache(batch.ids, names_filter=keep)
                acc.update([cache[n] for n in names], batch)
                del cache
        cols = acc.columns(False)
        return {k: cols[k].flatten().tolist() for k in ("prev_token", "name_mass")}

    fn = run_storylens if side == "storylens" else run_tl
    best, peak = float("inf"), 0.0
    for _ in range(repeats):
        with PeakSampler() as s:
            t = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t)
        peak = max(peak, s.peak)
    return {
        "side": side,
        "load_s": load_s,
        "score_s": best,
        "rss_loaded_mb": rss_loaded,
        "peak_mb": peak,
        "ru_maxrss_mb": peak_rss_mb(),
        "threads": torch.get_num_threads(),
        "result": result,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stories", type=int, default=200, help="first N quiz stories (default all 200)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="score this many times, keep the best time")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {','.join(SIDES)}")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        out = child(args.child, args.hf_dir, args.stories, args.batch_size, args.repeats)
        print("RESULT " + json.dumps(out))
        return

    from transformers.utils import logging as hf_logging

    from storylens.model.hub import export_hf, load_model

    hf_logging.disable_progress_bar()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "tiny-storyteller-hf")
        export_hf(load_model(), hf_dir)
        runs = []
        for side in sides:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                side,
                "--hf-dir",
                hf_dir,
                "--stories",
                str(args.stories),
                "--batch-size",
                str(args.batch_size),
                "--repeats",
                str(args.repeats),
            ]
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                sys.exit(f"{side}: failed (exit {p.returncode})\n{p.stderr[-3000:]}")
            runs.append(json.loads(line[-1][len("RESULT ") :]))

    import torch

    print(
        f"{args.stories} quiz stories, batch {args.batch_size}, torch {torch.__version__}, "
        f"{runs[0]['threads']} threads, each side in its own process"
    )
    w = max(len(LABELS[r["side"]]) for r in runs)
    print(
        f"{'side':<{w}}  {'load s':>7}  {'score s':>8}  {'RSS loaded MB':>13}  {'peak MB':>8}  {'peak-loaded MB':>14}"
    )
    for r in runs:
        print(
            f"{LABELS[r['side']]:<{w}}  {r['load_s']:>7.2f}  {r['score_s']:>8.2f}  {r['rss_loaded_mb']:>13.0f}  "
            f"{r['peak_mb']:>8.0f}  {r['peak_mb'] - r['rss_loaded_mb']:>14.0f}"
        )
    ref = runs[0]["result"]
    for r in runs[1:]:
        diffs = {k: max(abs(a - b) for a, b in zip(ref[k], r["result"][k])) for k in ref}
        print(f"max |{runs[0]['side']} - {r['side']}|: " + ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))


if __name__ == "__main__":
    main()
