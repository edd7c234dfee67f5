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
    def cell(e: dict) -> str:
        return f"{e['nats']:+.4f} ± {e['se']:.4f}"

    rows = [
        f"| {r['head']} | {r['why']} | {cell(r['atp_mean'])} | {cell(r['exact_mean'])} | {cell(r['atp_zero'])} | "
        f"{cell(r['exact_zero'])} |"
        for r in a["rows"]
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
            "| head | chosen | AtP, mean | exact, mean | AtP, zero | exact, zero |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Spearman's rho, AtP against exact: {rho}. Sign disagreements beyond both errors: {disagree}.",
        ]
    )


if __name__ == "__main__":
    print(update("audit", body(json.loads(Path(sys.argv[1]).read_text())["audit"])))
