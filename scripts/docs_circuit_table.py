"""The circuit page's figures, from a run of storylens circuit (never typed in):

    storylens circuit --out circuit-run
    python scripts/docs_circuit_table.py circuit-run/circuit.json

Replaces the text between <!-- circuit-shipped:start/end --> on docs/circuit.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update
from storylens.circuits.run import ENOUGH, load_circuit


def shipped(path: str) -> str:
    r = load_circuit(path)
    f = r.faithfulness
    lines = [
        f"`storylens circuit --out circuit-run` ({r.model}, the name task's {r.pairs} pairs, {r.n_edges:,} edges). "
        f"{r.verdict}",
        "",
        "| edges (share) | kept after pruning | faithfulness |",
        "|---|---|---|",
    ]
    lines += [f"| {p:.1%} | {k:,} | {x:+.3f} ± {se:.3f} |" for p, k, x, se in zip(f.percentages, f.kept, f.f, f.f_se)]
    lines += ["", f"CPR {f.cpr:.3f} ± {f.cpr_se:.3f}, CMD {f.cmd:.3f} ± {f.cmd_se:.3f}."]
    if r.circuit_size is not None:
        edges = sorted((e for e in r.edges if e.in_circuit), key=lambda e: -abs(e.score))
        lines += [
            "",
            f"The smallest circuit keeping {ENOUGH:.0%} of the metric: {len(edges)} edges (the top {r.circuit_size} "
            f"before pruning), f {r.circuit_f:+.3f}. Its largest edges:",
            "",
            "| writer | receiver | EAP score |",
            "|---|---|---|",
        ]
        lines += [f"| {e.writer} | {e.receiver} | {e.score:+.3f} ± {e.score_se:.3f} |" for e in edges[:10]]
    if r.oracle is not None:
        o = r.oracle
        rho = "n/a" if o.rho is None else f"{o.rho:.3f}"
        lines += ["", f"Oracle: {len(o.rows)} edges ablated alone and run, Spearman's rho against EAP {rho}"
                  + (f"; opposite signs beyond both errors: {', '.join(o.disagree)}." if o.disagree else "; no edge of opposite signs beyond both errors.")]  # fmt: skip
    if r.stability is not None:
        s = r.stability
        lines += ["", f"Stability over {s.resamples} bootstrap resamples of the pairs: Jaccard {s.jaccard:.3f} (sd "
                  f"{s.jaccard_sd:.3f}) with the {s.kept}-edge circuit; {s.core} edges found in every resample keep f "
                  f"{s.core_f:+.3f}."]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    print(update("circuit-shipped", shipped(sys.argv[1])))
