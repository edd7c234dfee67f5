"""Regenerate the docs' detector benchmark table from a benchmark run (never typed in):

    python benchmarks/bench_detectors.py --json benchmarks/detectors.json   # in an environment with TransformerLens
    python scripts/readme_detectors_table.py benchmarks/detectors.json

Replaces the text between <!-- detectors:start --> and <!-- detectors:end -->.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update

NAMES = {"tiny": "Tiny Storyteller (shipped)", "gpt2-124m": "GPT-2 small shape, random weights"}


def table(r: dict) -> str:
    m = r["machine"]
    rows = [
        f"Measured by `python benchmarks/bench_detectors.py` on {m['cpu']} ({m['cores']} cores, torch {m['torch']}, "
        f"transformers {m['transformers']}, TransformerLens {m['transformer_lens']}), best of {r['rounds']} "
        f"interleaved rounds; peak memory above the loaded model, each side in its own process:",
        "",
        "| model | stories (tokens) | storylens: every detector, one pass | TransformerLens `run_with_cache` + `detect_head` x3 | TL / storylens |",
        "|---|---|---|---|---|",
    ]
    for name, x in r["models"].items():
        i, s, mem, q = x["inputs"], x["seconds"], x["memory"], x["tl_over_storylens"]
        rows.append(
            f"| {NAMES.get(name, name)}: {i['layers']} x {i['heads']} heads, {i['parameters'] / 1e6:.0f}M "
            f"| {i['stories']} ({i['tokens']:,}) "
            f"| {s['storylens']:.2f} s, {mem['storylens']['peak_above_loaded_mb']:,.0f} MB "
            f"| {s['TL']:.2f} s, {mem['TL']['peak_above_loaded_mb']:,.0f} MB "
            f"| {q['time']:.2f}x time, {q['memory']:.2f}x memory |"
        )
    return "\n".join(rows)


def main() -> None:
    r = json.loads(Path(sys.argv[1]).read_text())
    update("detectors", table(r))


if __name__ == "__main__":
    main()
