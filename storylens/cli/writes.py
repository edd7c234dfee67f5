"""``storylens writes``: where heads look against what they write. Every head's write-aware score toward the main
character's name (:mod:`storylens.effects.writes`) beside its attention mass on the name, and the top ``k`` of each
ranking ablated together with the loss on the name (:mod:`storylens.table.write_ablation`): writes.json,
writes.csv, writes.png, writes.svg."""

from __future__ import annotations

from storylens.cli.options import add_model, add_no_progress, add_quiz_stories, load, out_path
from storylens.core.errors import UsageError
from storylens.core.publish import check_target_folder, publish_folder
from storylens.data.names import name_vocabulary
from storylens.engine.encode import encode_stories
from storylens.lesson.inputs import lesson_data
from storylens.lesson.report import _quiz_folder
from storylens.table.write_ablation import compare_writes, describe, write_writes

COMMAND = "writes"
POSITION = 58


def add_parser(sub) -> None:
    p = sub.add_parser(
        COMMAND, help="what heads write toward the name against where they look, and what removing each costs"
    )
    p.add_argument(
        "--k",
        default="1,2,4,8",
        metavar="K,K,...",
        help="how many top heads of each ranking to ablate together, one run each (default 1,2,4,8)",
    )
    p.add_argument(
        "--mode",
        choices=("mean", "zero"),
        default="mean",
        help="replace the heads' outputs by their means (default) or zeros",
    )
    p.add_argument("--out", required=True, help="output folder: writes.json, writes.csv, writes.png, writes.svg")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N quiz stories")
    add_quiz_stories(p)
    add_model(p)
    add_no_progress(p)
    p.set_defaults(func=run)


def _ks(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--k: whole numbers separated by commas, like 1,2,4 (got {text!r})") from None
    if any(k < 1 for k in ks) or len(set(ks)) != len(ks):
        raise UsageError(f"--k: distinct numbers of heads, each 1 or more (got {text!r})")
    return sorted(ks)


def run(args) -> int:
    ks = _ks(args.k)
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit: a whole number of stories, 1 or more (got {args.limit})")
    out = out_path(args.out)
    check_target_folder(out, kind="writes")  # before the model is loaded and the stories run
    lm = load(args)
    if max(ks) > lm.n_layer * lm.n_head:
        raise UsageError(f"--k: {max(ks)} heads asked; {lm.name} has {lm.n_layer * lm.n_head}")
    data = lesson_data(_quiz_folder(lm), args.stories)
    texts = list(data.quiz)[: args.limit]
    stories = encode_stories(lm, texts, name_vocabulary(data.quiz))
    result = compare_writes(lm, stories, ks=ks, mode=args.mode, progress=not args.no_progress)
    with publish_folder(out, "writes") as tmp:
        write_writes(result, lm.name, tmp)
    print("\n".join(describe(result)))
    print(f"written to {out}")
    return 0
