"""The helpers the bad-input tests share: run the CLI in-process, return its one stderr line; check that a command's
--out refuses a folder another command wrote."""

from storylens.cli import main


def one_line(capture, argv, code=1) -> str:
    """``main(argv)`` must exit ``code`` (1: a problem found while running; 2: a usage error) with a
    single line on stderr and no traceback; that line. ``capture``: pytest's ``capsys``, or
    ``capfd`` where libraries write to the file descriptor (transformers' logging)."""
    got = main(argv)
    err = capture.readouterr().err
    assert got == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def refuses_others_folders(capture, tmp_path, quiz, argv) -> None:
    """``argv + ["--out", folder]`` is refused in one line, the folder left as it was, for a score run's folder
    (scored from two of the ``quiz`` stories) and for the shipped model's folder being read."""
    from storylens.data.stories import EOT
    from storylens.model.hub import SHIPPED_MODEL

    source = tmp_path / "s.txt"
    source.write_text("".join(f"{s}\n{EOT}\n" for s in quiz[:2]))
    scored = tmp_path / "scored"
    assert main(["score", "--stories", str(source), "--out", str(scored), "--no-progress"]) == 0
    for target in (scored, SHIPPED_MODEL):
        before = sorted(p.name for p in target.iterdir())
        capture.readouterr()
        assert one_line(capture, [*argv, "--out", str(target)]).startswith("storylens: error: ")
        assert sorted(p.name for p in target.iterdir()) == before
