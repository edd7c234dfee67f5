"""The ``storylens`` command.

Every user-fixable problem is one line on stderr and a non-zero exit; ``--debug``
shows the traceback instead.

One module of this package per command, its parser and its runner together; ``options`` holds
what several commands share. The commands are found, not listed: every module of the package
(but ``_private`` ones) that defines ``add_parser(sub)`` is a command (``rules`` holds which options need which,
checked here before any command runs), and must also define
``COMMAND`` (its name, as typed) and ``POSITION`` (an int, unique: its place in ``storylens
--help``, lowest first). ``add_parser`` adds the command's subparser(s) to ``sub`` and sets
``func``, the runner that takes the parsed arguments and returns the exit code. So a new command
is one new file (and its test), with no edit elsewhere; a command module imports
``storylens.cli.options`` and the layers below, never ``storylens.cli`` itself.

``storylens --help`` lists the commands as a newcomer meets them (``COMMAND_ORDER``): the
lesson's report (10), watching the model write (20), then any corpus and any model (score 30,
ablate 40, patch 50, circuit 55), the checks (60, 70), the data (80), training last (90, 100, 110). A new
command takes a free number where it belongs among them.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from storylens import __version__
from storylens.cli.options import Parser, one_line
from storylens.cli.rules import check_rules
from storylens.core.errors import StorylensError, UsageError
from storylens.core.offline import hub_offline
from storylens.core.publish import replacing_any_kind

DESCRIPTION = (
    "Read the attention heads of Tiny Storyteller (shipped) or any transformers causal LM: where each head "
    "looks, what it moves, attention sinks and dormant heads, and causal effects, over any corpus."
)


def discover(path: Sequence[str], package: str) -> tuple[ModuleType, ...]:
    """The command modules of the package ``package`` (its folders ``path``), in ``POSITION`` order (see
    this package's docstring)."""
    commands = []
    for info in pkgutil.iter_modules(path):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        if not callable(getattr(module, "add_parser", None)):
            continue  # a helper module: options
        name, position = getattr(module, "COMMAND", None), getattr(module, "POSITION", None)
        if not isinstance(name, str) or not isinstance(position, int):
            raise TypeError(f"{module.__name__}: a command module defines COMMAND (str) and POSITION (int)")
        commands.append(module)
    commands.sort(key=lambda m: m.POSITION)
    positions = [m.POSITION for m in commands]
    if len(set(positions)) != len(positions):
        raise ValueError(f"{package}: two commands share a POSITION: {[(m.COMMAND, m.POSITION) for m in commands]}")
    return tuple(commands)


COMMANDS = discover(__path__, __name__)
COMMAND_ORDER = tuple(m.COMMAND for m in COMMANDS)


def build_parser() -> argparse.ArgumentParser:
    """The ``storylens`` parser: global options, then one subparser per command (its ``func``)."""

    p = Parser(prog="storylens", description=DESCRIPTION)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"storylens {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:  # in the order a newcomer meets them: COMMAND_ORDER
        command.add_parser(sub)
    return p


def _debug_everywhere(parser: argparse.ArgumentParser) -> None:
    """``--debug`` works before or after the subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
                _debug_everywhere(sp)  # nested commands too (storylens data download --debug)


PUBLISHED = ("score", "report", "patch", "circuit", "timeline", "export-hf")  # commands writing a published folder


def _force_with_out(parser: argparse.ArgumentParser) -> None:
    """``--force`` on every command that writes an ``--out`` folder: replace a folder another command wrote."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                if name in PUBLISHED:
                    sp.add_argument(
                        "--force",
                        action="store_true",
                        help="replace the output folder even where another storylens command wrote it (never a "
                        "folder holding files of your own)",
                    )


def _out_not_read(args) -> None:
    """Refuse an ``--out`` that is (or holds) the folder ``--model`` or ``--stories`` reads, --force or not."""
    out = getattr(args, "out", None) or getattr(args, "dir", None)
    if not out or args.command not in PUBLISHED or Path(out).name in ("", ".", ".."):
        return  # no folder of its own: refused where the folder is checked
    target = Path(out).resolve()
    for option in ("model", "stories"):
        src = getattr(args, option, None)
        if isinstance(src, str) and src and Path(src).exists():
            read = Path(src).resolve()
            if read == target or target in read.parents:
                raise UsageError(f"{out}: is where --{option} {src} is read from; give another output folder")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    _debug_everywhere(parser)
    _force_with_out(parser)
    args = parser.parse_args(argv)
    # No network unless asked: the Hugging Face clients run offline (no DNS, no socket).
    try:
        check_rules(parser, args)  # which options need which: one table
        _out_not_read(args)
        with hub_offline(not getattr(args, "allow_download", False)), replacing_any_kind(getattr(args, "force", False)):
            return args.func(args)
    except (StorylensError, KeyboardInterrupt, OSError, MemoryError) as e:
        message, code = _describe(e)
        if args.debug:  # the traceback, and the exit code it would have had without --debug
            traceback.print_exc()
        print(f"storylens: {message}", file=sys.stderr)
        return code
    except Exception as e:  # a bug of storylens's (every problem a user can act on is a StorylensError): one line
        if args.debug:
            traceback.print_exc()
        print(
            f"storylens: error: internal error ({type(e).__name__}: {one_line(e)[:300]}); "
            "run again with --debug for the traceback, and please report it",
            file=sys.stderr,
        )
        return 1


def _describe(e: BaseException) -> tuple[str, int]:
    """One line and an exit code for a problem the user can act on: 2 for a usage error (as
    argparse's own), 1 for a problem found while running, 130 when interrupted."""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(e, MemoryError):
        return "error: out of memory", 1
    if isinstance(e, OSError):
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return f"error: {where}{e.strerror or one_line(e)}", 1
    return f"error: {one_line(e)}", 2 if isinstance(e, UsageError) else 1
