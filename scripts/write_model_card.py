"""Write the shipped model's card (its README.md) from the training run that made it:

    python scripts/write_model_card.py runs/tiny-storyteller [storylens/pretrained/tiny-storyteller]

Everything in it is read from the run's checkpoint (recipe, evaluations, compute time), the shipped
folder itself (parameters, quiz perplexity measured now) and benchmarks/train_sweep.md (the short
runs behind the recipe).
"""

import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storylens.checkpoint import load_checkpoint  # noqa: E402
from storylens.data import load_split  # noqa: E402
from storylens.hub import load_model  # noqa: E402
from storylens.train import CHECKPOINT, quiz_perplexity, write_model_card  # noqa: E402
from scripts.readme_tables import README, replace_between  # noqa: E402


def cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sweep_table() -> str:
    lines = (ROOT / "benchmarks" / "train_sweep.md").read_text().splitlines()
    table = [x for x in lines if x.startswith("|")]
    return ("\nChosen from short runs of the same budget (600 steps; `benchmarks/train_sweep.md` in the "
            "repository):\n\n" + "\n".join(table) + "\n") if table else ""


def main() -> None:
    run = Path(sys.argv[1])
    folder = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "storylens" / "pretrained" / "tiny-storyteller"
    _, _, state, _, _ = load_checkpoint(run / CHECKPOINT)
    model = load_model(folder)
    split = load_split()
    ppl = quiz_perplexity(model, model.tokenizer, split.quiz)
    hardware = f"{cpu()}, {os.cpu_count()} cores (torch CPU build)"
    path = write_model_card(folder, state, model.num_parameters(), hardware, len(split.quiz), len(split.train),
                            ppl, sweep_table())
    print(f"{path}: quiz perplexity {ppl:.2f}")
    cfg = state["train_config"]
    line = (f"The shipped model was trained here ({len(split.train):,} training stories, {state['step']:,} steps of "
            f"{cfg['batch_size']} x {cfg['block_size']} tokens, {state['train_seconds'] / 60:.0f} minutes of training "
            f"time on {os.cpu_count()} CPU cores): **quiz perplexity {ppl:.2f}** (`storylens perplexity`; the lesson's model: 9). "
            "The recipe, the short runs that chose it and the curve are in its model card "
            "(`storylens/pretrained/tiny-storyteller/README.md`).")
    README.write_text(replace_between(README.read_text(), "model-line", line))


if __name__ == "__main__":
    main()
