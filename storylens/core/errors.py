"""The exceptions for every problem a user can fix (bad file, bad option).

The CLI prints these as a single line and exits non-zero; ``--debug`` shows the traceback.
Exit codes follow the Unix convention: 2 for a usage error (an option or argument that is
wrong on its face: :class:`UsageError`), 1 for any other problem found while running
(:class:`StorylensError`: a bad file, a model that is not what it claims), 130 when interrupted.
"""

from importlib.metadata import PackageNotFoundError, metadata


class StorylensError(Exception):
    """A problem with the user's input: the message names the file and the problem (exit 1)."""


class UsageError(StorylensError):
    """An option or argument that is wrong on its face, found before any work (exit 2)."""


def install_hint(extra: str) -> str:
    """How to install storylens with an optional extra (``hf``, ``ray``): from the project's own
    repository, whose address lives in one place, pyproject's ``[project.urls]`` (storylens is not
    on PyPI, and a package of that name there would not be this one)."""
    try:
        urls = metadata("storylens").get_all("Project-URL") or []
    except PackageNotFoundError:
        urls = []
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "repository" and url.strip():
            return f"pip install 'storylens[{extra}] @ git+{url.strip()}'"
    return f"install storylens with its [{extra}] extra from its repository"
