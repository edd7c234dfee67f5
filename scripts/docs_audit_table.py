"""The audit page's measured table, from a report run (never typed in):

    storylens report --causal --out report
    python scripts/docs_audit_table.py report/summary.json

Replaces the text between <!-- audit:start/end --> on docs/audit.md.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update


def body(a: dict) -> str:
    def cell(e: dict | None) -> str:
        return "" if e is None else f"{e['nats']:+.4f} ± {e['se']:.4f}"

    every = bool(a["rows"]) and a["rows"][0]["why"] == "every"  # every head measured (mean ablation) in the pass
    rows = [
        f"| {r['head']} | {cell(r['exact_mean'])} | {cell(r['atp_mean'])} | {cell(r['atp_zero'])} |"
        if every
        else f"| {r['head']} | {r['why']} | {cell(r['atp_mean'])} | {cell(r['exact_mean'])} | {cell(r['atp_zero'])} | "
        f"{cell(r['exact_zero'])} |"
        for r in sorted(a["rows"], key=lambda r: -r["exact_mean"]["nats"] if every else 0)
    ]
    rho = " and ".join(
        f"{m} ablation {a[f'rho_{m}']:+.2f}" if a[f"rho_{m}"] is not None else f"{m} ablation n/a"
        for m in ("mean", "zero")
    )
    disagree = ", ".join(f"{h} ({m})" for h, m in a["disagree"]) or "none"
    return "\n".join(
        [
            f"On {a['n_stories']} quiz stories ({a['n_tokens']:,} predicted tokens), nats per predicted token:",
            "",
            *(
                ["| head | exact, mean | AtP, mean | AtP, zero |", "|---|---|---|---|"]
                if every
                else [
                    "| head | chosen | AtP, mean | exact, mean | AtP, zero | exact, zero |",
                    "|---|---|---|---|---|---|",
                ]
            ),
            *rows,
            "",
            f"Spearman's rho, AtP against exact: {rho}. Sign disagreements beyond both errors: {disagree}.",
        ]
    )


if __name__ == "__main__":
    print(update("audit", body(json.loads(Path(sys.argv[1]).read_text())["audit"])))
