"""How close storylens runs to this machine's limit: every figure of the performance issue,
each beside its comparator, measured in one run.

    python benchmarks/bench_perf.py [--rounds 3] [--json benchmarks/perf.json] [--skip tl,memory,...]

1. ``report``: ``storylens report`` as a user runs it (a fresh process, imports included), and
   its phases (from the report's own summary.json).
2. ``scoring``: the quiz's 200 stories, batch 16, longest first; in rounds, interleaved:
   a bare fused forward through every block without the output head; storylens recording and
   scoring all lesson measures (the maps fed block by block to the accumulator); storylens's
   whole ``score_heads`` (encoding and names included); TransformerLens ``run_with_cache``
   (patterns only) on the same weights (its boot of our HF export), the same batches and the
   same measure code fed from its cache.
3. ``memory``: peak resident memory (``VmHWM`` from the OS) of a fresh process that loads
   the model and the corpus and scores the first N stories, for N = 200, 2,000 and 8,000.
4. ``generation``: 200 tokens from the end-of-story marker, temperature 1, one seed: KV cache,
   recomputing everything each step, and KV cache recording every step's attention; the tokens
   must be the same. Beside them, transformers' own ``generate`` (sampling, no early stop, its KV
   cache, sdpa attention) on the same weights (the HF export, a ``GPT2LMHeadModel``), and
   storylens generating on that transformers model (``TransformersLM.generate_stream``).
5. ``training``: tokens per second of 16 x 256 training steps: fp32 without dropout, with
   residual dropout 0.1, with attention-probability dropout 0.1 as well, and bf16 autocast.

Every pair is timed in alternating rounds (best of ``--rounds``), so a noisy moment hits both.
``--json`` writes the figures for ``scripts/readme_perf_table.py``; each section records the commit it
was measured at and on which processor (``--merge`` keeps the sections not run now, with their own commits,
and the run's machine as it was).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

SECTIONS = ("report", "scoring", "memory", "generation", "training")
MEMORY_SIZES = (200, 2000, 8000)


def best_of_rounds(fns: dict, rounds: int) -> dict[str, float]:
    """Time each callable once per round, rounds interleaved; the best time of each."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


# ------------------------------------------------------------------ 1. report


def bench_report(rounds: int) -> dict:
    walls, phases = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "report")
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "storylens", "report", "--out", out, "--no-progress"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            walls.append(time.perf_counter() - t)
            with open(os.path.join(out, "summary.json")) as f:
                phases.append(json.load(f)["timings_s"])
    i = walls.index(min(walls))
    return {"wall_s": walls, "best_wall_s": walls[i], "phases_s": phases[i]}


# ------------------------------------------------------------------ 2. scoring


def _quiz_batches(model, batch_size=16):
    from storylens.data.stories import load_split
    from storylens.engine.encode import iter_batches
    from storylens.lm import NativeLM

    quiz = load_split().quiz
    return quiz, list(iter_batches(NativeLM(model), quiz, batch_size=batch_size))


def bench_scoring(rounds: int, with_tl: bool) -> dict:
    import torch

    from storylens.engine.record import _Pass, plan
    from storylens.lm import NativeLM
    from storylens.looking.detectors import BUILTIN_DETECTORS, LESSON_DETECTORS
    from storylens.model.hub import export_hf, load_model
    from storylens.table.accumulator import HeadScoreAccumulator
    from storylens.table.scores import score_heads

    model = load_model().eval()
    quiz, batches = _quiz_batches(model)
    L, H = model.config.n_layer, model.config.n_head

    @torch.inference_mode()
    def bare():  # embeddings and every block, fused attention, no output head
        for b in batches:
            T = b.ids.shape[1]
            x = model.transformer.wte(b.ids) + model.transformer.wpe(torch.arange(T))
            for block in model.transformer.h:
                x, _ = block(x)

    lm = NativeLM(model)

    @torch.inference_mode()
    def record_and_score(detectors=LESSON_DETECTORS, faithful: bool = False, examples: int = 0):
        """The lesson's measures (as TransformerLens gets below); ``faithful``: also every detector on the
        norm-weighted map and the output norms (hook_v, hook_z); ``examples``: the top examples too."""
        acc = HeadScoreAccumulator(L, H, detectors, faithful=faithful, examples=examples)
        wiring = _Pass(lm, [acc], plan(lm, [acc]))  # record()'s own wiring, over the batches made above
        with wiring.context():
            for b in batches:
                wiring.run(b)
        return acc

    fns = {
        "bare fused forward": bare,
        "storylens record + score": record_and_score,
        "storylens record + score, every detector": lambda: record_and_score(BUILTIN_DETECTORS),
        "... and norm-weighted, output norms": lambda: record_and_score(BUILTIN_DETECTORS, faithful=True),
        "... and the top 8 examples": lambda: record_and_score(BUILTIN_DETECTORS, faithful=True, examples=8),
        "storylens score_heads (all)": lambda: score_heads(model, quiz, max_stories_prev=100, progress=False),
    }
    agree = None
    if with_tl:
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformer_lens.model_bridge import TransformerBridge
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tmp = tempfile.mkdtemp()
        export_hf(model, os.path.join(tmp, "hf"))
        bridge = TransformerBridge.boot_transformers(os.path.join(tmp, "hf"), device="cpu")
        bridge.eval()
        names = [f"blocks.{i}.attn.hook_pattern" for i in range(L)]

        @torch.inference_mode()
        def tl():
            acc = HeadScoreAccumulator(L, H, LESSON_DETECTORS, faithful=False)
            for b in batches:
                _, cache = bridge.run_with_cache(b.ids, names_filter=lambda n: n in names)
                acc.update([cache[n] for n in names], b)
                del cache
            return acc

        fns["TransformerLens run_with_cache + same measures"] = tl
        ours, theirs = record_and_score().columns(False), tl().columns(False)
        agree = max(
            float((ours[k] - theirs[k]).abs().max())
            for k in ("name_mass", "prev_token", "prev_argmax", "prev4", "marker")
        )
    t = best_of_rounds(fns, rounds)
    base = t["bare fused forward"]
    return {
        "seconds": t,
        "ratio_to_bare": {k: v / base for k, v in t.items()},
        "tokens": int(sum(b.ids.numel() for b in batches)),
        "batches": len(batches),
        "tl_vs_storylens": (
            t["TransformerLens run_with_cache + same measures"] / t["storylens record + score"] if with_tl else None
        ),
        "tl_max_score_difference": agree,
    }


# ------------------------------------------------------------------ 3. memory


def memory_child(n: int) -> None:
    from storylens.analysis import score_heads
    from storylens.data.stories import load_split
    from storylens.model.hub import load_model

    model = load_model()
    split = load_split()
    stories = (split.quiz + split.train)[:n]
    before = peak_rss_mb()
    t = time.perf_counter()
    score_heads(model, stories, progress=False)
    seconds = time.perf_counter() - t
    print(json.dumps({"n": n, "seconds": seconds, "rss_loaded_mb": before, "rss_peak_mb": peak_rss_mb()}))


from storylens.corpus.ray_engine import peak_rss_mb


def bench_memory() -> dict:
    rows = []
    for n in MEMORY_SIZES:
        p = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--memory-child", str(n)],
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return {"runs": rows, "peak_ratio": rows[-1]["rss_peak_mb"] / rows[0]["rss_peak_mb"]}


# ------------------------------------------------------------------ 4. generation


def bench_generation(rounds: int, n_tokens: int = 200) -> dict:
    import torch

    from storylens.model.hub import load_model
    from storylens.model.tokenizer import eot_id

    model = load_model().eval()
    prompt = torch.tensor([[eot_id(model.tokenizer)]])
    tokens = {}

    def run(name, **kw):
        g = torch.Generator().manual_seed(0)
        tokens[name] = [s.token for s in model.generate_stream(prompt, n_tokens, temperature=1.0, generator=g, **kw)]

    hf, lm = _hf_copy(model)

    def hf_generate():
        torch.manual_seed(0)  # transformers samples from the global generator
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=n_tokens,
            min_new_tokens=n_tokens,
            pad_token_id=int(prompt[0, 0]),
        )
        assert out.shape[1] == 1 + n_tokens

    def on_hf():
        g = torch.Generator().manual_seed(0)
        tokens["storylens on the transformers copy"] = [
            s.token for s in lm.generate_stream(prompt, n_tokens, temperature=1.0, generator=g)
        ]

    t = best_of_rounds(
        {
            "kv cache": lambda: run("kv cache"),
            "recompute": lambda: run("recompute", use_kv_cache=False),
            "kv cache + recording": lambda: run("kv cache + recording", record_attention=True),
            "transformers generate": hf_generate,
            "storylens on the transformers copy": on_hf,
        },
        rounds,
    )
    return {
        "ms_per_token": {k: 1000 * v / n_tokens for k, v in t.items()},
        "recompute_over_cache": t["recompute"] / t["kv cache"],
        "recording_over_cache": t["kv cache + recording"] / t["kv cache"],
        "transformers_over_cache": t["transformers generate"] / t["kv cache"],
        "storylens_on_transformers_over_generate": t["storylens on the transformers copy"] / t["transformers generate"],
        "same_tokens": tokens["kv cache"] == tokens["recompute"] == tokens["kv cache + recording"],
        "n_tokens": n_tokens,
    }


def _hf_copy(model):
    """The shipped weights as a transformers ``GPT2LMHeadModel`` (its HF export, sdpa attention), and
    storylens's wrapper of it."""
    import transformers

    from storylens.lm import TransformersLM
    from storylens.model.hub import export_hf

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").eval()
        tok = transformers.AutoTokenizer.from_pretrained(tmp)
    return hf, TransformersLM(hf, tok)


# ------------------------------------------------------------------ 5. training


def bench_training(rounds: int, steps: int = 3) -> dict:
    import torch

    from storylens.model.gpt import GPT, GPTConfig

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4096, (16, 256), generator=g)
    setups = {
        "fp32, no dropout": (0.0, 0.0, False),
        "fp32, residual dropout 0.1": (0.1, 0.0, False),
        "fp32, residual + attention dropout 0.1": (0.1, 0.1, False),
        "bf16 autocast, no dropout": (0.0, 0.0, True),
    }

    def make(drop, attn, bf16):
        torch.manual_seed(0)
        model = GPT(GPTConfig(dropout=drop, attn_dropout=attn)).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            for _ in range(steps):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = model(x, x).loss
                opt.zero_grad()
                loss.backward()
                opt.step()

        step()  # warm-up
        return step

    t = best_of_rounds({k: make(*v) for k, v in setups.items()}, rounds)
    tok = steps * x.numel()
    base = t["fp32, no dropout"]
    return {"tokens_per_s": {k: tok / v for k, v in t.items()}, "slowdown": {k: v / base for k, v in t.items()}}


# ------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--skip", default="", help=f"comma-separated, from {','.join(SECTIONS)} (and 'tl')")
    ap.add_argument("--merge", action="store_true", help="update --json with the sections run, keep the others")
    ap.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        return memory_child(args.memory_child)
    import torch

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    res = {
        "machine": {
            "cpu": _cpu(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
        "rounds": args.rounds,
    }
    if args.json and args.merge and os.path.exists(args.json):  # keep the sections not run now (and their machine)
        with open(args.json) as f:
            res = {**json.load(f), "this_machine": res["machine"]}
    if "report" not in skip:
        res["report"] = bench_report(args.rounds)
        r = res["report"]
        print(
            f"report: {r['best_wall_s']:.2f} s as a process (best of {args.rounds}: "
            + ", ".join(f"{w:.2f}" for w in r["wall_s"])
            + ")"
        )
        print("  phases: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items()))
    if "scoring" not in skip:
        res["scoring"] = s = bench_scoring(args.rounds, with_tl="tl" not in skip)
        print(f"scoring the quiz ({s['tokens']:,} padded tokens, {s['batches']} batches of 16):")
        for k, v in s["seconds"].items():
            print(f"  {k:48} {v:6.2f} s  {s['ratio_to_bare'][k]:5.2f}x bare")
        if s["tl_vs_storylens"]:
            print(
                f"  TransformerLens / storylens: {s['tl_vs_storylens']:.2f}x; largest score difference "
                f"{s['tl_max_score_difference']:.1e}"
            )
    if "memory" not in skip:
        res["memory"] = m = bench_memory()
        for r in m["runs"]:
            print(
                f"memory: scoring {r['n']:>5} stories: {r['seconds']:6.1f} s, peak RSS {r['rss_peak_mb']:.0f} MB "
                f"(loaded {r['rss_loaded_mb']:.0f} MB)"
            )
        print(f"  peak at {MEMORY_SIZES[-1]:,} / peak at {MEMORY_SIZES[0]}: {m['peak_ratio']:.3f}x")
    if "generation" not in skip:
        res["generation"] = g = bench_generation(args.rounds)
        print(
            f"generation ({g['n_tokens']} tokens): "
            + ", ".join(f"{k} {v:.2f} ms/token" for k, v in g["ms_per_token"].items())
        )
        print(
            f"  recompute / cache {g['recompute_over_cache']:.1f}x, recording / cache "
            f"{g['recording_over_cache']:.2f}x, same tokens: {g['same_tokens']}; transformers generate / "
            f"storylens {g['transformers_over_cache']:.2f}x; storylens on the transformers copy / its generate "
            f"{g['storylens_on_transformers_over_generate']:.2f}x"
        )
    if "training" not in skip:
        res["training"] = tr = bench_training(args.rounds)
        for k, v in tr["tokens_per_s"].items():
            print(f"training {k:40} {v:8.0f} tokens/s  {tr['slowdown'][k]:.2f}x the time of no dropout")
    here = res.pop("this_machine", res["machine"])["cpu"]  # the processor these sections ran on
    for k in SECTIONS:
        if k not in skip:
            res[k]["commit"], res[k]["cpu"] = _commit(), here
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


def _commit() -> str:
    """The checkout's commit (short hash), ``+changes`` where storylens's own files differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = ["git", "-C", root]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "storylens"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
