"""The causal page's cost table, from a run of the benchmark (never typed in):

    python benchmarks/bench_causal.py --stories 16 --layers 30 --rounds 2         # time and memory
    python scripts/docs_causal_table.py benchmarks/causal.json

Replaces the text between <!-- causal-cost:start/end --> on docs/causal.md.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update


def _model(name: str) -> str:
    kind, layers = name.rsplit("-", 1)
    if kind == "gpt2":
        return "GPT-2 small's shape (12 x 12 heads)"
    depth = "all 30 of its blocks" if layers == "30" else f"{layers} of its 30 blocks"
    return f"Llama of SmolLM-135M's shape, {depth} (9 heads, 3 key/value heads)"


def body(bench: dict) -> str:
    rows = []
    for name, m in bench["models"].items():
        rounds = ", ".join(f"{r['ratio']:.2f}x" for r in m.get("rounds", [])) or "not timed"
        mem = m["memory"]
        rows.append(
            f"| {_model(name)} | {rounds} | {mem['above_model_mb']:,.0f} MB ({mem['live_above_model_mb']:,.0f} MB) | "
            f"{mem['lean_above_model_mb']:,.0f} MB ({mem['lean_live_above_model_mb']:,.0f} MB) | "
            f"{mem['record_above_model_mb']:,.0f} MB ({mem['record_live_above_model_mb']:,.0f} MB) |"
        )
    tokens = next(iter(bench["models"].values()))["memory"]["tokens"]
    return "\n".join(
        [
            f"{bench['stories']} quiz stories, {bench['batch_size']} a batch, at most {bench['graph_mb']:,} MiB of "
            f"graphs kept, {bench['threads']} threads, torch {bench.get('torch', '?')}, load average "
            f"{bench.get('load_before', '?')} when it started; peak resident memory above the loaded model on one "
            f"{tokens:,}-token story, each side in its own process (in brackets: with every tensor of 1 MB or more "
            "mapped alone, so the peak is that of the tensors alive together):",
            "",
            "| model | AtP / bare forward (each round) | AtP's peak | AtP's peak, no graph kept "
            "(`--graph-memory 0`) | the recording pass's peak |",
            "| --- | --- | --- | --- | --- |",
            *rows,
        ]
    )


if __name__ == "__main__":
    print(update("causal-cost", body(json.loads(Path(sys.argv[1]).read_text()))))
