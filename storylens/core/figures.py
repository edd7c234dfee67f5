"""Figures people read: a number that could not be measured (an error from one sample, a mean of nothing) is NaN
in memory, null in JSON and an empty cell in CSV, never ``nan`` and never ``± 0.000``; and a sign is claimed only
where the figure is beyond two standard errors of zero with a known error. One rule, used by every writer and
every printed, drawn or rendered figure (the pages apply the same rule in their own JavaScript)."""

from __future__ import annotations

import math


def known(x: float | None) -> bool:
    """Whether ``x`` is a measured number (not None, NaN or infinite)."""
    return x is not None and math.isfinite(x)


def sign_claimed(x: float | None, se: float | None) -> bool:
    """Whether ``x``'s sign can be stated: both known and ``|x| > 2 se``."""
    return known(x) and known(se) and abs(x) > 2 * se  # type: ignore[operator,arg-type]


def plus_minus(x: float, se: float | None, digits: int = 3, one: str = "sample") -> str:
    """``+0.123 ± 0.045``, or ``+0.123 (no error: one sample)`` where the error is not known; empty for no ``x``."""
    if not known(x):
        return ""
    return f"{x:+.{digits}f} ± {se:.{digits}f}" if known(se) else f"{x:+.{digits}f} (no error: one {one})"


def bracketed(x: float, se: float | None, digits: int = 3, one: str = "sample") -> str:
    """:func:`plus_minus` in brackets where no sign is claimed: ``(+0.012 ± 0.040)`` within two errors,
    ``(+0.012, no error)`` with none; empty for no ``x``."""
    if not known(x):
        return ""
    if not known(se):
        return f"({x:+.{digits}f}, no error)"
    text = plus_minus(x, se, digits, one)
    return text if sign_claimed(x, se) else f"({text})"


def csv_cell(v: object) -> str:
    """A CSV cell: empty for None and for a number not measured, floats to 9 significant digits."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    return f"{v:.9g}" if isinstance(v, float) else str(v)
