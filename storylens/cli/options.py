"""The options and helpers several ``storylens`` commands share: the one-line usage error, the
model options and loading, output folders, progress and budget flags, the corpus-scoring options
of ``report`` and ``score``, and user head detectors."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from storylens.core.errors import StorylensError, UsageError
from storylens.core.files import MAX_SMALL_BYTES, checked_file
from storylens.core.progress import NO_PROGRESS_HELP
from storylens.corpus.options import EXAMPLES, EXAMPLES_BUDGET
from storylens.effects.cost import ABLATION_LIMIT_FLOPS, OVER_BUDGET_FLAG
from storylens.effects.estimators import ESTIMATORS, IG_STEPS
from storylens.effects.exact import EXACT_MODES
from storylens.effects.patching import PAIR_SETS, read_pairs
from storylens.engine.gradients import GRAPH_BYTES
from storylens.lm import NativeLM, is_transformers_folder, load_lm, resolve_device, resolve_dtype
from storylens.looking.detectors import pattern_detector
from storylens.model.gpt import GPT

OVER_BUDGET_HELP = (
    f"start even where the ablations' estimate (said before they start) passes {ABLATION_LIMIT_FLOPS / 1e12:g} "
    "TFLOP; without it such a run is refused"
)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and the exit code 2), not a usage block."""

    def error(self, message: str):
        self.exit(2, f"storylens: error: {message} (see {self.prog} --help)\n")  # every error line starts alike


def one_line(e: BaseException) -> str:
    """An error's message on one line (its type's name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


# ---------------------------------------------------------------- the model


def add_model(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    """``--model``, ``--allow-download``, ``--device`` and (unless the command has a ``--dtype`` of
    its own: ``check``) ``--dtype``."""
    p.add_argument("--model", default=None, help="model folder or hub id (default: the shipped Tiny Storyteller)")
    p.add_argument("--allow-download", action="store_true", help="let --model fetch a hub id over the network")
    p.add_argument("--device", default=None, help="run the model on cpu, cuda, cuda:N or mps (default cpu)")
    if dtype:
        p.add_argument(
            "--dtype",
            dest="model_dtype",
            choices=["float32", "float64", "bfloat16", "float16"],
            default=None,
            help="run the model in this precision (default: as stored)",
        )


def load(args):
    """The ``--model``: a storylens folder, a transformers folder or a hub id, as an AttentionLM,
    in ``--dtype`` on ``--device``."""

    device = resolve_device(getattr(args, "device", None), "--device")
    dtype = resolve_dtype(getattr(args, "model_dtype", None), "--dtype")
    return load_lm(args.model, allow_download=args.allow_download, dtype=dtype, device=device)


def load_native(args, what: str) -> GPT:
    """A storylens model (the commands about storylens's own attention paths, KV cache and export);
    a transformers folder is refused before it is loaded."""

    wrong = f"{what}: works on storylens's own models; {args.model} is a transformers model"
    if args.model is not None and is_transformers_folder(Path(args.model)):
        raise StorylensError(wrong)
    lm = load(args)
    if not isinstance(lm, NativeLM):
        raise StorylensError(wrong)
    return lm.module


# ---------------------------------------------------------------- inputs, outputs, flags


def add_quiz_stories(p: argparse.ArgumentParser) -> None:
    """``--stories``: the corpus whose last 200 stories are the quiz (``perplexity``, ``ablate``)."""
    p.add_argument(
        "--stories",
        default=None,
        help="corpus whose last 200 stories are the quiz "
        "(default: the shared corpus, else the quiz shipped with the model)",
    )


def out_path(value: str, option: str = "--out") -> Path:
    """An output folder option as a path; an empty one is refused (it would mean the current folder)."""
    if not value.strip():
        raise UsageError(f"{option}: empty; give the output folder a name")
    return Path(value)


def check_seed(seed: int) -> None:
    """A sampling seed torch takes: 0 to 2^64 - 1 (a negative one would wrap to another seed)."""
    if not 0 <= seed < 2**64:
        raise UsageError(f"--seed: must be between 0 and 2^64 - 1 (got {seed})")


def add_no_progress(p: argparse.ArgumentParser) -> None:
    """``--no-progress``: no bar, and no progress lines off a terminal."""
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)


def add_over_budget(p: argparse.ArgumentParser) -> None:
    """``--over-budget``: start ablations whose estimate passes the limit."""
    p.add_argument(OVER_BUDGET_FLAG, action="store_true", help=OVER_BUDGET_HELP)


# ---------------------------------------------------------------- scoring a corpus (report, score)


def add_examples(p: argparse.ArgumentParser) -> None:
    """``--examples``: the queries kept where each head fires most."""
    p.add_argument(
        "--examples",
        type=int,
        default=EXAMPLES,
        metavar="K",
        help=f"keep the K queries where each head fires most, per detector, in examples.json (default {EXAMPLES}; "
        f"0: none; at most {EXAMPLES_BUDGET:,} examples in all, heads x detectors x K: about 1 KB each, refused past it)",
    )


def exact_modes(text: str) -> tuple[str, ...]:
    """``--exact``'s value: modes separated by commas (``mean,zero``), each checked."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in EXACT_MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"modes among {', '.join(EXACT_MODES)}, separated by commas, each once")
    return modes


def add_exact(p: argparse.ArgumentParser) -> None:
    """``--exact [MODES]`` and ``--exact-stories``: every head's exact effect, measured."""
    p.add_argument(
        "--exact",
        type=exact_modes,
        nargs="?",
        const=("mean",),
        default=(),
        metavar="MODES",
        help="every head's exact effect on the mean next-token loss, measured in the same pass with a standard "
        "error: its output replaced by its corpus mean, zero or its output on another story "
        f"({'|'.join(EXACT_MODES)}, several with commas; --exact alone: mean; see docs/exact.md); its cost is "
        f"said before scoring, and past {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP needs --exact-stories or {OVER_BUDGET_FLAG}",
    )
    p.add_argument(
        "--exact-stories",
        type=int,
        default=None,
        metavar="N",
        help="with --exact: measure it on the first N stories only (default: every one); with --causal alone: "
        "the exact effect's stories (default: as many as the budget allows)",
    )
    add_estimator(
        p,
        "with --exact: estimate every head's effect too, on every story, and audit the estimate against the "
        "exact effect where both ran",
    )
    add_backups(
        p,
        "with --exact: after scoring, switch off the K heads of largest exact effect together and measure every "
        "other head's effect again (the backup_gain columns: a head that stands in for them gains), and what the "
        "model repairs (summary.json's backups); on the first stories --exact covered, at most 200",
    )


def add_estimator(p: argparse.ArgumentParser, what: str) -> None:
    """``--estimator`` and ``--ig-steps`` (score, patch): ``what`` opens the help."""
    p.add_argument(
        "--estimator",
        choices=ESTIMATORS,
        default=None,
        help=f"{what}: atp (one backward pass), atp* (AtP with GradDrop: a backward pass per block more), ig "
        "(integrated gradients, a block's heads together, --ig-steps points), quadratic (the slope half way, each "
        "head alone); see docs/exact.md",
    )
    p.add_argument(
        "--ig-steps",
        type=int,
        default=IG_STEPS,
        metavar="M",
        help=f"with --estimator ig: its steps (default {IG_STEPS})",
    )


def add_backups(p: argparse.ArgumentParser, what: str) -> None:
    """``--backups K`` (score, patch): ``what`` is its help."""
    p.add_argument("--backups", type=int, default=0, metavar="K", help=what)


def graph_memory_of(args) -> int:
    """``--graph-memory``'s MiB (its default where not given; without ``--causal`` refused by storylens.cli.rules)."""
    return GRAPH_BYTES >> 20 if args.graph_memory is None else args.graph_memory


def add_causal(p: argparse.ArgumentParser, more: str = "") -> None:
    """``--causal`` and ``--graph-memory``: every head's effect on the loss (``more``: what else it does here)."""
    p.add_argument(
        "--causal",
        action="store_true",
        help="also every head's effect on the loss: attribution patching (atp_mean, atp_zero) and direct logit "
        "attribution (dla), with standard errors; per batch, a backward pass and a second forward of every "
        f"block but those whose graphs --graph-memory keeps{more} (see docs/causal.md)",
    )
    p.add_argument(
        "--graph-memory",
        type=int,
        default=None,
        metavar="MB",
        help="with --causal: the MiB the gradient pass may hold of the first blocks' graphs, so that it need not "
        f"run them twice (default {GRAPH_BYTES >> 20}; 0: the least memory, one block's activations at a time)",
    )


def load_detector(path: str):
    """A user head detector from a Python file defining ``pattern(ids) -> [batch, query, key]`` key
    weights and, optionally, ``NAME`` (default: the file's stem). The file is run as Python: only
    pass files you wrote or trust."""

    file = Path(path)
    if not file.exists():
        raise StorylensError(f"--detector {path}: no such file")
    checked_file(file, MAX_SMALL_BYTES, "a detector is a small Python file")  # a FIFO or a 10 GB file: one line
    spec = importlib.util.spec_from_file_location(f"storylens_detector_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise StorylensError(f"--detector {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error becomes one line
        raise StorylensError(f"--detector {path}: {type(e).__name__}: {one_line(e)}") from None
    except SystemExit as e:
        raise StorylensError(f"--detector {path}: called sys.exit({e.code!r}) while loading") from None
    fn = getattr(module, "pattern", None)
    if not callable(fn):
        raise StorylensError(f"--detector {path}: defines no function pattern(ids) -> [batch, query, key] weights")
    try:
        return pattern_detector(getattr(module, "NAME", file.stem), fn)
    except ValueError as e:
        raise StorylensError(f"--detector {path}: {e}") from None


def add_pairs(p: argparse.ArgumentParser) -> None:
    """``--pairs`` (patch, circuit): a pairs file or a task shipped with storylens."""
    p.add_argument(
        "--pairs",
        default="names",
        help='a .jsonl file, one {"clean", "corrupt", "answer", "wrong"} object a line, or a task shipped with '
        "storylens: names (the default: the main character's name, introduced once and needed again; the name "
        "changed at its introduction in the corrupt story), names-paraphrased (the same behaviour in ten other "
        "stories and names: a second file for --second-pairs) or indirect-object (who gave what to whom)",
    )


def task_rows(args, pairs: str | None = None) -> tuple[Path, list[dict]]:
    """``--pairs``'s file (or ``pairs``) and its lines, each checked (a bad line refused before the model loads)."""
    name = args.pairs if pairs is None else pairs
    source = PAIR_SETS.get(name, Path(name))
    return source, read_pairs(source)
