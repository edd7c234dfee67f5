"""``storylens why``: why a head looks where it looks, its attention score split into (query-side writer, key-side
writer) terms over stories (:mod:`storylens.looking.why`): why.json, why.csv, why.html."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from storylens.cli.options import add_model, add_no_progress, add_quiz_stories, load, out_path
from storylens.core.errors import UsageError
from storylens.core.heads import Head, parse_head_label
from storylens.core.publish import check_target_folder, publish_folder
from storylens.data.names import name_vocabulary
from storylens.engine.encode import encode_stories
from storylens.lesson.inputs import lesson_data
from storylens.lesson.report import _quiz_folder
from storylens.looking.why import POSITIONS, explain, read_pairs_at, write_why
from storylens.viz.why import sentence

COMMAND = "why"
POSITION = 57


def add_parser(sub) -> None:
    p = sub.add_parser(COMMAND, help="why a head looks where it looks: its score split into writer x writer terms")
    p.add_argument(
        "--head", required=True, metavar="LxHy", help="the head, as the lesson labels it (L4H2: block 4, head 2)"
    )
    pairs = "name (queries after the first mention, the name tokens; default), prev (key q - 1), first (key 0), "
    pairs += "induction (the token after an earlier copy), custom (the pairs --at names)"
    p.add_argument("--positions", choices=POSITIONS, default="name", help=f"the (query, key) pairs to explain: {pairs}")
    p.add_argument(
        "--at",
        default=None,
        metavar="FILE",
        help='with --positions custom: a JSON lines file, {"story": N, "query": Q, "key": K} a line (quiz story N '
        "from 1; token positions from 0 at the opening marker; 0 <= K <= Q)",
    )
    p.add_argument("--out", required=True, help="output folder: why.json, why.csv, why.html")
    p.add_argument(
        "--explorer",
        default=None,
        metavar="HREF",
        help="the address, from the output folder, of a score or report run's explore.html: each writer head in "
        "why.html links to its page there (e.g. ../scored/explore.html)",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N quiz stories")
    add_quiz_stories(p)
    add_model(p)
    add_no_progress(p)
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        head = Head(*parse_head_label(args.head))
    except ValueError as e:
        raise UsageError(f"--head: {e}") from None
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit: a whole number of stories, 1 or more (got {args.limit})")
    if (args.positions == "custom") != (args.at is not None):
        raise UsageError("--at FILE and --positions custom go together")
    at = read_pairs_at(Path(args.at)) if args.at is not None else None  # a bad line refused before the model loads
    out = out_path(args.out)
    check_target_folder(out, kind="why")  # before the model is loaded and the stories run
    lm = load(args)
    data = lesson_data(_quiz_folder(lm), args.stories)
    texts = list(data.quiz)[: args.limit]
    stories = encode_stories(lm, texts, name_vocabulary(data.quiz))
    if at is not None and max(at) >= len(stories):
        raise UsageError(f"--at: story {max(at) + 1} asked; {len(stories)} quiz stories are read")
    with tqdm(
        total=len(stories), unit="story", desc=f"why {head.label}", disable=None if not args.no_progress else True
    ) as bar:
        result = explain(lm, head, stories, args.positions, progress=lambda s: bar.update(1), at=at)
    with publish_folder(out, "why") as tmp:
        doc = write_why(result, lm.name, tmp, explorer=args.explorer)
    print(
        f"{doc['head']}: {doc['positions']} keys score {result.total:+.3f} above the average key ({result.stories} stories)"
    )
    for t in doc["top"][:3]:
        print("  " + sentence(doc, t))
    print(f"written to {out}")
    return 0
