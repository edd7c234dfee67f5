"""The sinks page's measured figures, from their runs (never typed in):

    python benchmarks/sinks_check.py --json benchmarks/sinks.json
    storylens report --out report
    python scripts/docs_sinks_table.py benchmarks/sinks.json report/heads.json

Replaces the text between <!-- sinks:start/end --> on docs/sinks.md.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update


def body(check: dict, heads: list[dict]) -> str:
    draws = check["random_draws"]
    ses = sorted(d["se"] for d in draws["each"])
    flagged = check["flagged"]
    f = check["flagged_effect"]
    lines = [
        f"| {check['layers']} blocks, {check['heads']} heads, {check['stories']} stories | heads | "
        "exact mean-ablation effect (nats, pooled over predicted tokens) |",
        "|---|---|---|",
        f"| flagged dormant, ablated together | {', '.join(flagged)} | {f['nats']:+.3g} (se {f['se']:.2g}) |",
        f"| {draws['draws']} random draws of {len(flagged)} heads | | mean {draws['mean_nats']:+.3g}, "
        f"from {draws['min_nats']:+.3g} to {draws['max_nats']:+.3g} (median se {ses[len(ses) // 2]:.2g}) |",
        "",
    ]

    def span(col: str, fmt: str = ".3f") -> str:
        vals = [h[col] for h in heads if h.get(col) is not None]
        return f"{min(vals):{fmt}} to {max(vals):{fmt}}"

    dormant = [h["label"] for h in heads if h.get("dormant")]
    lines.append(
        f"The shipped Tiny Storyteller over its quiz, every head: `first_mass` {span('first_mass')}, "
        f"`sink_rate` {span('sink_rate', '.2f')}, `first_value_ratio` {span('first_value_ratio', '.2f')}, "
        f"`context_share` {span('context_share')}, `active_rate` {span('active_rate', '.2f')}; dormant: "
        f"{', '.join(dormant) or 'none'}."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    check = json.loads(Path(sys.argv[1]).read_text())
    heads = json.loads(Path(sys.argv[2]).read_text())["heads"]
    print(update("sinks", body(check, heads)))
