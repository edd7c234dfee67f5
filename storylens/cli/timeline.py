"""``storylens timeline``: figures and a page of heads forming over training runs."""

from __future__ import annotations

from storylens.cli.options import out_path
from storylens.core.errors import UsageError
from storylens.training.page import write_timeline_page

COMMAND = "timeline"
POSITION = 100


def add_parser(sub) -> None:
    tl = sub.add_parser(COMMAND, help="figures and a page of heads forming over training runs")
    tl.add_argument("runs", nargs="+", help="training run folders (or their heads_timeline.jsonl, or exported models)")
    tl.add_argument("--out", default="timeline", help="folder for timeline.html and the PNG/SVG figures")
    tl.add_argument("--heads", type=int, default=3, help="strongest heads drawn per detector (default 3)")
    tl.set_defaults(func=run)


def run(args) -> int:
    if args.heads < 1:
        raise UsageError(f"--heads: at least 1 (got {args.heads})")
    out = write_timeline_page(args.runs, out_path(args.out), k=args.heads)
    print(f"head timeline of {len(args.runs)} run(s) written to {out / 'timeline.html'}")
    return 0
