"""``storylens data``: the TinyStories corpus (``storylens data download``)."""

from __future__ import annotations

from storylens.cli.options import Parser
from storylens.data.stories import download_tinystories

COMMAND = "data"
POSITION = 80


def add_parser(sub) -> None:
    dd = sub.add_parser(COMMAND, help="the TinyStories corpus: storylens data download")
    dsub = dd.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    dl = dsub.add_parser("download", help="fetch TinyStories from the Hugging Face Hub into the user cache")
    dl.add_argument(
        "--split",
        choices=["train", "valid"],
        default="train",
        help="train (1.9 GB, what the lesson trains on) or valid (19 MB); default train",
    )
    dl.set_defaults(func=run_download, allow_download=True)


def run_download(args) -> int:
    path = download_tinystories(args.split)
    print(f"TinyStories {args.split} split: {path}")
    print(
        f"use it with --stories tinystories{'-valid' if args.split == 'valid' else ''} "
        f"(e.g. storylens train --stories tinystories --first 20000, the lesson's recipe)"
    )
    return 0
