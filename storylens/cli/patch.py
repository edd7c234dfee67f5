"""``storylens patch``: every head's effect on a task of clean/corrupt pairs (attribution and exact
patching)."""

from __future__ import annotations

from storylens.cli.options import (
    add_backups,
    add_estimator,
    add_model,
    add_no_progress,
    add_pairs,
    load,
    out_path,
    task_rows,
)
from storylens.core.errors import UsageError
from storylens.core.progress import ProgressLines, progress_command
from storylens.core.publish import check_target_folder
from storylens.effects.patch_more import patch_more
from storylens.effects.patching import encode_pairs, summary_lines, write_patch

COMMAND = "patch"
POSITION = 50


def add_parser(sub) -> None:
    p = sub.add_parser(
        COMMAND, help="every head's effect on a task of clean/corrupt pairs (attribution and exact patching)"
    )
    add_pairs(p)
    p.add_argument("--out", required=True, help="output folder: patch.csv, patch.json, patch.html")
    p.add_argument(
        "--exact",
        default=None,
        metavar="all|K",
        help="heads patched exactly: all, or the top K by |atp| (default: all while heads x pairs <= 1000, "
        "else the top 1000 // pairs)",
    )
    add_estimator(p, "estimate every head's effect too, from the clean outputs towards the corrupt ones, beside AtP")
    add_backups(
        p,
        "patch the K heads of largest exact effect together, then every other head again with them: its backup gain "
        "(patch.csv's backup_gain: a head that stands in for them gains), and what the model repairs",
    )
    add_model(p)
    add_no_progress(p)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.ig_steps < 1:
        raise UsageError(f"--ig-steps: a whole number, 1 or more (got {args.ig_steps})")
    exact: str | int | None = args.exact
    if args.exact is not None and args.exact != "all":
        if not args.exact.isdigit():
            raise UsageError(f"--exact: {args.exact!r}; give all or a number of heads")
        exact = int(args.exact)
    out = out_path(args.out)
    check_target_folder(out, kind="patch")  # before the model: a bad --out costs nothing
    source, rows = task_rows(args)  # bad lines refused before the model loads
    model = load(args)
    pairs = encode_pairs(model, rows, source.name)
    lines = ProgressLines("patching", 2 * len(pairs), unit="pairs", enabled=not args.no_progress)
    with progress_command("patch"):
        result = patch_more(
            model, pairs, exact=exact, progress=lines.update, estimator=args.estimator, ig_steps=args.ig_steps,
            backups=args.backups,
        )  # fmt: skip
    write_patch(out, result, model, pairs)
    print(result_summary(result))
    return 0


def result_summary(result) -> str:
    """What ``storylens patch`` prints: the metrics and the ten heads of largest effect."""
    return "\n".join(summary_lines(result))
