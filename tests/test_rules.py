"""Issue 61, class 10: which options need which is one table (storylens.cli.rules.RULES), checked in one place
before any command runs. Every (command, option) pair of the table, both ways: given without what it needs, the
command exits 2 with one line naming the option and what it needs, and nothing runs; given with it, the table
has nothing to say. A malformed --address is argparse's usage error (exit 2), not a failure at run time (1)."""

import pytest

from storylens.cli import build_parser, main
from storylens.cli.rules import RULES, check_rules, command_parser

BASE = {"score": ["--stories", "x.txt", "--out", "o"], "report": ["--out", "r"], "circuit": ["--out", "c"],
        "patch": ["--out", "p"]}  # fmt: skip
VALUE = {"--graph-memory": ["64"], "--audit": ["2"], "--audit-stories": ["3"], "--exact-stories": ["2"],
         "--estimator": ["atp"], "--backups": ["2"], "--ig-steps": ["3"], "--workers": ["3"],
         "--address": ["localhost:6379"], "--device": ["cpu"], "--dtype": ["float64"], "--ablation": ["zero"],
         "--limit": ["5"], "--text-field": ["story"], "--split": ["test"], "--batch-size": ["3"],
         "--chunk-stories": ["5"], "--resume": [], "--engine": ["ray"], "--sections": ["overview,causal"]}  # fmt: skip
MEET = {"--causal": ["--causal"], "--audit": ["--audit", "2", "--causal"], "--exact or --causal": ["--causal"],
        "--estimator ig": ["--estimator", "ig"], "--method eap-ig-inputs or eap-ig-activations": ["--method",
        "eap-ig-activations", "--stories", "x.txt"], "--engine ray": ["--engine", "ray"], "--engine local": [],
        "--stories": ["--stories", "x.txt"]}  # fmt: skip
BREAK = {"--engine local": ["--engine", "ray"]}  # what breaks a rule beside its option (default: nothing)

PAIRS = [(c, o, r) for r in RULES for c in r.commands for o in r.options]


def _argv(command, option, rule, meet):
    argv = [command, *BASE[command], option, *VALUE[option]]
    if meet:
        argv += MEET[rule.needs]
        if command == "score" and rule.needs == "--estimator ig":
            argv += ["--causal"]  # an estimate needs the exact effect beside it: another rule, met here too
        if command == "circuit" and option in ("--workers", "--address", "--device", "--dtype"):
            argv += ["--stories", "x.txt"]
    else:
        argv += BREAK.get(rule.needs, [])
        if command == "circuit" and rule.needs in ("--engine ray", "--engine local"):
            argv += ["--stories", "x.txt"]  # so that the corpus form's rule is not the one broken
    return argv


def test_every_option_of_the_table_exists_on_its_commands():
    parser = build_parser()
    for command, option, _ in PAIRS:
        sub = command_parser(parser, command)
        assert sub is not None and option in {o for a in sub._actions for o in a.option_strings}, (command, option)


@pytest.mark.parametrize("command, option, rule", PAIRS, ids=[f"{c} {o}" for c, o, _ in PAIRS])
def test_an_option_without_what_it_needs_is_refused_and_with_it_accepted(command, option, rule, capsys, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(_argv(command, option, rule, meet=False)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f": only with {rule.needs} ({rule.why})" in err[0], err
    assert (option if option != "--sections" else "--sections causal") in err[0]
    assert list(tmp_path.iterdir()) == []  # nothing ran
    parser = build_parser()
    check_rules(parser, parser.parse_args(_argv(command, option, rule, meet=True)))  # the table has nothing to say


@pytest.mark.parametrize("address", ["foo", "http://host:1", "host:99999", "ray://:10001", "host:port", ""])
def test_a_malformed_address_is_a_usage_error(address, capsys):
    for command in ("score", "circuit"):
        with pytest.raises(SystemExit) as e:
            main([command, *BASE[command], "--stories", "x.txt", "--engine", "ray", "--address", address])
        assert e.value.code == 2 and "not a Ray address" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["auto", "local", "127.0.0.1:6379", "ray://head.example:10001", "[::1]:6379"])
def test_a_well_formed_address_parses(address):
    args = build_parser().parse_args(["score", *BASE["score"], "--engine", "ray", "--address", address])
    assert args.address == address
