"""The command line: real generation, and one-line errors for bad input."""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from storylens.cli import main
from storylens.data.stories import EOT
from storylens.model.hub import SHIPPED_MODEL


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_generate_streams_a_story_from_the_shipped_model():
    r = subprocess.run(
        [sys.executable, "-m", "storylens", "generate", "Once upon a time", "--max-new-tokens", "40", "--seed", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout.startswith("Once upon a time")
    assert len(r.stdout.split()) > 8
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "storylens",
            "generate",
            "Once upon a time",
            "--max-new-tokens",
            "40",
            "--seed",
            "3",
            "--no-cache",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert again.stdout == r.stdout  # the KV cache changes the cost, not the story


def test_empty_prompt(capsys):
    assert "prompt: empty" in _err(capsys, ["generate", "   "])


def test_prompt_past_the_window(capsys):
    assert "256-token window" in _err(capsys, ["generate", "Once", "--max-new-tokens", "300"])


def test_bad_corpus_files(capsys, tmp_path):
    assert "stories file not found" in _err(capsys, ["perplexity", "--stories", str(tmp_path / "none.gz")])
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(b"Once upon a time\n" * 100)[:40])
    assert "bad.gz: corrupt gzip" in _err(capsys, ["perplexity", "--stories", str(bad)])
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Zoë.\n<|endoftext|>\n".encode("latin-1"))
    assert "latin.txt: not UTF-8" in _err(capsys, ["perplexity", "--stories", str(latin)])
    few = tmp_path / "few.txt"
    few.write_text("".join(f"Tale {i}.\n{EOT}\n" for i in range(150)))
    assert "150 stories" in _err(capsys, ["perplexity", "--stories", str(few)])


def test_bad_model_folders(capsys, tmp_path):
    m = tmp_path / "m"
    shutil.copytree(SHIPPED_MODEL, m)
    w = m / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    assert "corrupt or truncated weights" in _err(capsys, ["generate", "Hi", "--model", str(m)])
    w.unlink()
    assert "weights file missing" in _err(capsys, ["generate", "Hi", "--model", str(m)])
    shutil.copy(SHIPPED_MODEL / "model.safetensors", w)
    (m / "config.json").write_text(json.dumps({"n_layer": 4}))
    assert "holds 6 blocks but config.json says n_layer=4" in _err(capsys, ["generate", "Hi", "--model", str(m)])
    (m / "config.json").write_text("{not json")
    assert "config.json: not a valid model config" in _err(capsys, ["generate", "Hi", "--model", str(m)])


def test_debug_shows_the_traceback(capsys):
    code = main(["--debug", "generate", ""])
    err = capsys.readouterr().err
    assert (
        code in (1, 2)
        and "Traceback (most recent call last)" in err
        and err.strip().splitlines()[-1].startswith("storylens: error:")
    )


def test_ablate_rejects_bad_head_labels(capsys):
    assert "--heads: not a head label" in _err(capsys, ["ablate", "--heads", "banana"])
    assert "L9H9" in _err(capsys, ["ablate", "--heads", "L9H9", "--mode", "zero"])


DTYPES = ("float32", "float64")


def test_check_prints_the_learners_own_numbers(capsys, tmp_path):
    out = tmp_path / "check.json"
    assert main(["check", "--n-stories", "6", "--gen-tokens", "30", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fused vs explicit logits" in text and "float64" in text
    assert "cache 30 vs recompute 465" in text  # 1 + 2 + ... + 30
    data = json.loads(out.read_text())
    checks = {(c["name"], c["dtype"]): c for c in data["checks"]}
    assert len(checks) == 14 and all(c["passed"] for c in checks.values())
    f64 = checks[("fused vs explicit logits", "float64")]
    assert 0 < f64["measured"] <= f64["bound"] < 1e-10
    assert checks[("upper triangle is exactly 0", "float32")]["measured"] == 0.0
    # beside each of the lesson's figures: why our bound is larger (float32) or smaller (float64)
    noted = {k: c["lesson_note"] for k, c in checks.items() if c["lesson"] is not None}
    assert set(noted) == {(n, d) for n in ("fused vs explicit logits", "KV cache vs recompute logits") for d in DTYPES}
    for (name, dtype), note in noted.items():
        c = checks[(name, dtype)]
        assert c["bound"] > c["lesson"] if dtype == "float32" else c["bound"] < c["lesson"]
        why = "derived for float32 rounding" if dtype == "float32" else "float64 rounds 2^29 times finer"
        assert note.startswith(f"bound {'above' if dtype == 'float32' else 'below'} the lesson's") and why in note
        assert f"measured here {c['measured']:.1e}: " in note and f"  {name} ({dtype}): {note}\n" in text
        assert ("within the lesson's figure too" in note) == (c["measured"] <= c["lesson"])
    assert all(c["lesson_note"] == "" for c in checks.values() if c["lesson"] is None)


def test_version_and_help_on_every_option(capsys):
    import argparse

    from storylens import __version__
    from storylens.cli import build_parser

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"storylens {__version__}"
    missing = []

    def walk(parser, name):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    walk(sp, f"{name} {sub}")
            elif not a.help:
                missing.append(f"{name} {a.dest}")

    walk(build_parser(), "storylens")
    assert missing == []


def _command_paths(parser, path=()):
    """Every command of ``parser``, found in the parser itself: () for the top level, ("report",),
    ("data", "download"), ..."""
    import argparse

    yield path
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _command_paths(sp, (*path, name))


def test_help_works_for_every_command(capsys):
    """--help and -h print the usage and exit 0 for the top level and every subcommand, nested
    ones included (a % in a help text once made argparse crash on report --help)."""
    from storylens.cli import build_parser

    paths = list(_command_paths(build_parser()))
    assert ("report",) in paths and ("data", "download") in paths and () in paths
    for path in paths:
        for flag in ("--help", "-h"):
            with pytest.raises(SystemExit) as e:
                main([*path, flag])
            captured = capsys.readouterr()
            assert e.value.code == 0, (path, flag, captured.err)
            assert captured.out.startswith(f"usage: {' '.join(('storylens', *path))} "), (path, flag)
            assert "options:" in captured.out and "Traceback" not in captured.err


def test_help_lists_the_commands_in_a_newcomers_order(capsys):
    """`storylens --help` names every command once, in COMMAND_ORDER (the report first, training last),
    and says what storylens reads now: any transformers causal LM, sinks, causal effects."""
    from storylens.cli import COMMAND_ORDER, build_parser

    commands = [p[0] for p in _command_paths(build_parser()) if len(p) == 1]
    assert set(commands) <= set(COMMAND_ORDER), set(commands) - set(COMMAND_ORDER)
    assert commands == [c for c in COMMAND_ORDER if c in commands]
    assert commands[0] == "report" and commands[-1] == "export-hf"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    section = out.split("positional arguments:")[1].split("options:")[0]
    listed = [line.split()[0] for line in section.splitlines() if line.strip()]
    assert [c for c in listed if c in commands] == commands  # the help text itself, in that order
    assert all(w in " ".join(out.split()) for w in ("any transformers causal LM", "sinks", "causal effects"))
    tomllib = pytest.importorskip("tomllib")  # the package's metadata says the same (Python 3.11+)
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert all(w in project["description"] for w in ("any transformers causal LM", "sinks", "causal effects"))
    assert {"attention sinks", "attribution patching"} <= set(project["keywords"]) and project["classifiers"]


def test_record_and_html_go_together(capsys, tmp_path):
    assert main(["generate", "Once", "--html", str(tmp_path / "x.html")]) == 2
    assert (
        capsys.readouterr().err
        == "storylens: error: --html: needs --record (the page replays the recorded attention)\n"
    )
    assert main(["generate", "Once", "--record"]) == 2
    assert capsys.readouterr().err == "storylens: error: --record: give --html FILE to write the replay page\n"
    assert not (tmp_path / "x.html").exists()


def test_a_new_command_is_one_file(tmp_path, monkeypatch):
    """The entry point finds its commands: a module that defines COMMAND, POSITION and add_parser is one,
    in POSITION order, with no list to edit; a helper module is not; two commands at one POSITION, or a
    command without its COMMAND, are refused."""
    from storylens.cli import COMMAND_ORDER, COMMANDS, discover

    pkg = tmp_path / "probe_cli"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    command = "COMMAND = {name!r}\nPOSITION = {pos}\n\ndef add_parser(sub):\n    sub.add_parser(COMMAND)\n"
    (pkg / "later.py").write_text(command.format(name="later", pos=20))
    (pkg / "first.py").write_text(command.format(name="first", pos=10))
    (pkg / "helpers.py").write_text("SHARED = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [m.COMMAND for m in discover([str(pkg)], "probe_cli")] == ["first", "later"]
    (pkg / "clash.py").write_text(command.format(name="clash", pos=10))
    with pytest.raises(ValueError, match="two commands share a POSITION"):
        discover([str(pkg)], "probe_cli")
    (pkg / "clash.py").unlink()
    (pkg / "nameless.py").write_text("POSITION = 30\n\ndef add_parser(sub):\n    pass\n")
    with pytest.raises(TypeError, match="defines COMMAND"):
        discover([str(pkg)], "probe_cli")
    assert COMMAND_ORDER == tuple(m.COMMAND for m in COMMANDS) and len(COMMANDS) == 14
