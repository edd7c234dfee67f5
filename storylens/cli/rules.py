"""Which options need which: one table, checked in one place (:func:`check_rules`, run by ``main`` before any
command), so an option that would do nothing is refused (exit 2, one line) rather than accepted silently.

An option is *given* where its value differs from its parser's default (a flag set, a number changed). Each rule
names the commands it holds for, the options it is about, what they need and why; ``tests/test_rules.py`` runs
every (command, option) pair of the table both ways. The Python API's own checks (``ScoreOptions`` and the like)
stay where they are for callers who never touch the command line.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

from storylens.core.errors import UsageError


@dataclass(frozen=True)
class Rule:
    """``options`` (given) on ``commands`` need ``needs`` (words), which ``holds(args)`` checks; ``why`` says what
    the options are for. ``asked(args, option)``: whether the rule is about this use of the option (default: the
    option is given; ``--sections`` asks only where it names the causal section)."""

    commands: tuple[str, ...]
    options: tuple[str, ...]
    needs: str
    holds: Callable[[argparse.Namespace], bool]
    why: str
    asked: Callable[[argparse.Namespace, str], bool] | None = None


def _causal(a) -> bool:
    return bool(a.causal)


def _exact_or_causal(a) -> bool:
    return bool(a.exact) or bool(a.causal)


def _names_causal(a, option: str) -> bool:
    return a.sections is not None and "causal" in [n.strip() for n in a.sections.split(",")]


CORPUS_FORM = ("--ablation", "--limit", "--text-field", "--split", "--batch-size", "--chunk-stories", "--resume",
               "--engine")  # fmt: skip

RULES: tuple[Rule, ...] = (
    Rule(("score", "report"), ("--graph-memory",), "--causal", _causal, "the gradient pass's memory"),
    Rule(("score",), ("--audit",), "--causal", _causal, "it audits the causal columns"),
    Rule(("score",), ("--audit-stories",), "--audit", lambda a: bool(a.audit), "the audit's stories"),
    Rule(("score",), ("--exact-stories", "--estimator", "--backups"), "--exact or --causal", _exact_or_causal,
         "each is measured against the exact effect"),
    Rule(("score", "patch"), ("--ig-steps",), "--estimator ig", lambda a: a.estimator == "ig", "its steps"),
    Rule(("circuit",), ("--ig-steps",), "--method eap-ig-inputs or eap-ig-activations",
         lambda a: a.method != "eap", "EAP-IG's steps"),
    Rule(("score", "circuit"), ("--workers", "--address"), "--engine ray", lambda a: a.engine == "ray",
         "Ray's actors and cluster"),
    Rule(("score", "circuit"), ("--device", "--dtype"), "--engine local", lambda a: a.engine != "ray",
         "Ray actors load the model as stored"),
    Rule(("circuit",), CORPUS_FORM, "--stories", lambda a: a.stories is not None, "the corpus form"),
    Rule(("report",), ("--sections",), "--causal", _causal, "the causal section shows its columns", _names_causal),
)  # fmt: skip


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    """The subparser of ``command`` (None: no such command)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None


def given(sub: argparse.ArgumentParser, args: argparse.Namespace, option: str) -> bool:
    """Whether ``option`` of the command ``sub`` parsed differs from its default in ``args``."""
    action = _actions(sub)[option]
    return getattr(args, action.dest, action.default) != action.default


def check_rules(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One UsageError line for the first rule of :data:`RULES` that ``args`` (``parser``'s parse) breaks."""
    sub = command_parser(parser, args.command)
    if sub is None:
        return
    known = _actions(sub)
    for rule in RULES:
        if args.command not in rule.commands:
            continue
        asked = rule.asked or (lambda a, o: given(sub, a, o))
        hit = [o for o in rule.options if o in known and asked(args, o)]
        if hit and not rule.holds(args):
            what = "--sections causal" if rule.asked is _names_causal else " and ".join(hit)
            raise UsageError(f"{what}: only with {rule.needs} ({rule.why})")


_ADDRESS = re.compile(r"^(auto|local|(ray://)?(\[[0-9A-Fa-f:]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5}))$")


def ray_address(text: str) -> str:
    """``--address``: ``auto``, ``local`` or ``[ray://]HOST:PORT`` (a port up to 65535); else argparse's usage
    error (exit 2), before anything runs."""
    m = _ADDRESS.match(text)
    if m is None or (m.group(5) is not None and not 0 < int(m.group(5)) < 65536):
        raise argparse.ArgumentTypeError(f"{text!r}: not a Ray address (auto, local, or [ray://]HOST:PORT)")
    return text
