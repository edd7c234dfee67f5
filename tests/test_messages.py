"""Error lines say what is wrong, in the same shape everywhere (issue 61, class 11): every line starts
"storylens: error:", argparse's included; a table the next message extends."""

import json

import pytest

CASES = [  # (argv, the line's text after "storylens: error: ")
    (["report", "--sections", "", "--out", "r"], "--sections: no section given; choose from"),
    (["report", "--sections", "foo", "--out", "r"], "--sections: 'foo' is not a section; choose from"),
    (["report", "--sections", "foo,bar", "--out", "r"], "--sections: 'foo', 'bar' are not a section"),
    (["score", "--stories", "x", "--out", "o", "--audit-stories", "3"], "--audit-stories: only with --audit"),
    (["score", "--stories", "x", "--out", "o", "--bogus"], "unrecognized arguments: --bogus"),
    (["score"], "the following arguments are required: --stories, --out (see storylens score --help)"),
    (["circuit", "--out", "o", "--ig-steps", "x"], "argument --ig-steps: invalid int value: 'x'"),
    # an option that would do nothing is refused, not accepted silently (class 10)
    (["score", "--stories", "x", "--out", "o", "--graph-memory", "64"], "--graph-memory: only with --causal"),
    (["report", "--out", "r", "--graph-memory", "0"], "--graph-memory: only with --causal"),
    (["report", "--out", "r", "--sections", "overview,causal"], "--sections causal: only with --causal"),
]


def test_debug_shows_the_traceback_and_keeps_the_exit_code(capsys, tmp_path, monkeypatch):
    """--debug adds the traceback; a usage error still exits 2 (it exited 1 with --debug before)."""
    from storylens.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["--debug", "score", "--stories", "x", "--out", "o", "--graph-memory", "64"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("storylens: error: --graph-memory")


@pytest.mark.parametrize("argv,said", CASES)
def test_every_error_line_starts_alike_and_names_the_problem(argv, said, capsys, tmp_path, monkeypatch):
    from storylens.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("storylens: error: ") and said in err[0], err


def test_a_bare_model_name_says_how_to_fetch_it(capsys, tmp_path, monkeypatch):
    from storylens.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["perplexity", "--model", "gpt2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("storylens: error: gpt2: no such model folder") and "--allow-download" in err


@pytest.mark.parametrize("version,said", [("1", "must be the number 1 (got '1')"), (True, "must be the number 1 (got True)"), (1.0, "must be the number 1 (got 1.0)"),
                                          (2, "schema_version 2, but this storylens reads version 1")])  # fmt: skip
def test_a_schema_version_of_the_wrong_kind_is_named_as_such(tmp_path, version, said):
    from storylens import load_circuit
    from storylens.core.errors import StorylensError

    path = tmp_path / "circuit.json"
    path.write_text(json.dumps({"schema_version": version}))
    with pytest.raises(StorylensError, match=said.replace("(", r"\(").replace(")", r"\)")):
        load_circuit(path)


def test_an_internal_error_is_one_line_and_debug_shows_its_traceback(monkeypatch, capsys):
    """A bug of storylens's own (any exception that is not a StorylensError) is one line naming it, exit 1; with
    --debug, the traceback too."""
    import storylens.cli.perplexity as command
    from storylens.cli import main

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(command, "run", broken)  # main builds its parser each call: the patched runner is bound
    code = main(["perplexity"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("storylens: error: internal error (KeyError: "), err
    assert main(["--debug", "perplexity"]) == 1 and "Traceback" in capsys.readouterr().err
