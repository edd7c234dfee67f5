"""``patch.html``: every head's patching effect as a block x head grid (exact and AtP side by
side); a click on a head shows its attention on a pair, clean and corrupt.

One self-contained page (jinja2 template ``templates/patch.html.j2``): the data sits in a
``<script type="application/json">`` with ``<``, ``>`` and ``&`` escaped, the scripts are inlined
under a Content-Security-Policy that forbids every network request, and every picture saves as
PNG or SVG through ``static/export.js`` as in the other views.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

import jinja2

from storylens.viz.widget import _json_for_script, _static

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("storylens.viz", "templates"), autoescape=True, keep_trailing_newline=True
)


def patch_html(result: Mapping, pairs: Sequence[Mapping], *, title: str, verdict: str = "") -> str:
    """The page for a ``PatchResult`` as a dict (``result``) and :func:`pair_patterns`' pairs; ``verdict``,
    whether the model does the task, said first."""
    nonce = secrets.token_urlsafe(16)
    return _ENV.get_template("patch.html.j2").render(
        title=title,
        verdict=verdict,
        nonce=nonce,
        data=_json_for_script({"result": dict(result), "pairs": list(pairs)}),
        export_js=_static("export.js"),
        patch_js=_static("patch.js"),
    )
