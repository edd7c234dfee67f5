"""Regenerate the docs' four-size table from the kept size runs (never typed in):

    python scripts/readme_sizes_table.py            # reads benchmarks/sizes/blocks-*

Replaces the text between <!-- sizes:start/end --> with one row per kept run (``scripts/train_sizes.py``
keeps each run's head timeline, copying check and ``result.json`` there), read the way the
comparison page reads them (``storylens timeline benchmarks/sizes/* --out sizes``).
``tests/test_timeline.py`` fails when docs/training.md and the kept runs disagree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.readme_tables import update  # noqa: E402
from storylens.model.gpt import GPT  # noqa: E402
from storylens.training.copying import read_copying  # noqa: E402
from storylens.training.page import run_summary, train_minutes  # noqa: E402
from storylens.training.timeline import read_timeline  # noqa: E402
from storylens.training.train import TrainConfig  # noqa: E402

KEPT = ROOT / "benchmarks" / "sizes"
KINDS = ("previous-token", "name", "induction")


def kept_runs(kept: Path = KEPT) -> list[Path]:
    """The kept runs that have finished (a ``result.json``), fewest blocks first."""
    runs = [p for p in kept.glob("blocks-*") if (p / "result.json").is_file()]
    return sorted(runs, key=lambda p: int(p.name.split("-")[1]))


def _formed(f: dict | None) -> str:
    if f is None:
        return "n/a"
    when = f"{f['half_way_tokens'] / 1e6:.1f} M"
    return (
        f"{'≤ ' if f['at_first'] else ''}{when}, block {f['block']} ({f['head']}, {f['first']:.3f} → {f['peak']:.3f})"
    )


def table(runs: list[Path]) -> str:
    rows, budgets, samples = [], set(), set()
    for run in runs:
        result = json.loads((run / "result.json").read_text())
        cfg = TrainConfig(**result["train_config"])
        budgets.add((result["step"], cfg.batch_size, cfg.block_size, cfg.n_head, cfg.n_embd))
        s = run_summary(run.name, read_timeline(run))
        copied = read_copying(run)
        samples.add(copied["samples"] if copied else None)
        share = (
            f"{100 * copied['share']:.1f}% of {copied['runs']:,}"
            if copied and copied.get("share") is not None
            else "n/a"
        )
        ind = s["induction_step"]
        minutes = train_minutes(run)
        rows.append(
            f"| {cfg.n_layer} | {GPT(cfg.model_config()).num_parameters() / 1e6:.2f} M | {s['quiz_perplexity']:.2f} | "
            f"{s['second_copy_loss']:.2f} / {s['first_copy_loss']:.2f} | "
            f"{ind['tokens'] / 1e6:.1f} M ({ind['rise']:+.3f}) | "
            + " | ".join(_formed(s["formation"][k]) for k in KINDS)
            + f" | {share} | {'n/a' if minutes is None else f'{minutes:.0f} min'} |"
        )
    if len(budgets) != 1:
        raise SystemExit(f"the kept runs differ in budget or width: {sorted(budgets)}")
    steps, batch, window, heads, width = budgets.pop()
    head = (
        f"The same recipe and budget at every size: {steps:,} steps of {batch} x {window} tokens "
        f"({steps * batch * window / 1e6:.1f} M tokens), {heads} heads a block, {width} wide, the EMA weights "
        "measured; a kind of head *forms* where its strongest head at the end first gets half way from its "
        f"score at step 0 to its highest. Copying: the share of the 8-word runs in {'/'.join(map(str, samples))} "
        "stories each model "
        "writes from the end-of-story marker (the same seeds) found word for word in its training stories. "
        "Training time: the steps' wall clock, on this shared 2-core machine beside other work (not a clean "
        "measure of speed)."
    )
    return "\n".join(
        [
            head,
            "",
            "| blocks | parameters | quiz perplexity | induction test: second / first copy (nats) | "
            "induction score's largest rise at | previous-token head forms | name head forms | "
            "induction head forms | copied from training | training time |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def main() -> None:
    update("sizes", table(kept_runs()))


if __name__ == "__main__":
    main()
