"""Regenerate the docs' long-story paragraph from a benchmark run:

    python benchmarks/bench_long.py --tokens 2000 --causal --rounds 3 --json benchmarks/long.json
    python scripts/docs_long_table.py benchmarks/long.json

Replaces the text between <!-- long:start --> and <!-- long:end -->.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update


def paragraph(run: dict) -> str:
    s, shape = run["score"], run["shape"]
    best = s["ratios"].index(s["ratio"])  # the round the figure is from
    bare, score = s["seconds"]["bare"][best], s["seconds"]["score"][best]
    text = (
        f"Measured by `python benchmarks/bench_long.py --tokens {run.get('tokens_asked', s['tokens'])} --causal` on "
        f"{run['cpu']} "
        f"({run['cores']} cores, {run['threads']} threads, torch {run['torch']}), best of {len(s['ratios'])} "
        f"interleaved rounds: one {s['tokens']:,}-token story on a seeded Llama of {shape['layers']} x "
        f"{shape['heads']} heads ({shape['kv_heads']} key/value), {shape['hidden']} wide. Its bare forward (sdpa, no "
        f"output head) took {bare:.1f} s and `score` {score:.1f} s in the best round, **{s['ratio']:.2f}x** (target 2x; rounds "
        + ", ".join(f"{x:.2f}x" for x in s["ratios"])
        + ")"
    )
    if "causal_ratio" in s:
        text += (
            f"; `score --causal` (AtP and DLA: the gradient pass, block by block, the recording riding on its first "
            f"forward) {s['seconds']['causal'][s['causal_ratios'].index(s['causal_ratio'])]:.1f} s, "
            f"**{s['causal_ratio']:.2f}x** (target 4x; rounds "
            + ", ".join(f"{x:.2f}x" for x in s["causal_ratios"])
            + ")"
        )
    return text + "."


def main() -> None:
    run = json.loads(Path(sys.argv[1]).read_text())
    print(update("long", paragraph(run)))


if __name__ == "__main__":
    main()
