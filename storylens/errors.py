"""One exception type for every problem a user can fix (bad file, bad option).

The CLI prints these as a single line and exits non-zero; ``--debug`` shows the traceback.
"""


class StorylensError(Exception):
    """A problem with the user's input: the message names the file and the problem."""
