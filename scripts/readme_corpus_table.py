"""Regenerate the docs' corpus-scale table from a benchmark run (never typed in):

    python benchmarks/bench_corpus.py --json benchmarks/corpus.json
    python scripts/readme_corpus_table.py benchmarks/corpus.json

Replaces the text between <!-- corpus:start --> and <!-- corpus:end -->.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update


def table(r: dict) -> str:
    m = r["machine"]
    machines = r.get("machines", {})
    where = f"on {m['cpu']}"
    if len(set(machines.values())) > 1:  # sections kept from an earlier run (--merge) say where they ran
        where = "in runs of their own (" + "; ".join(f"{k} rows on {v}" for k, v in machines.items()) + ")"
    rows = [
        f"Measured by `python benchmarks/bench_corpus.py` {where}, {m['cores']} cores, each run a fresh "
        f"process, every built-in detector, the shipped model, {r['batch_size']} stories a batch (the default) "
        "unless the row says otherwise:",
        "",
        "| stories | engine | scoring | peak memory |",
        "|---|---|---|---|",
    ]
    for x in r["memory"]:
        rows.append(
            f"| {x['n']:,} | one process | {x['scoring_s']:.1f} s | {x['driver_peak_mb']:.0f} MB "
            f"({x['ratio_to_smallest']:.3f}x the smallest run) |"
        )
    for x in r.get("batch", []):
        rows.append(
            f"| {x['n']:,} | one process, {x['batch_size']} stories a batch | {x['scoring_s']:.1f} s | "
            f"{x['driver_peak_mb']:.0f} MB ({x['ratio_to_smallest']:.3f}x its smallest run) |"
        )
    for t in r["time"]:
        lo, ra = t["local"], t["ray"]
        rows.append(
            f"| {t['n']:,} | one process (2 threads) | {lo['scoring_s']:.1f} s | {lo['driver_peak_mb']:.0f} MB |"
        )
        actors = " + ".join(f"{a:.0f}" for a in ra["actor_peak_mb"])
        rows.append(
            f"| {t['n']:,} | Ray, 2 actors (1 thread each) | {ra['scoring_s']:.1f} s "
            f"({lo['scoring_s'] / ra['scoring_s']:.2f}x the speed) | driver {ra['driver_peak_mb']:.0f} MB, "
            f"actors {actors} MB |"
        )
        if "ray_before" in t:
            rb = t["ray_before"]
            actors = " + ".join(f"{a:.0f}" for a in rb["actor_peak_mb"])
            rows.append(
                f"| {t['n']:,} | Ray as it was at {t['before']} (a pool per window, the driver sends the "
                f"stories) | {rb['scoring_s']:.1f} s ({lo['scoring_s'] / rb['scoring_s']:.2f}x the speed) | "
                f"driver {rb['driver_peak_mb']:.0f} MB, actors {actors} MB |"
            )
    rows += ["", *(f"- {line.removeprefix('estimate: ')}" for line in r["estimate"]["lines"])]
    return "\n".join(rows)


def main() -> None:
    r = json.loads(Path(sys.argv[1]).read_text())
    update("corpus", table(r))


if __name__ == "__main__":
    main()
