"""``storylens export-hf``: export a storylens model to a transformers GPT2LMHeadModel folder."""

from __future__ import annotations

from storylens.cli.options import add_model, load_native, out_path
from storylens.model.hub import export_hf

COMMAND = "export-hf"
POSITION = 110


def add_parser(sub) -> None:
    e = sub.add_parser(COMMAND, help="export to a transformers GPT2LMHeadModel folder")
    e.add_argument("dir", help="the folder to write (new, empty, or an earlier export)")
    add_model(e)
    e.set_defaults(func=run)


def run(args) -> int:
    model = load_native(args, "export-hf")
    folder = export_hf(model, out_path(args.dir, "dir"))
    print(f"transformers GPT2LMHeadModel written to {folder}")
    return 0
