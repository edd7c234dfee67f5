"""Where copying begins: the shipped recipe and token budget at 1, 2 and 4 blocks (the same width),
beside the shipped 6-block model, each with its head timeline and copying check.

    nice -n 15 python scripts/train_sizes.py --out runs/sizes      # kill it any time; run it again to go on
    storylens timeline benchmarks/sizes/* --out sizes               # the comparison page

Each size trains in ``OUT/blocks-N`` (resumed where a checkpoint is there, skipped when done) with
``storylens train --n-layer N``; when it is done, what ships (the run's head timeline, its copying
check and a small ``result.json``: evaluations, steps, training time) is copied to
``benchmarks/sizes/blocks-N`` (tracked; checkpoints are not). The 6-block row is the shipped
model's own timeline and copying check (``storylens/pretrained/tiny-storyteller``), beside the
``train_state.json`` its run wrote, kept in ``benchmarks/sizes/blocks-6`` (its ``result.json`` is
made from it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "storylens" / "pretrained" / "tiny-storyteller"
KEPT = ROOT / "benchmarks" / "sizes"
SIZES = (1, 2, 4)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from scripts.timeline_initial import add_initial
    from storylens.data.stories import load_split
    from storylens.training.checkpoint import load_checkpoint
    from storylens.training.copying import COPYING_FILE
    from storylens.training.timeline import TIMELINE_FILE
    from storylens.training.train import CHECKPOINT

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/sizes"), help="where the runs train (untracked)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="blocks per run, comma-separated")
    args = p.parse_args()
    for n in [int(x) for x in args.sizes.split(",") if x]:
        run = args.out / f"blocks-{n}"
        cmd = [sys.executable, "-m", "storylens", "train", "--n-layer", str(n), "--out", str(run)]
        if (run / CHECKPOINT).exists():
            cmd.append("--resume")
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
        _, _, state, _, _ = load_checkpoint(run / CHECKPOINT)
        kept = KEPT / f"blocks-{n}"
        kept.mkdir(parents=True, exist_ok=True)
        for name in (TIMELINE_FILE, COPYING_FILE):
            shutil.copyfile(run / name, kept / name)
        write_result(state, kept)
        print(add_initial(kept, load_split().quiz), flush=True)  # a run begun before step 0 was measured
        print(f"blocks-{n}: {state['step']} steps, {state['train_seconds'] / 60:.1f} min; kept in {kept}", flush=True)
    six = KEPT / "blocks-6"
    six.mkdir(parents=True, exist_ok=True)
    for name in (TIMELINE_FILE, COPYING_FILE):
        if (SHIPPED / name).exists():
            shutil.copyfile(SHIPPED / name, six / name)
    if (six / "train_state.json").is_file():
        write_result(json.loads((six / "train_state.json").read_text()), six)


def write_result(state: dict, kept: Path) -> None:
    """A run's small result file: evaluations, steps, training time and recipe."""
    result = {k: state.get(k) for k in ("step", "evals", "train_seconds", "timeline_seconds", "train_config")}
    (kept / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
