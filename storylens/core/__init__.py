"""What every wing may use: errors, the ``Head`` type and its labels, outputs published whole,
progress lines, work beside the main process, the hub kept offline. Imports nothing of storylens."""

from storylens.core.errors import StorylensError, UsageError
from storylens.core.heads import Head, head_label, parse_head_label

__all__ = ["Head", "StorylensError", "UsageError", "head_label", "parse_head_label"]
