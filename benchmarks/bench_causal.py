"""Attribution patching (``storylens score --causal``'s AtP and DLA) against the model's bare forward.

    python benchmarks/bench_causal.py [--stories 40] [--layers 30] [--rounds 2] [--tokens 3000] [--batch-size 4]
                                      [--graph-mb 512] [--json FILE]

Two seeded random transformers models with storylens's tokenizer, built and saved here (no hub is
reached): a Llama of SmolLM-135M's shape (576 wide, ``--layers`` blocks of 9 query heads sharing 3
key/value heads, 1,536 in the MLP; fewer blocks than its 30 make a proportionally cheaper model of
the same per-block cost, said in the output) and GPT-2 small's shape (12 blocks of 12 heads, 768
wide). On the first ``--stories`` quiz stories, batched as the recording batches them
(``--batch-size`` stories a batch, by default ``storylens score``'s):

* ``bare``: the model's own forward of every batch (fused attention, logits), in inference mode;
* ``atp``: :func:`storylens.effects.audit.attribution` (one fused forward and one backward per
  batch, every head's AtP mean/zero and DLA sums), encoding included, the gradient pass keeping at
  most ``--graph-mb`` MiB of the first blocks' graphs (``storylens score --graph-memory``).

The ratio is ``atp`` over ``bare`` in the same round (sides alternating), the best of ``--rounds``.
Memory: in a fresh process per model and side, the peak resident memory above the loaded model while
AtP runs on one ``--tokens``-token story (the quiz joined and cut), with ``--graph-mb`` and with no
graph kept (0: one block's activations at a time), and while the recording pass (``score_heads``)
runs on the same story, beside them; each also with glibc mapping every block of 1 MB or more alone,
so that the peak is that of the tensors alive together (``_memory``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "llama": dict(kind="llama", hidden=576, heads=9, kv_heads=3, intermediate=1536),
    "gpt2": dict(kind="gpt2", hidden=768, heads=12, layers=12),
}


def build(folder: Path, name: str, layers: int, window: int) -> Path:
    """A seeded random model of shape ``name`` saved in ``folder``."""
    import torch
    import transformers

    from storylens.model.hub import load_model

    shape = SHAPES[name]
    layers = shape.get("layers", layers)
    out = folder / f"{name}-{layers}"
    if (out / "config.json").exists():
        return out
    native = load_model().tokenizer
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=native, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    vocab, bos = native.get_vocab_size(), tok.bos_token_id
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_head=12, n_embd=768, n_positions=window, vocab_size=vocab,
                                      bos_token_id=bos, eos_token_id=bos)  # fmt: skip
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=window, vocab_size=vocab, bos_token_id=bos,
            eos_token_id=bos, tie_word_embeddings=True,
        )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _batches(lm, stories: list[str], batch_size: int) -> list:
    """The batches the recording makes of ``stories`` (:func:`storylens.engine.record.record`)."""
    from storylens.core.batching import BATCH_TOKENS, length_batches
    from storylens.engine.encode import batch_of, encode_stories

    enc = encode_stories(lm, stories, frozenset())
    return [batch_of([enc[i] for i in idx], lm.marker_id, lm.device) for idx in
            length_batches([len(e.ids) for e in enc], batch_size, BATCH_TOKENS)]  # fmt: skip


def time_model(folder: Path, stories: list[str], rounds: int, batch_size: int, graph_mb: int) -> dict:
    import torch

    from storylens.effects.audit import attribution
    from storylens.lm import load_lm

    lm = load_lm(folder)
    batches = _batches(lm, stories, batch_size)

    def bare() -> None:
        with torch.inference_mode():
            for b in batches:
                lm.forward(b.ids, logits=True)

    def atp() -> None:
        attribution(lm, stories, batch_size=batch_size, graph_bytes=graph_mb << 20)

    rows = []
    for r in range(rounds):
        times = {}
        for side in ("bare", "atp") if r % 2 == 0 else ("atp", "bare"):
            t0 = time.perf_counter()
            (bare if side == "bare" else atp)()
            times[side] = time.perf_counter() - t0
        times["ratio"] = times["atp"] / times["bare"]
        rows.append(times)
        print(f"  round {r + 1}: bare {times['bare']:.2f} s, atp {times['atp']:.2f} s, ratio {times['ratio']:.2f}")
    best = min(rows, key=lambda t: t["ratio"])
    return {"rounds": rows, "ratio": round(best["ratio"], 3), "tokens": sum(int(b.lengths.sum()) for b in batches)}


def _status_mb(field: str) -> float:
    """A ``/proc/self/status`` memory line in MB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field} in /proc/self/status (the memory figure needs Linux)")


def memory_child(folder: str, tokens: int, what: str) -> None:
    """In a fresh process: the peak resident memory above the loaded model while ``what`` (``atp:MB``:
    AtP and DLA, the gradient pass keeping at most MB MiB of graphs; ``record``: the recording pass,
    ``score_heads``) runs on one story."""
    from storylens.analysis import score_heads
    from storylens.data.stories import load_split
    from storylens.effects.audit import attribution
    from storylens.lm import load_lm

    lm = load_lm(folder)
    text = ""
    for story in load_split().quiz:
        text = f"{text} {story}" if text else story
        if len(lm.encode(text)) >= tokens:
            break
    ids = lm.encode_batch([text])[0].ids[: tokens - 1]
    text = lm.decode(ids)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak (VmHWM) restarts from what is resident now
    base = _status_mb("VmRSS")
    if what.startswith("atp:"):
        attribution(lm, [text], batch_size=1, graph_bytes=int(what[4:]) << 20)
    else:
        score_heads(lm, [text], progress=False)
    peak = _status_mb("VmHWM")
    print(
        json.dumps(
            {"tokens": len(lm.encode(text)), "model_mb": round(base, 1), "above_model_mb": round(peak - base, 1)}
        )
    )


LIVE = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}  # glibc: every tensor of 1 MB or more mapped alone, unmapped when freed


def _memory(folder: Path, tokens: int, graph_mb: int) -> dict:
    """AtP's peak above the model on one ``tokens``-token story, and the recording pass's beside it:
    each as the process's peak resident memory with glibc's defaults, and with every large block
    mapped alone (``LIVE``), so that memory freed is returned at once and the peak is that of the
    tensors alive together (glibc's default raises its threshold as large blocks are freed, and a
    heap that reuses freed blocks only grows)."""
    out = {}
    for side, what in (("atp", f"atp:{graph_mb}"), ("lean", "atp:0"), ("record", "record")):
        for how, env in (("", {}), ("live_", LIVE)):
            child = subprocess.run(
                [sys.executable, __file__, "--memory-child", str(folder), str(tokens), what],
                capture_output=True, text=True, check=True, env={**os.environ, **env},
            )  # fmt: skip
            out[how + side] = json.loads(child.stdout.strip().splitlines()[-1])
    return {
        **out["atp"],
        "graph_mb": graph_mb,
        "live_above_model_mb": out["live_atp"]["above_model_mb"],
        "lean_above_model_mb": out["lean"]["above_model_mb"],
        "lean_live_above_model_mb": out["live_lean"]["above_model_mb"],
        "record_above_model_mb": out["record"]["above_model_mb"],
        "record_live_above_model_mb": out["live_record"]["above_model_mb"],
    }


def main() -> None:
    from storylens.engine.encode import BATCH_STORIES
    from storylens.engine.gradients import GRAPH_BYTES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stories", type=int, default=40)
    ap.add_argument("--layers", type=int, default=30, help="the Llama's blocks (its real shape: 30)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=BATCH_STORIES, help="stories a batch (default: score's)")
    ap.add_argument("--graph-mb", type=int, default=GRAPH_BYTES >> 20, help="kept graphs at most (default: score's)")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--models", default=",".join(SHAPES), help="which shapes, comma-separated (llama, gpt2)")
    ap.add_argument("--json", default=str(Path(__file__).with_name("causal.json")))
    ap.add_argument("--memory-only", action="store_true", help="only the memory figures, into the existing --json")
    ap.add_argument("--memory-child", nargs=3, metavar=("FOLDER", "TOKENS", "WHAT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], int(args.memory_child[1]), args.memory_child[2])
        return
    import torch

    from storylens.data.stories import load_split

    stories = load_split().quiz[: args.stories]
    result: dict = {"stories": len(stories), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "batch_size": args.batch_size, "graph_mb": args.graph_mb,
                    "load_before": round(os.getloadavg()[0], 2), "models": {}}  # fmt: skip
    if args.memory_only:
        result = {**json.loads(Path(args.json).read_text())}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = build(Path(tmp), name, args.layers, max(args.tokens, 4096))
            print(f"{name} ({folder.name}):")
            if args.memory_only:
                timing = dict(json.loads(Path(args.json).read_text())["models"].get(folder.name, {}))
                timing.pop("memory", None)
            else:
                timing = time_model(folder, stories, args.rounds, args.batch_size, args.graph_mb)
            memory = _memory(folder, args.tokens, args.graph_mb)
            ratio = f"{timing['ratio']:.2f}x" if "ratio" in timing else "not timed"
            print(f"  AtP / bare forward: {ratio}; peak above the model on a {memory['tokens']}-token story: "
                  f"AtP {memory['above_model_mb']:.0f} MB ({memory['live_above_model_mb']:.0f} MB alive), with no "
                  f"graph kept {memory['lean_above_model_mb']:.0f} MB ({memory['lean_live_above_model_mb']:.0f} MB), the "
                  f"recording pass {memory['record_above_model_mb']:.0f} MB "
                  f"({memory['record_live_above_model_mb']:.0f} MB alive)")  # fmt: skip
            result["models"][folder.name] = {**timing, "memory": memory}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
