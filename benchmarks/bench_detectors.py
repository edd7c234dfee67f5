"""Head detectors, side by side: storylens's one-pass scoring vs TransformerLens's
``run_with_cache`` + ``head_detector``, on the same stories and the same batches.

    python benchmarks/bench_detectors.py [--rounds 3] [--json FILE] [--skip-124m] [--tl-cache patterns|all]

Run it in an environment that has storylens and TransformerLens 4.x (a separate venv:
``pip install -e . 'transformer-lens==4.3.0' 'torch==2.13.0' 'transformers==5.24.0'``, see
tests/analysis/TL_SETUP.md). Everything runs offline.

Models
    ``tiny``: the shipped Tiny Storyteller (``storylens.model.hub.load_model()``, 6 layers x 4 heads)
    scored natively by storylens; TransformerLens boots its transformers export
    (``storylens.model.hub.export_hf``) with ``TransformerBridge.boot_transformers``. All 200 quiz
    stories (``storylens.lesson.lesson_data().quiz``).
    ``gpt2-124m``: a GPT-2-small-shaped transformers ``GPT2LMHeadModel`` with seeded random
    weights (``GPT2Config()`` defaults: 12 layers x 12 heads, d_model 768, 1,024 positions,
    eager attention, GPT-2's 50,257-token embedding: 124M parameters) and the shipped storylens
    tokenizer (which uses its first 4,096 rows). Saved to a temporary folder that
    both sides load. The first 16 quiz stories.

Sides
    ``storylens``: ``score_heads(lm, stories)``: one recording pass feeding every built-in
    detector (name_mass, prev_token, prev_argmax, prev4, marker, duplicate_token, induction)
    block by block; its time includes encoding the stories (tokens, names, main characters).
    ``TL``: per batch of storylens's own ids (``iter_batches``: padded at the end, longest
    first; the ids are made beforehand, outside the timing), ``run_with_cache`` (only the
    ``hook_pattern`` hooks by default; ``--tl-cache all`` caches every hook, TL's usual way),
    then for every story of the batch ``detect_head`` with each built-in pattern
    ("previous_token_head", "duplicate_token_head", "induction_head"), fed that story's part of
    the cache (``cache=``, an ``ActivationCache`` without the batch dimension, cut to the story's
    length), averaged over stories as ``detect_head`` does for a list of prompts. Both sides run
    under ``torch.inference_mode()``.

What each computes (so only time and memory are compared, not the scores)
    TransformerLens ``detect_head`` (defaults: ``error_measure="mul"``, ``exclude_bos=False``,
    ``exclude_current_token=False``): for one prompt of T tokens and a 0/1 detection pattern D
    (T x T, lower triangular), a head's score is sum(A * D) / sum(A), with A the head's
    attention; the rows of A sum to 1, so that is the mean over **all T queries** of the
    attention on D's keys: query 0 and queries without any such key add 0, and the BOS position
    (here storylens's opening marker, the same token) is kept. D is: previous token
    (k = q - 1); duplicate token (k < q, same token); induction (the duplicate pattern shifted one
    key right: k - 1 < q, token k - 1 = token q, k >= 1). A list of prompts is scored one prompt
    at a time and the scores averaged. It loops in Python over heads (one ``.item()`` each) and
    builds D per prompt (the duplicate pattern with numpy).
    storylens (``storylens.looking.detectors``): the **mean over stories of the per-story mean
    over the queries a detector applies to**: prev_token over q >= 1 (so TL's score is
    (T - 1) / T of it), duplicate_token and induction over the queries that have such a key at
    all (TL divides by every query). Same keys, different denominators; plus four more detectors.

    ``detect_head`` refuses a sequence as long as the model's window (its check is
    ``seq_len < n_ctx``); 16 quiz stories fill the tiny model's 256 positions, so the adapter that
    hands it one story of a batch reports ``n_ctx + 1`` to let those be scored too.

Measured
    Wall time: best of ``--rounds``, the two sides alternating round by round in this process
    (models loaded once, outside the timing). Peak memory: each side once in a fresh subprocess;
    peak resident memory (``VmHWM`` from /proc/self/status) minus the resident memory after the
    model (and the stories or ids) are loaded. Ratios are TL / storylens.
    As a check that both sides see the same network and inputs: the largest difference between
    storylens's and TL's attention patterns on two stories.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TL_PATTERNS = ("previous_token_head", "duplicate_token_head", "induction_head")
SAME_KEYS = {
    "prev_token": "previous_token_head",
    "duplicate_token": "duplicate_token_head",
    "induction": "induction_head",
}  # storylens column ~ TL pattern (same keys, other mean)
MODELS = ("tiny", "gpt2-124m")
STORIES = {"tiny": None, "gpt2-124m": 16}  # how many quiz stories (None: all 200)
SEED = 0


# ------------------------------------------------------------------ the two sides
# storylens's API (storylens.lm.wrap, storylens.analysis.score_heads, iter_batches) is used only in
# storylens_batch_ids, storylens_side and load_storylens; TransformerLens's only in tl_side and load_tl.


def storylens_batch_ids(lm, stories, batch_size: int) -> list:
    """storylens's own batches as ``(ids, lengths)``: ids ``[batch, tokens]`` padded at the end,
    and each story's length (marker included). The TL side runs exactly these ids."""
    from storylens.engine.encode import iter_batches

    return [(b.ids, b.lengths.tolist()) for b in iter_batches(lm, stories, batch_size=batch_size)]


def storylens_side(lm, stories, batch_size: int):
    """storylens: every built-in detector over ``stories``, one recording pass (``HeadScores``)."""
    from storylens.analysis import score_heads

    return score_heads(lm, stories, batch_size=batch_size, progress=False)


def tl_side(bridge, batches: list, full_cache: bool = False):
    """TransformerLens: ``run_with_cache`` per batch, then ``detect_head`` per story and pattern.

    Returns ``{pattern: [layer, head] tensor}``, each the mean over stories."""
    import torch
    from transformer_lens.ActivationCache import ActivationCache
    from transformer_lens.head_detector import detect_head

    cfg = bridge.cfg
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(cfg.n_layers)]
    keep = None if full_cache else (lambda n: n in names)
    # What detect_head reads of a model when it is handed a cache: cfg and to_tokens.
    story_cfg = SimpleNamespace(
        n_layers=cfg.n_layers, n_heads=cfg.n_heads, dtype=cfg.dtype, device=cfg.device, n_ctx=cfg.n_ctx + 1
    )  # + 1: see the module docstring
    sums = {p: torch.zeros(cfg.n_layers, cfg.n_heads, dtype=cfg.dtype) for p in TL_PATTERNS}
    n = 0
    with torch.inference_mode():
        for ids, lengths in batches:
            _, cache = bridge.run_with_cache(ids, names_filter=keep)
            for row, length in enumerate(lengths):
                story_ids = ids[row, :length]
                story = SimpleNamespace(cfg=story_cfg, to_tokens=lambda _seq, t=story_ids: t[None])
                story_cache = ActivationCache(
                    {k: cache[k][row, :, :length, :length] for k in names}, bridge, has_batch_dim=False
                )
                for p in TL_PATTERNS:
                    sums[p] += detect_head(story, "", p, cache=story_cache)
                n += 1
            del cache, story_cache
    return {p: s / n for p, s in sums.items()}


# ------------------------------------------------------------------ models and inputs


def prepare(model: str, work: str, batch_size: int) -> dict:
    """Write what both sides load into ``work``: the transformers folder TL boots (``hf``), the
    stories, and storylens's batches of ids. Returns a description of the model and the inputs."""
    import torch

    from storylens.lesson.inputs import lesson_data

    stories = lesson_data(None, None, None).quiz[: STORIES[model]]
    hf = os.path.join(work, "hf")
    if model == "tiny":
        from storylens.model.hub import export_hf, load_model

        export_hf(load_model(), hf)
    else:
        save_random_gpt2(hf)
    lm = load_storylens(model, work)
    batches = storylens_batch_ids(lm, stories, batch_size)
    with open(os.path.join(work, "stories.json"), "w") as f:
        json.dump(stories, f)
    torch.save(batches, os.path.join(work, "ids.pt"))
    lengths = [n for _, ls in batches for n in ls]
    return {
        "layers": lm.n_layer,
        "heads": lm.n_head,
        "window": lm.window,
        "parameters": sum(p.numel() for p in lm.module.parameters()),
        "stories": len(stories),
        "batches": len(batches),
        "batch_size": batch_size,
        "tokens": sum(lengths),
        "padded_tokens": sum(ids.numel() for ids, _ in batches),
        "stories_filling_window": sum(n >= lm.window for n in lengths),
    }


def save_random_gpt2(folder: str) -> None:
    """GPT-2-small shape (``GPT2Config()`` defaults), seeded random weights, storylens's tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from storylens.model.hub import load_model

    eot = "<|endoftext|>"
    tok = PreTrainedTokenizerFast(tokenizer_object=load_model().tokenizer, bos_token=eot, eos_token=eot)
    # GPT-2's own 50,257-row embedding and output head (124M parameters); storylens's tokenizer
    # uses the first 4,096 rows
    config = GPT2Config(
        vocab_size=50257, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, attn_implementation="eager"
    )
    torch.manual_seed(SEED)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def load_storylens(model: str, work: str):
    """The model storylens scores, wrapped: the native Tiny Storyteller, or the random GPT-2."""
    from storylens.lm import wrap

    if model == "tiny":
        from storylens.model.hub import load_model

        return wrap(load_model().eval())
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    hf = os.path.join(work, "hf")
    return wrap(
        GPT2LMHeadModel.from_pretrained(hf, attn_implementation="eager").eval(),
        PreTrainedTokenizerFast.from_pretrained(hf),
    )


def load_tl(work: str):
    from transformer_lens.model_bridge import TransformerBridge
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    bridge = TransformerBridge.boot_transformers(os.path.join(work, "hf"), device="cpu")
    bridge.eval()
    return bridge


def load_inputs(work: str) -> tuple[list[str], list]:
    import torch

    with open(os.path.join(work, "stories.json")) as f:
        stories = json.load(f)
    return stories, torch.load(os.path.join(work, "ids.pt"))


# ------------------------------------------------------------------ time


def best_of_rounds(fns: dict, rounds: int) -> tuple[dict[str, float], dict[str, list[float]], dict]:
    """Each callable once per round, rounds interleaved: best time, every time, last result."""
    times = {k: [] for k in fns}
    results = {}
    for _ in range(rounds):
        for k, fn in fns.items():
            gc.collect()
            t = time.perf_counter()
            results[k] = fn()
            times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}, times, results


def bench_time(model: str, work: str, rounds: int, batch_size: int, full_cache: bool) -> dict:
    stories, batches = load_inputs(work)
    lm, bridge = load_storylens(model, work), load_tl(work)
    best, every, results = best_of_rounds(
        {
            "storylens": lambda: storylens_side(lm, stories, batch_size),
            "TL": lambda: tl_side(bridge, batches, full_cache),
            "encode": lambda: storylens_batch_ids(lm, stories, batch_size),
        },
        rounds,
    )
    return {
        "seconds": {k: best[k] for k in ("storylens", "TL")},
        "rounds_s": every,
        "storylens_encoding_s": best["encode"],
        "max_pattern_difference": pattern_difference(lm, bridge, *batches[-1]),
        "score_correlation": score_correlation(results["storylens"], results["TL"]),
    }


def pattern_difference(lm, bridge, ids, lengths) -> float:
    """Largest |storylens pattern - TL pattern| over every layer, on two stories of a batch."""
    import torch

    ids = ids[:2, : max(lengths[:2])]
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(lm.n_layer)]
    with torch.inference_mode():
        ours = lm.patterns(ids)
        _, cache = bridge.run_with_cache(ids, names_filter=lambda n: n in names)
    return max(float((cache[n] - o).abs().max()) for n, o in zip(names, ours))


def score_correlation(scores, tl: dict) -> dict[str, float]:
    """Pearson correlation over heads of each storylens column with the TL pattern on the same keys."""
    import torch

    out = {}
    for col, pat in SAME_KEYS.items():
        a = torch.tensor(scores.grid(col), dtype=torch.float64).flatten()
        b = tl[pat].to(torch.float64).flatten()
        out[f"{col} ~ {pat}"] = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    return out


# ------------------------------------------------------------------ memory


def status_mb(field: str) -> float:
    """A line of /proc/self/status in MB (``VmRSS``: resident now, ``VmHWM``: its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} (peak memory needs Linux)")


def memory_child(side: str, model: str, work: str, batch_size: int, full_cache: bool) -> None:
    """In a fresh process: load one side, score once, print its memory as one JSON line."""
    stories, batches = load_inputs(work)
    if side == "storylens":
        lm = load_storylens(model, work)

        def run():
            return storylens_side(lm, stories, batch_size)
    else:
        bridge = load_tl(work)

        def run():
            return tl_side(bridge, batches, full_cache)

    gc.collect()
    loaded = status_mb("VmRSS")
    t = time.perf_counter()
    run()
    seconds = time.perf_counter() - t
    peak = status_mb("VmHWM")
    print(
        json.dumps(
            {"rss_loaded_mb": loaded, "rss_peak_mb": peak, "peak_above_loaded_mb": peak - loaded, "seconds": seconds}
        )
    )


def bench_memory(side: str, model: str, work: str, batch_size: int, full_cache: bool) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        side,
        "--child-model",
        model,
        "--child-work",
        work,
        "--batch-size",
        str(batch_size),
    ] + (["--tl-cache", "all"] if full_cache else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"memory run of {side} on {model} failed (exit {p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ main


def bench_model(model: str, rounds: int, batch_size: int, full_cache: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_detectors_") as work:
        res = {"inputs": prepare(model, work, batch_size)}
        res.update(bench_time(model, work, rounds, batch_size, full_cache))
        gc.collect()
        res["memory"] = {side: bench_memory(side, model, work, batch_size, full_cache) for side in ("storylens", "TL")}
    s, m = res["seconds"], res["memory"]
    res["tl_over_storylens"] = {
        "time": s["TL"] / s["storylens"],
        "memory": m["TL"]["peak_above_loaded_mb"] / max(m["storylens"]["peak_above_loaded_mb"], 1e-9),
    }
    return res


def print_table(results: dict, rounds: int) -> None:
    print(f"\n{'model':<10} {'side':<10} {'seconds':>8} {'peak MB':>8}   (best of {rounds}; peak: above loaded)")
    for model, r in results.items():
        for side in ("storylens", "TL"):
            print(f"{model:<10} {side:<10} {r['seconds'][side]:8.2f} {r['memory'][side]['peak_above_loaded_mb']:8.0f}")
        q = r["tl_over_storylens"]
        print(f"{model:<10} {'TL/sl':<10} {q['time']:7.2f}x {q['memory']:7.2f}x")
    for model, r in results.items():
        i = r["inputs"]
        print(
            f"\n{model}: {i['layers']} layers x {i['heads']} heads, {i['parameters'] / 1e6:.1f}M parameters; "
            f"{i['stories']} stories, {i['tokens']:,} tokens ({i['padded_tokens']:,} padded) in {i['batches']} "
            f"batches of {i['batch_size']}; {i['stories_filling_window']} fill the {i['window']}-token window"
        )
        loaded = {side: r["memory"][side]["rss_loaded_mb"] for side in ("storylens", "TL")}
        print(
            f"  storylens encoding alone {r['storylens_encoding_s']:.2f} s (in its time); loaded RSS "
            f"storylens {loaded['storylens']:.0f} MB, TL {loaded['TL']:.0f} MB"
        )
        print(
            f"  same network: largest attention difference {r['max_pattern_difference']:.1e}; score correlation "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["score_correlation"].items())
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds (best of)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--skip-124m", action="store_true", help="only the shipped model")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument(
        "--tl-cache",
        choices=("patterns", "all"),
        default="patterns",
        help="what run_with_cache keeps: the attention patterns only (default) or every hook",
    )
    ap.add_argument("--child", choices=("storylens", "TL"), help=argparse.SUPPRESS)
    ap.add_argument("--child-model", choices=MODELS, help=argparse.SUPPRESS)
    ap.add_argument("--child-work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    full_cache = args.tl_cache == "all"
    if args.child:
        return memory_child(args.child, args.child_model, args.child_work, args.batch_size, full_cache)

    import torch
    import transformer_lens  # noqa: F401  (fail early without it)

    models = MODELS[:1] if args.skip_124m else MODELS
    results = {}
    for model in models:
        print(f"{model}: timing {args.rounds} rounds, then memory ...", flush=True)
        results[model] = bench_model(model, args.rounds, args.batch_size, full_cache)
    print_table(results, args.rounds)
    if args.json:
        from importlib.metadata import version

        from bench_perf import _cpu  # the same machine description as the other benchmark

        out = {
            "machine": {
                "cpu": _cpu(),
                "cores": os.cpu_count(),
                "threads": torch.get_num_threads(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": version("transformers"),
                "transformer_lens": version("transformer-lens"),
            },
            "rounds": args.rounds,
            "tl_cache": args.tl_cache,
            "models": results,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
