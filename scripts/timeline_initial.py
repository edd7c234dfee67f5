"""Give a head timeline recorded before step 0 was measured its step-0 line: the run's initial
weights, remade from its recipe and seed (``torch.manual_seed(seed)``, then the model, as
``storylens train`` makes them), measured on the quiz before any step.

    python scripts/timeline_initial.py benchmarks/sizes/blocks-*
    cp benchmarks/sizes/blocks-6/heads_timeline.jsonl storylens/pretrained/tiny-storyteller/

Each FOLDER holds ``heads_timeline.jsonl``, the run's recipe (``result.json`` or
``train_state.json``) and maybe its tokenizer (``tokenizer.json``; else the shipped model's, which
every run of the shared corpus at the recipe's vocabulary trains alike: the byte-level BPE
training is deterministic). A timeline that already starts at step 0 is left as it is. The shipped
model's timeline is ``benchmarks/sizes/blocks-6``'s (its run's state is kept there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storylens.data.stories import load_split  # noqa: E402
from storylens.model.tokenizer import load_tokenizer  # noqa: E402
from storylens.training.page import RESULT_FILES  # noqa: E402
from storylens.training.timeline import TIMELINE_FILE, initial_entry, read_timeline, write_timeline  # noqa: E402
from storylens.training.train import TrainConfig  # noqa: E402

SHIPPED = ROOT / "storylens" / "pretrained" / "tiny-storyteller"


def recipe(folder: Path) -> TrainConfig:
    """The run's training settings, from its result or state file."""
    for name in RESULT_FILES:
        if (folder / name).is_file():
            return TrainConfig(**json.loads((folder / name).read_text())["train_config"])
    sys.exit(f"{folder}: no {' or '.join(RESULT_FILES)}: the run's recipe is not known")


def add_initial(folder: Path, quiz: list[str]) -> str:
    """Put the step-0 line at the head of ``folder``'s timeline where it has none; what was done."""
    entries = read_timeline(folder / TIMELINE_FILE)
    if entries and entries[0]["step"] == 0:
        return f"{folder}: starts at step 0 already"
    cfg = recipe(folder)
    tok_path = folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else SHIPPED / "tokenizer.json"
    entry = initial_entry(cfg.model_config(), cfg.seed, load_tokenizer(tok_path), quiz)
    write_timeline(folder / TIMELINE_FILE, [entry, *entries])
    return f"{folder}: step 0 measured ({cfg.n_layer} blocks, seed {cfg.seed}; quiz loss {entry['quiz_loss']:.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", type=Path, nargs="+")
    args = p.parse_args()
    quiz = load_split().quiz
    for folder in args.folders:
        print(add_initial(folder, quiz))


if __name__ == "__main__":
    main()
