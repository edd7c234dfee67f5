"""The exact-effects page's tables, from a run of the benchmark (never typed in):

    python benchmarks/bench_estimators.py --json benchmarks/estimators.json
    python scripts/docs_exact_table.py benchmarks/estimators.json

Replaces the text between <!-- exact-estimators:start/end --> and <!-- exact-heads:start/end --> on docs/exact.md.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update


def estimators(bench: dict) -> str:
    s, patch = bench["shipped"], bench["patch"]
    llama = bench.get("llama-30x9")
    head = (
        f"Tiny Storyteller, its first {s['stories']} quiz stories ({s['tokens']:,} predicted tokens), mean ablation to "
        f"the heads' means over those stories; the 20 example pairs for patching; {bench['threads']} threads "
        f"({bench['machine']}). Cost: the time over one forward pass with logits and loss over the same stories, timed "
        f"in the same run (exact: {s['exact']['over_forward']:.1f}x for all 24 heads)"
        + (
            f"; on a seeded Llama of the 30 x 9-head shape over {llama['stories']} stories, exact "
            f"{llama['exact_over_forward']:.0f}x for all 270 heads."
            if llama
            else "."
        )
    )
    rows = []
    for name, e in s["estimators"].items():
        missed = e["missed"]
        miss = "" if missed is None else f"{missed['largest_missed']} ({missed['largest_missed_nats']:+.4f})"
        wrong = ", ".join(e["disagree"]) or "none"
        cost = "" if not llama else llama["estimators"].get(name)
        rows.append(
            f"| {name} | {e['rho']:+.2f} | {wrong} | {miss} | {e['sum']:+.3f} | {e['over_forward']:.1f}x | "
            f"{'' if cost in ('', None) else f'{cost:.0f}x'} | {patch[name]['rho']:+.3f} |"
        )
    total = sum(v[0] for v in s["exact"]["heads"].values())
    return "\n".join(
        [
            head,
            "",
            "| estimator | rho vs exact, corpus loss | opposite sign beyond both errors | largest exact effect outside "
            "its top 5 | sum over heads (exact " + f"{total:+.3f})" + " | cost, shipped | cost, 30 x 9 Llama | rho vs "
            "exact, patching |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "The means' own sampling error: the exact effects again with the means taken over two disjoint samples "
            "of the corpus (none of them quiz stories) move a head by at most "
            + "; ".join(
                f"{m['largest_change_over_se']:.2f} of its standard error ({m['head']}; median "
                f"{m['median_change_over_se']:.2f}) with {int(n):,} stories a sample"
                for n, m in s["means"].items()
            )
            + ".",
        ]
    )


def heads(bench: dict) -> str:
    s = bench["shipped"]
    ex = s["exact"]["heads"]
    names = [n for n in ("atp", "ig(4)", "quadratic") if n in s["estimators"]]
    rows = []
    for label in sorted(ex, key=lambda h: -ex[h][0]):
        cells = [f"{ex[label][0]:+.4f} ± {ex[label][1]:.4f}"]
        cells += [f"{s['estimators'][n]['heads'][label][0]:+.4f}" for n in names]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(
        [
            "| head | exact, mean ablation (nats) | " + " | ".join(names) + " |",
            "| --- | --- | " + " | ".join("---" for _ in names) + " |",
            *rows,
        ]
    )


if __name__ == "__main__":
    bench = json.loads(Path(sys.argv[1]).read_text())
    update("exact-estimators", estimators(bench))
    print(update("exact-heads", heads(bench)))
