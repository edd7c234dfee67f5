"""The widget's HTML without a browser: self-contained, no network, data safely embedded."""

from __future__ import annotations

import base64
import json
import re
import zlib

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
        # the SVG namespace (exported figures) is a name, never fetched; no other URL
        code = _strip_data(page).replace('"http://www.w3.org/2000/svg"', "")
        assert not URL.search(code), "the page itself names a URL"
        assert not re.search(r"<script[^>]*\bsrc\s*=", code, re.I)
        assert not re.search(r"<link\b", code, re.I)
        assert "@import" not in code and "url(" not in code and "@font-face" not in code
        assert "fetch(" not in code and "XMLHttpRequest" not in code
    css, js = _static("widget.css"), _static("widget.js")
    assert css in w.to_html() and js in w.to_html() and _static("export.js") in w.to_html()  # inlined, not linked
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
    shown = _weights(d)
    n = len(tokens)
    assert shown.shape == (6, 4, n * (n + 1) // 2)  # lower triangles only
    last = shown[4, 2, -n:]  # the last query's row: keys 0..n-1
    assert d["att"]["bits"] == 16 and d["maxError"] == w.max_error == 0.5 / 65535
    assert np.abs(last - att[4, 2, -1]).max() <= w.max_error * (1 + 1e-9)


def _weights(d) -> np.ndarray:
    """The page's embedded weights, decoded as its JavaScript does: base64, inflate, levels."""
    raw = zlib.decompress(base64.b64decode(d["att"]["deflate"]))
    levels = np.frombuffer(raw, dtype="<u2" if d["att"]["bits"] == 16 else "<u1")
    return levels.reshape(d["nBlock"], d["nHead"], -1) / d["att"]["levels"]


def test_every_weight_is_within_half_a_quantisation_step(story_run):
    _, tokens, att, _ = story_run
    rows, cols = np.tril_indices(len(tokens))
    for bits in (16, 8):
        w = AttentionWidget(tokens, att, bits=bits)
        shown = _weights(_payload(w.to_html()))
        err = np.abs(shown - att[:, :, rows, cols]).max()
        # rounding to the nearest of 2**bits - 1 levels: at most half a step (float64 arithmetic)
        assert w.max_error == 0.5 / (2**bits - 1) and err <= w.max_error * (1 + 1e-9), (bits, err)
        assert err > 0.1 * w.max_error  # really quantised at this depth, not more finely
    # past the payload budget the widget falls back to 8 bits, and says so in its data
    assert AttentionWidget(tokens, att, budget=1_000).bits == 8
    assert AttentionWidget(tokens, att).bits == 16
    with pytest.raises(ValueError, match="bits must be 8 or 16"):
        AttentionWidget(tokens, att, bits=12)


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


def test_replay_page_opens_on_the_whole_story_and_draws_its_marks(model):
    from storylens.lm.generate import record_generation
    from storylens.viz import replay_widget

    run = record_generation(model, "Once upon a time, there was a dog named Rex.", 12, seed=4)
    d = _payload(replay_widget(run, model.tokenizer).to_html())
    assert d["replay"] == {"start": run.prompt_len} and d["query"] == len(run.ids) - 1 == len(d["tokens"]) - 1
    # the replay buttons' words are ASCII and their marks drawn paths: no media-control glyph
    # (U+23EE and its kind, missing from many fonts) and no triangle glyph is left in the script
    js = _static("widget.js")
    block = js[js.index("// ---- replay") : js.index("var body = el(")]
    words = re.findall(r'rpButton\("slw-rp-\w+", "\w+", "([^"]*)"', block)
    assert words == ["Prompt", "Back", "Step", "Play", "Whole story"]
    assert all(w.isascii() for w in words)
    assert not re.search(r"\\u2[35][0-9a-f]{2}", block, re.I) and block.isascii()
