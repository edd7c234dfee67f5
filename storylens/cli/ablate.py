"""``storylens ablate``: switch heads off and measure the loss on the main character's name, then
write the same prompt with and without them."""

from __future__ import annotations

import sys

from storylens.cli.options import add_model, add_no_progress, add_over_budget, add_quiz_stories, check_seed, load
from storylens.core.errors import UsageError
from storylens.core.heads import head_label, parse_head_label
from storylens.core.progress import progress_command
from storylens.effects.ablation import generation_divergence, normalise_heads
from storylens.effects.cost import ablate_cost, check_ablation_budget
from storylens.lesson.figures import DIVERGENCE_PROMPT
from storylens.lesson.inputs import lesson_data
from storylens.lesson.report import _quiz_folder
from storylens.table.name_ablation import name_ablation_table

COMMAND = "ablate"
POSITION = 40


def add_parser(sub) -> None:
    a = sub.add_parser(COMMAND, help="switch heads off and measure the loss on the main character's name")
    a.add_argument(
        "--heads",
        nargs="*",
        default=None,
        help="only these heads, e.g. L4H2 L5H1: each alone, then "
        "all together (default: every head alone, plus the top three name heads together)",
    )
    a.add_argument(
        "--mode",
        choices=["zero", "mean"],
        default=None,
        help="replace a head's output by zeros or by its mean output (default: both)",
    )
    add_model(a)
    add_quiz_stories(a)
    a.add_argument("--quiz", default=None, help="measure on every story of this file instead")
    a.add_argument("--prompt", default=DIVERGENCE_PROMPT, help="prompt for the generation side-by-side")
    a.add_argument(
        "--seed", type=int, default=0, help="sampling seed for the side-by-side generation, 0 to 2^64 - 1 (default 0)"
    )
    add_no_progress(a)
    add_over_budget(a)
    a.set_defaults(func=run)


def run(args) -> int:
    modes = (args.mode,) if args.mode else ("zero", "mean")
    check_seed(args.seed)
    heads = None
    if args.heads:  # wrong on its face: refused before the model loads
        try:
            heads = [head_label(*parse_head_label(h)) for h in args.heads]
        except ValueError as e:
            raise UsageError(f"--heads: {e}") from None
    model = load(args)
    stories = lesson_data(_quiz_folder(model), args.stories, args.quiz, quiz_option="--quiz").quiz
    # --heads: those heads alone (one row each) and, two or more, together; none: every head
    # alone plus the top three name heads together
    group = heads if heads is None or len(heads) > 1 else []
    if heads:
        normalise_heads(model, heads)  # a head the model lacks: refused before anything is estimated
    lengths = [min(len(model.encode(s)), model.window) for s in stories]
    cost = ablate_cost(model, lengths, heads, modes, group=3 if group is None else len(group))
    check_ablation_budget(cost, "ablate", over=args.over_budget)  # said before it starts; refused past the budget
    with progress_command("ablate"):  # off a terminal: a progress line every few seconds
        table = name_ablation_table(
            model, stories, name_heads=group, heads=heads, modes=modes, progress=not args.no_progress
        )
    print(table.format())
    first = heads[0] if heads else table.rows[-1].label.split("+")[0]
    d = generation_divergence(
        model,
        args.prompt,
        heads or [first],
        seed=args.seed,
        max_new_tokens=80,
        mode=modes[0],
        temperature=0.8,
        top_k=40,
    )
    print()
    print(d.format())
    sys.stdout.flush()
    return 0
