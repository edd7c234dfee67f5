"""The one helper the bad-input tests share: run the CLI in-process, return its one stderr line."""

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
