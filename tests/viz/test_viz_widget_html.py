"""The widget's HTML without a browser: self-contained, no network, data safely embedded."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from storylens.recording import attention_widget
from storylens.viz import AttentionWidget, toy_widget
from storylens.viz.widget import _static

URL = re.compile(r"https?://", re.I)
EVIL = [
    "<eot>",
    "<script>window.__pwned=1</script>",
    '<img src=x onerror="window.__pwned=2">',
    "</script><script>window.__pwned=3</script>",
    "<!-- a & b -->",
]


def _uniform(T, n_block=2, n_head=3):
    a = np.tril(np.ones((T, T)))
    a /= a.sum(axis=1, keepdims=True)
    return np.broadcast_to(a, (n_block, n_head, T, T)).copy()


def _payload(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="([^"]+)-data">(.*?)</script>', page, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(2))


def _strip_data(page: str) -> str:
    return re.sub(r'<script type="application/json"[^>]*>.*?</script>', "", page, flags=re.S)


def test_no_remote_resources(model, story):
    w = attention_widget(model, story[0])
    for page in (w.to_html(), w._repr_html_(), toy_widget().to_html()):
        code = _strip_data(page)
        assert not URL.search(code), "the page itself names a URL"
        assert not re.search(r"<script[^>]*\bsrc\s*=", code, re.I)
        assert not re.search(r"<link\b", code, re.I)
        assert "@import" not in code and "url(" not in code and "@font-face" not in code
        assert "fetch(" not in code and "XMLHttpRequest" not in code
    css, js = _static("widget.css"), _static("widget.js")
    assert css in w.to_html() and js in w.to_html()  # inlined, not linked
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "document.write" not in js
    assert "default-src 'none'" in w.to_html()  # the standalone page may not fetch anything


def test_data_is_escaped_and_complete(model, story_run):
    _, tokens, att, _ = story_run
    w = AttentionWidget(EVIL, _uniform(len(EVIL)), title="</title><script>window.__pwned=4</script>")
    page = w.to_html()
    assert "<script>window.__pwned" not in page and "</title><script>" not in page
    data_part = page.split('type="application/json"', 1)[1].split("</script>", 1)[0]
    assert "<" not in data_part.split(">", 1)[1]  # no tag can open or close inside the data
    d = _payload(page)
    assert d["tokens"] == EVIL and d["title"].startswith("</title>")

    w = AttentionWidget(tokens, att, block=4, head=2, query=7)
    d = _payload(w.to_html())
    assert (d["nBlock"], d["nHead"], d["block"], d["head"], d["query"]) == (6, 4, 4, 2, 7)
    rows = d["att"][4][2]
    assert [len(r) for r in rows] == list(range(1, len(tokens) + 1))  # lower triangle only
    scale = 10 ** d["decimals"]
    np.testing.assert_allclose(np.array(rows[-1]) / scale, att[4, 2, -1], atol=0.5 / scale + 1e-9)


def test_unique_ids_per_render(story_run):
    _, tokens, att, _ = story_run
    w = AttentionWidget(tokens[:10], att[:, :, :10, :10])
    ids = {re.search(r'class="slw-root" id="([^"]+)"', w._repr_html_()).group(1) for _ in range(5)}
    assert len(ids) == 5


def test_validation_and_save(tmp_path, story_run):
    _, tokens, att, _ = story_run
    with pytest.raises(ValueError):
        AttentionWidget(tokens[:-1], att)
    with pytest.raises(ValueError):
        AttentionWidget(tokens, att, block=6)
    path = AttentionWidget(tokens, att).save(tmp_path / "w" / "widget.html")
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    toy = toy_widget()
    np.testing.assert_allclose(toy.shares().sum(), 1.0)
    assert toy.words[toy.query] == "He" and toy.shares().argmax() == 0  # "He" looks at "Momo"
