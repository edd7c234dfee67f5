"""A clickable attention viewer as one self-contained HTML view (no network, no CDN).

:class:`AttentionWidget` shows one story's tokens. Click a token (the query) and the
earlier tokens are shaded by the attention that query gives them, for the selected
block and head, or for every head at once as small multiples. :func:`toy_widget`
is the lesson's toy: a few words with hand-set two-number queries and keys (not the
model's), showing score = q·k, the softmax and the resulting shares.

The JavaScript and CSS (``static/widget.js`` and ``static/widget.css``) are inlined
at render time and the data is embedded as JSON, so the HTML works offline, in a
saved file, and in Jupyter, VS Code and Colab output cells. Story text only ever
reaches the page as JSON data and is put into the DOM with ``textContent``.

Attention weights are embedded compactly: every head's lower triangle (query ``q``, keys
``0..q``) quantised to ``bits`` bits (16: ``round(w * 65535)``; 8: ``round(w * 255)``), packed as
one little-endian array, zlib-deflated and base64-encoded; the page inflates it with the
browser's own ``DecompressionStream``. Every shown weight is within half a quantisation step
(:attr:`AttentionWidget.max_error`: 7.6e-6 at 16 bits, 2.0e-3 at 8) of the recorded one. By
default 16 bits, unless that payload would pass :data:`PAYLOAD_BUDGET`; then 8 (a 256-token story
on 24 heads is about 1 MB; 1,024 tokens on 144 heads stays under 30 MB). Each token the selected
query can see carries its shown weight as ``data-weight``; the page root carries ``data-block``,
``data-head``, ``data-query`` and ``data-mode``.

Views of every size: "One head" shades the story, "All heads" shows the query's row for every
head (a block at a time past :data:`ALL_AT_ONCE` heads), and "Maps" draws every head of one block
as a map of a window of tokens, each token labelled. Every view can be saved as PNG and SVG
(``static/export.js``) with the colours and labels shown.
"""

from __future__ import annotations

import base64
import html
import json
import os
import secrets
import zlib
from collections.abc import Sequence
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np

from storylens.viz.tokens import to_numpy_attention, token_texts

__all__ = ["AttentionWidget", "ToyWidget", "replay_widget", "toy_widget", "TOY_WORDS", "TOY_QUERIES", "TOY_KEYS"]

# The toy: "Momo the monkey found a banana. He ate it". Dimension 1 reads roughly
# "is / wants a name", dimension 2 "is / wants a thing". Hand-set, not learned.
TOY_WORDS = ["Momo", "the", "monkey", "found", "a", "banana", ".", "He", "ate", "it"]
TOY_QUERIES = [
    [0.0, 1.0],
    [0.0, 0.5],
    [0.5, 0.0],
    [0.0, 1.0],
    [0.0, 0.5],
    [0.0, 1.0],
    [0.2, 0.2],
    [1.5, 0.0],
    [0.0, 1.2],
    [0.0, 1.5],
]
TOY_KEYS = [
    [2.0, 0.0],
    [0.0, 0.2],
    [1.2, 0.3],
    [0.2, 0.5],
    [0.0, 0.2],
    [0.1, 2.0],
    [0.0, 0.0],
    [1.0, 0.0],
    [0.3, 0.5],
    [0.2, 0.3],
]
TOY_QUERY = 7  # "He": who is "he"?


MODES = ("one", "all", "maps")  # the views a widget opens in: one head, every head's row, maps
ALL_AT_ONCE = 48  # "All heads" shows every head up to this many, else one block at a time
PAYLOAD_BUDGET = 24 * 2**20  # bytes of base64 attention: past it at 16 bits, 8 bits are used


def quantised_triangles(patterns: np.ndarray, bits: int) -> np.ndarray:
    """``[block, head, query, key]`` -> one array of every head's lower triangle (query-major:
    query 0's key 0, query 1's keys 0..1, ...), block-major then head, as ``round(w * levels)``
    with ``levels = 2**bits - 1``, little-endian ``uint8``/``uint16``. Computed a block at a time in
    float64, so the only error is the rounding to the level (at most half a step)."""
    levels = 2**bits - 1
    n_block, n_head, T, _ = patterns.shape
    rows, cols = np.tril_indices(T)
    out = np.empty((n_block, n_head, rows.size), dtype="<u1" if bits == 8 else "<u2")
    for b in range(n_block):
        tri = np.asarray(patterns[b][:, rows, cols], dtype=np.float64)
        out[b] = np.rint(np.clip(tri, 0.0, 1.0) * levels)
    return out.reshape(-1)


def packed(values: np.ndarray) -> str:
    """base64 of the zlib-deflated bytes (what ``StorylensExport.inflate`` reverses)."""
    return base64.b64encode(zlib.compress(values.tobytes(), 6)).decode("ascii")


@cache
def _static(name: str) -> str:
    text = (resources.files("storylens.viz") / "static" / name).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():
        raise RuntimeError(f"static/{name} must not contain a closing script or style tag")
    return text


def page_script() -> str:
    """The JavaScript a report page inlines once: PNG/SVG export (``export.js``) and the page's
    own behaviour (``pages.js``: the head overview and a button pair on every figure)."""
    return _static("export.js") + "\n" + _static("pages.js")


def _json_for_script(data) -> str:
    """JSON that is safe inside ``<script type="application/json">``.

    Every ``<``, ``>`` and ``&`` is written as a ``\\u`` escape, so no story text can
    close the script tag (``</script>``) or open a comment; JSON.parse restores them.
    """
    s = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    s = s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return s.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


class _HtmlView:
    """Shared rendering: a fragment for notebooks, a full page for files."""

    kind = "view"

    def __init__(self, title: str):
        self.title = str(title)

    def data(self) -> dict:  # pragma: no cover - overridden
        raise NotImplementedError

    def _fragment(self, nonce: str | None = None) -> str:
        uid = "slw-" + secrets.token_hex(6)
        n = f' nonce="{nonce}"' if nonce else ""
        payload = _json_for_script({"kind": self.kind, **self.data()})
        boot = (
            "(function(){var go=function(){window.StorylensWidget.mount(" + json.dumps(uid) + ");};"
            "if(document.readyState==='loading'){document.addEventListener('DOMContentLoaded',go);}"
            "else{go();}})();"
        )
        return (
            f"<style{n}>{_static('widget.css')}</style>\n"
            f'<div class="slw-root" id="{uid}" data-slw-kind="{self.kind}">'
            f'<div class="slw-loading">{html.escape(self.title)}: loading the interactive view… '
            "(if this message stays, JavaScript is off here, e.g. an untrusted notebook)</div></div>\n"
            f'<script type="application/json" id="{uid}-data">{payload}</script>\n'
            f"<script{n}>{_static('export.js')}\n{_static('widget.js')}\n{boot}</script>\n"
        )

    def _repr_html_(self) -> str:
        """The view for Jupyter, VS Code and Colab: a fragment with its own unique ids."""
        return self._fragment()

    def to_html(self) -> str:
        """A standalone page. Its Content-Security-Policy forbids every network request."""
        nonce = secrets.token_urlsafe(16)
        csp = (
            "default-src 'none'; "
            f"script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; img-src data:; "
            "font-src 'none'; connect-src 'none'; base-uri 'none'; form-action 'none'"
        )
        return (
            '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f'<title>{html.escape(self.title)}</title>\n</head>\n<body class="slw-page">\n'
            f"{self._fragment(nonce)}</body>\n</html>\n"
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_html` to ``path`` (UTF-8); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_html(), encoding="utf-8")
        return path


class AttentionWidget(_HtmlView):
    """Click a token, see its attention over the earlier tokens.

    ``tokens``: display text per position (see :func:`storylens.viz.tokens.token_texts`).
    ``patterns``: ``[block, head, query, key]`` (array or tensor), or the model's
    ``patterns`` list. ``block``/``head`` (0-indexed) and ``query`` (a position;
    default the last) set what is shown first. ``decimals`` is the precision of the
    embedded weights: 16 or 8 (default: 16 unless that payload would pass ``budget`` bytes,
    :data:`PAYLOAD_BUDGET` unless given). ``mode``: the view it opens in, ``"one"`` (one head
    shading the story), ``"all"`` (the query's row in every head) or ``"maps"`` (every head of the
    block as a map of a window of tokens).
    """

    kind = "attention"

    def __init__(
        self,
        tokens: Sequence[str],
        patterns,
        title: str = "Attention",
        *,
        block: int = 0,
        head: int = 0,
        query: int | None = None,
        bits: int | None = None,
        budget: int = PAYLOAD_BUDGET,
        mode: str = "one",
        replay_start: int | None = None,
    ):
        super().__init__(title)
        patterns = to_numpy_attention(patterns)
        n_block, n_head, T, _ = patterns.shape
        tokens = [str(t) for t in tokens]
        if len(tokens) != T:
            raise ValueError(f"{len(tokens)} tokens but the attention covers {T} positions")
        if T == 0:
            raise ValueError("no tokens")
        if not np.all(np.isfinite(patterns)):
            raise ValueError("attention has non-finite values")
        if not (0 <= block < n_block and 0 <= head < n_head):
            raise ValueError(f"block {block}, head {head} out of range ({n_block} x {n_head})")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        if bits not in (None, 8, 16):
            raise ValueError(f"bits must be 8 or 16, not {bits!r}")
        query = T - 1 if query is None else int(query)
        if not 0 <= query < T:
            raise ValueError(f"query {query} out of range (0..{T - 1})")
        if replay_start is not None and not 1 <= replay_start <= T:
            raise ValueError(f"replay_start {replay_start} out of range (1..{T})")
        self.replay_start = replay_start
        self.tokens = tokens
        self.patterns = patterns
        self.block, self.head, self.query = int(block), int(head), query
        if budget <= 0:
            raise ValueError(f"budget must be positive, not {budget}")
        self._payload: dict | None = None
        self.bits = bits if bits is not None else self._auto_bits(budget)

    def _auto_bits(self, budget: int) -> int:
        """16 bits where that payload fits ``budget`` bytes, else 8. 16-bit levels of real maps
        deflate by at most about 3x (their low bits are noise), so past 4x the budget raw the
        16-bit payload is not even built."""
        n_block, n_head, T, _ = self.patterns.shape
        if 2 * n_block * n_head * T * (T + 1) // 2 > 4 * budget:
            return 8
        self.bits = 16
        return 16 if self._att()["size"] <= budget else 8

    @property
    def max_error(self) -> float:
        """The most a shown weight can differ from the recorded one: half a quantisation step."""
        return 0.5 / (2**self.bits - 1)

    def _att(self) -> dict:
        if self._payload is None or self._payload["bits"] != self.bits:
            b64 = packed(quantised_triangles(self.patterns, self.bits))
            self._payload = {"bits": self.bits, "levels": 2**self.bits - 1, "deflate": b64, "size": len(b64)}
        return self._payload

    @classmethod
    def from_recording(cls, text: str, tokens, patterns, enc, title: str | None = None, **kw) -> AttentionWidget:
        """The widget for what :func:`storylens.recording.story_attention` recorded."""
        if title is None:
            words = text.split()
            title = " ".join(words[:8]) + (" …" if len(words) > 8 else "")
            title = f"Attention: “{title}”"
            if enc.cut:
                title += f" (first {len(enc.ids)} of {enc.full_length} tokens)"
        return cls(tokens, patterns, title=title, **kw)

    def data(self) -> dict:
        n_block, n_head, T, _ = self.patterns.shape
        att = self._att()
        return {
            "title": self.title,
            "tokens": self.tokens,
            "nBlock": n_block,
            "nHead": n_head,
            # every head's lower triangle, quantised (see quantised_triangles), deflated, base64
            "att": {k: att[k] for k in ("bits", "levels", "deflate")},
            "maxError": self.max_error,
            "allAtOnce": ALL_AT_ONCE,
            "mode": self.mode,
            "block": self.block,
            "head": self.head,
            "query": self.query,
            # a generated story: tokens from replay_start on were written by the model, and the
            # page can replay them one by one (each with the row recorded while it was read)
            "replay": None if self.replay_start is None else {"start": self.replay_start},
        }


def replay_widget(run, tok, title: str | None = None, **kw) -> AttentionWidget:
    """The generated story of ``run`` (:class:`storylens.lm.generate.RecordedGeneration`) as a
    widget that replays the writing token by token: press Play, or step, and each new token
    appears with the attention it gave while the model read it."""

    tokens = token_texts(tok, run.ids)
    if title is None:
        n_new = len(run.ids) - run.prompt_len
        title = f"Watch it write: {n_new} new tokens after a {run.prompt_len}-token prompt"
    return AttentionWidget(tokens, run.patterns, title=title, replay_start=run.prompt_len, **kw)


class ToyWidget(_HtmlView):
    """The lesson's toy: hand-set two-number queries and keys, score = q·k, softmax, shares."""

    kind = "toy"

    def __init__(self, words, queries, keys, query: int, title: str):
        super().__init__(title)
        words = [str(w) for w in words]
        qs = np.asarray(queries, dtype=float)
        ks = np.asarray(keys, dtype=float)
        n = len(words)
        if n == 0 or qs.shape != ks.shape or qs.shape[0] != n or qs.ndim != 2:
            raise ValueError("need one query and one key vector (same length) per word")
        if not 0 <= query < n:
            raise ValueError(f"query {query} out of range (0..{n - 1})")
        self.words, self.queries, self.keys, self.query = words, qs, ks, int(query)

    def shares(self, query: int | None = None) -> np.ndarray:
        """The toy's attention shares for one query (what the page shows)."""
        i = self.query if query is None else query
        scores = self.keys[: i + 1] @ self.queries[i]
        e = np.exp(scores - scores.max())
        return e / e.sum()

    def data(self) -> dict:
        return {
            "title": self.title,
            "words": self.words,
            "q": self.queries.tolist(),
            "k": self.keys.tolist(),
            "query": self.query,
        }


def toy_widget(
    words: Sequence[str] | None = None,
    queries=None,
    keys=None,
    *,
    query: int | None = None,
    title: str = "Toy attention: hand-set queries and keys (not the model's weights)",
) -> ToyWidget:
    """The toy view. Default: "Momo the monkey found a banana. He ate it", query "He".

    ``queries`` and ``keys`` are one small vector per word (two numbers each in the
    lesson). In the page the selected word's query and every key are editable.
    """
    if words is None:
        words, queries, keys = TOY_WORDS, TOY_QUERIES, TOY_KEYS
        query = TOY_QUERY if query is None else query
    elif queries is None or keys is None:
        raise ValueError("give queries and keys along with words")
    query = len(words) - 1 if query is None else query
    return ToyWidget(words, queries, keys, query, title)
