"""Text that is not text (issue 61, classes 7 and 8): a lone surrogate (valid JSON, a Python str, no UTF-8
encodes it) in any field of a pairs file or in a story, and stories that are not strings given to the Python
API, are refused in one line naming where, on the command line and in Python; a table the next case extends."""

import json

import pytest

from storylens.core.errors import StorylensError

LONE = "\ud800"
GOOD = {"clean": "Lily had a ball. Lily", "corrupt": "Anna had a ball. Lily", "answer": " Lily", "wrong": " Anna"}


@pytest.mark.parametrize("key", sorted(GOOD))
def test_a_pairs_file_with_a_lone_surrogate_is_refused_naming_line_and_field(tmp_path, capsys, key):
    from storylens.cli import main

    path = tmp_path / "pairs.jsonl"
    bad = dict(GOOD, **{key: GOOD[key][:3] + LONE + GOOD[key][3:]})
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")  # \ud800 escaped
    for command in ("patch", "circuit"):
        assert main([command, "--pairs", str(path), "--out", str(tmp_path / command)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"storylens: error: pairs.jsonl:2: {key!r} is not valid Unicode (a lone surrogate, U+D800, "
                       "at character 3)"]  # fmt: skip


STORIES = [  # (stories, the line)
    (["Once upon a time" + LONE], "story 1: not valid Unicode (a lone surrogate, U+D800, at character 16)"),
    (["A story.", None], "story 2: must be text (a str), got NoneType"),
    (["A story.", {"text": "x"}], "story 2: must be text (a str), got dict"),
    ([b"bytes"], "story 1: must be text (a str), got bytes"),
    (["A story.", 7], "story 2: must be text (a str), got int"),
]


@pytest.mark.parametrize("stories,line", STORIES)
def test_the_python_api_refuses_stories_that_are_not_text_in_one_line(shipped_model, stories, line):
    import storylens

    with pytest.raises(StorylensError) as e:
        storylens.score_heads(shipped_model, stories)
    assert str(e.value) == line


def test_a_corpus_with_a_lone_surrogate_is_refused_in_one_line(tmp_path, capsys):
    from storylens.cli import main

    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"text": "A fine story."}) + "\n" + json.dumps({"text": "Bad " + LONE}) + "\n")
    assert main(["score", "--stories", str(path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(": story 2: not valid Unicode (a lone surrogate, U+D800, at character 4)")
