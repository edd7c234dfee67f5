"""One long story: ``storylens score``'s recording against the model's bare forward, side by side.

    python benchmarks/bench_long.py [--tokens 8000] [--layers 30] [--rounds 2] [--json FILE]
    python benchmarks/bench_long.py --tokens 8000 --report        # also storylens report on that story
    python benchmarks/bench_long.py --tokens 8000 --causal        # also score --causal (the gradient pass)

A seeded random Llama of SmolLM-135M's shape by default (576 wide, ``--layers`` 30 blocks of
``--heads`` 9 query heads sharing ``--kv-heads`` 3 key/value heads, 1,536 in the MLP), with
storylens's tokenizer and a window of at least ``--tokens``, built and saved here (no hub is
reached). The story is the quiz's stories joined into one text and cut to ``--tokens`` tokens
(the opening marker included): names, duplicates and induction pairs as in real stories, at
length.

In each round, in turn (the first side alternating from round to round, so a shared machine's
drift falls on both):

* ``bare``: the model's own forward of the story with sdpa attention and no output head;
* ``score``: :func:`storylens.analysis.score_heads` as ``storylens score`` runs it (every detector,
  the norm-weighted columns and output norms, the top examples), encoding and names included.

* ``causal`` (with ``--causal``): the same with the causal columns (``score --causal``'s AtP and DLA: the
  gradient pass, block by block within ``--graph-memory``'s default).

The ratio is ``score`` (and ``causal``) over ``bare`` in the same round; the best of ``--rounds`` is kept, every
round's times printed, with the ratio of the two sides' processor time beside it (on a machine
shared with other work, less disturbed by it than the wall clock). ``--report`` then runs ``storylens report --model`` on the same story (a
quiz of one story, a whole process) and says whether it finished and how its story was cut.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_perf import _cpu  # noqa: E402


def build(folder: Path, args, device: str = "cpu", dtype=None) -> Path:
    """A seeded random Llama of the asked shape, saved in ``folder`` (made once per shape), initialised on
    ``device`` in ``dtype`` (default float32; a 1 B model's initialisation on a CPU takes minutes)."""
    import torch
    import transformers

    from storylens.model.hub import load_model

    window = max(args.tokens, 4096)
    out = folder / f"llama-{args.layers}x{args.heads}-kv{args.kv_heads}-{args.hidden}-{args.intermediate}-{window}"
    if (out / "config.json").exists():
        return out
    native = load_model().tokenizer
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=native, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=window,
        vocab_size=native.get_vocab_size(), bos_token_id=tok.bos_token_id, eos_token_id=tok.bos_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def long_story(lm, tokens: int) -> str:
    """The quiz's stories joined (one space apart) and cut to ``tokens`` tokens, the marker included."""
    from storylens.data.stories import load_split

    text = ""
    for story in load_split().quiz:
        text = f"{text} {story}" if text else story
        if len(lm.encode(text)) >= tokens:
            break
    enc = lm.encode_batch([text])[0]
    if len(enc.ids) < tokens - 1:
        raise SystemExit(f"--tokens: the quiz holds only {len(enc.ids) + 1} tokens")
    return text[: enc.offsets[tokens - 2][1]]


def bench_score(folder: Path, tokens: int, rounds: int, causal: bool = False) -> dict:
    import torch

    from storylens.analysis import score_heads
    from storylens.corpus.options import EXAMPLES
    from storylens.engine.encode import BATCH_STORIES
    from storylens.lm import load_lm

    lm = load_lm(str(folder))
    model = lm.module
    own = model.config._attn_implementation
    text = long_story(lm, tokens)
    ids = torch.tensor([[lm.marker_id, *lm.encode(text)]], dtype=torch.long)

    def bare() -> None:
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            lm.forward(ids, logits=False)

    def score() -> None:
        model.set_attn_implementation(own)
        score_heads(lm, [text], batch_size=BATCH_STORIES, examples=EXAMPLES, progress=False)

    def with_causal() -> None:
        model.set_attn_implementation(own)
        score_heads(lm, [text], batch_size=BATCH_STORIES, examples=EXAMPLES, progress=False, causal=True)

    short = text[:400]
    model.set_attn_implementation(own)
    score_heads(lm, [short], progress=False)  # warm: kernels, allocator
    sides = {"bare": bare, "score": score, **({"causal": with_causal} if causal else {})}
    every: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    ratios, cpu_ratios, causal_ratios = [], [], []
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            t, c = time.perf_counter(), time.process_time()
            sides[name]()
            every[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
        ratios.append(every["score"][-1] / every["bare"][-1])
        cpu_ratios.append(cpu["score"][-1] / cpu["bare"][-1])
        if causal:
            causal_ratios.append(every["causal"][-1] / every["bare"][-1])
        print(
            f"  round {r + 1}: bare {every['bare'][-1]:.1f} s, score {every['score'][-1]:.1f} s: "
            f"{ratios[-1]:.2f}x bare (processor time {cpu_ratios[-1]:.2f}x)"
            + (f"; --causal {every['causal'][-1]:.1f} s: {causal_ratios[-1]:.2f}x bare" if causal else ""),
            flush=True,
        )
    model.set_attn_implementation(own)
    return {
        "tokens": int(ids.shape[1]),
        "attention": own,
        "seconds": every,
        "cpu_seconds": cpu,
        "ratio": min(ratios),
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        **({"causal_ratio": min(causal_ratios), "causal_ratios": causal_ratios} if causal else {}),
    }


def bench_report(folder: Path, tokens: int) -> dict:
    """``storylens report --model`` on a quiz of the one long story, a whole process."""
    from storylens.data.stories import EOT
    from storylens.lm import load_lm

    text = long_story(load_lm(str(folder)), tokens)
    with tempfile.TemporaryDirectory() as tmp:
        quiz = Path(tmp) / "quiz.txt"
        quiz.write_text(f"{text}\n{EOT}\n", encoding="utf-8")
        exe = str(Path(sys.executable).with_name("storylens"))
        cmd = [exe, "report", "--model", str(folder), "--quiz", str(quiz), "--no-progress", "--out", f"{tmp}/r"]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t
        row: dict = {"seconds": seconds, "exit": done.returncode}
        if done.returncode:
            row["error"] = (done.stderr.strip().splitlines() or [""])[-1][:300]
        else:
            summary = json.loads((Path(tmp) / "r" / "summary.json").read_text())
            row["story"] = summary.get("story_shown")
    print(f"  storylens report: exit {row['exit']} after {seconds:.1f} s; {row.get('story') or row.get('error')}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8000, help="the story's length, the opening marker included")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="also run storylens report on the story")
    ap.add_argument("--causal", action="store_true", help="also score it with the causal columns (score --causal)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 2, or 1 on one core)")
    ap.add_argument("--folder", default=None, help="where the random model is saved (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    import torch
    import transformers

    torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(args.folder or tmp), args)
        shape = f"{args.layers} x {args.heads} heads ({args.kv_heads} key/value), {args.hidden} wide"
        print(f"one {args.tokens}-token story on a Llama of {shape}:", flush=True)
        result: dict = {
            "cpu": _cpu(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "tokens_asked": args.tokens,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "shape": {k: getattr(args, k) for k in ("layers", "heads", "kv_heads", "hidden", "intermediate")},
            "score": bench_score(folder, args.tokens, args.rounds, args.causal),
        }
        print(f"  score: {result['score']['ratio']:.2f}x bare (best of {args.rounds} rounds)", flush=True)
        if args.causal:
            print(f"  score --causal: {result['score']['causal_ratio']:.2f}x bare (best of {args.rounds})", flush=True)
        if args.report:
            result["report"] = bench_report(folder, args.tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
