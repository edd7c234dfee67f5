"""Results as pandas data frames, for a notebook: pandas is an optional extra (``storylens[pandas]``).

:func:`to_frame` turns rows (one dict per head, per example, ...) into a ``pandas.DataFrame`` whose
columns have the types ``pandas.read_csv`` gives the same rows written as CSV: whole numbers as
``int64``, numbers with a missing value (None) as ``float64`` with NaN, true/false as ``bool``, text
as pandas's own text type. So a head table's frame equals ``pd.read_csv("heads.csv")`` exactly.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from storylens.core.errors import StorylensError, install_hint


def need_pandas() -> Any:
    """The ``pandas`` module, or one StorylensError line saying how to install it."""
    try:
        return importlib.import_module("pandas")
    except ImportError:
        raise StorylensError(f"needs pandas: {install_hint('pandas')} (or pip install pandas)") from None


def _kind(values: Sequence[object]) -> str | None:
    """The dtype ``read_csv`` gives these values written as CSV ("text": what pandas infers for
    strings, ``object`` before pandas 3 and ``str`` from it; None: leave them as objects)."""
    seen = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not seen:
        return "float64"  # an empty CSV column reads as NaN
    if all(isinstance(v, bool) for v in seen):
        return "bool" if len(seen) == len(values) else None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in seen):
        return "int64" if len(seen) == len(values) else "float64"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in seen):
        return "float64"
    if all(isinstance(v, str) for v in seen) and len(seen) == len(values):
        return "text"
    return None


def to_frame(rows: Sequence[Mapping[str, object]], columns: Sequence[str]):
    """A ``pandas.DataFrame`` of ``rows`` with ``columns`` in that order (a missing cell is None),
    typed as the module docstring says. A list (an example's tokens) stays one cell."""
    pd = need_pandas()
    data = {c: [r.get(c) for r in rows] for c in columns}
    out = {}
    for c, values in data.items():
        kind = _kind(values)
        if kind == "float64":
            values = [math.nan if v is None else float(v) for v in values]  # type: ignore[arg-type]
        dtype = None if kind == "text" else kind or object
        out[c] = pd.Series(values, dtype=dtype, name=c)
    return pd.DataFrame(out, columns=list(columns))
