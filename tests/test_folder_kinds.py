"""A folder one storylens command wrote is never replaced by another (issue 61, class 1): every published kind
against every other, through the check every command makes before it loads anything and again under the lock;
``--force`` replaces a storylens folder of another kind (never a folder holding the user's own files); and the
folder a command reads its model or stories from is never its ``--out``, ``--force`` or not."""

import pytest

from storylens.core.errors import StorylensError
from storylens.core.publish import check_target_folder, publish_folder, replacing_any_kind

KINDS = ("score", "report", "patch", "circuit", "timeline", "storylens model folder",
         "transformers GPT2LMHeadModel export")  # fmt: skip
COMMANDS = ("score", "report", "patch", "circuit", "timeline", "transformers GPT2LMHeadModel export")


def _published(folder, kind):
    with publish_folder(folder, kind) as tmp:
        (tmp / "made.txt").write_text(kind)
    return folder


@pytest.mark.parametrize("kind", KINDS)
def test_every_command_refuses_a_folder_of_another_kind_and_keeps_it(tmp_path, kind):
    folder = _published(tmp_path / "f", kind)
    for command in COMMANDS:
        if command == kind:
            check_target_folder(folder, kind=command)  # its own kind: replaced as before
            continue
        with pytest.raises(StorylensError, match=f"holds a {kind} that storylens wrote, not a {command}"):
            check_target_folder(folder, kind=command)
        with pytest.raises(StorylensError, match="--force"):
            with publish_folder(folder, command) as tmp:
                (tmp / "new.txt").write_text("x")
        assert (folder / "made.txt").read_text() == kind  # nothing touched
        with replacing_any_kind():
            check_target_folder(folder, kind=command)


def test_force_replaces_a_storylens_folder_of_another_kind_but_never_the_users_files(tmp_path):
    folder = _published(tmp_path / "f", "score")
    with replacing_any_kind(), publish_folder(folder, "patch") as tmp:
        (tmp / "patch.json").write_text("{}")
    assert sorted(p.name for p in folder.iterdir()) == [".storylens.json", "patch.json"]
    (folder / "mine.txt").write_text("the user's")
    with replacing_any_kind(), pytest.raises(StorylensError, match="did not write"):
        check_target_folder(folder, kind="score")


def test_the_command_line_refuses_in_one_line_and_never_writes_over_what_it_reads(tmp_path, capsys):
    from storylens.cli import main

    score_run = _published(tmp_path / "run", "score")
    assert main(["patch", "--out", str(score_run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a patch" in err[0] and "--force" in err[0]
    assert (score_run / "made.txt").read_text() == "score"
    model = _published(tmp_path / "exp", "transformers GPT2LMHeadModel export")
    for extra in ([], ["--force"]):
        argv = ["score", "--model", str(model), "--stories", "x.txt", "--out", str(model), *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is where --model" in err[0]
    assert main(["circuit", "--stories", str(model / "made.txt"), "--out", str(model), "--force"]) == 2
    assert "is where --stories" in capsys.readouterr().err
    assert main(["export-hf", str(model), "--model", str(model), "--force"]) == 2
    assert "is where --model" in capsys.readouterr().err
    assert (model / "made.txt").exists()
