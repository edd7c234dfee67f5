"""The widget in a real headless browser (Debian's chromium, driven by playwright).

Setup: see BROWSER_SETUP.md beside this file. Skipped, with the reason, when
playwright or chromium is missing, unless STORYLENS_REQUIRE_BROWSER=1 (then it fails).
"""

from __future__ import annotations

import numpy as np
import pytest

from storylens.core.heads import head_label
from storylens.recording import attention_widget
from storylens.viz import AttentionWidget, toy_widget

TOL = 0.5 / 65535 * (1 + 1e-9)  # the widget embeds 16 bits: within half a step of the model's weights


def _open(pg, path):
    pg.goto(path.as_uri())
    pg.wait_for_selector('.slw-root[data-slw-ready="1"]', timeout=20_000)


def _shown_weights(pg, selector=".slw-tokens .slw-tok[data-weight]"):
    return pg.eval_on_selector_all(
        selector,
        "els => els.map(e => [parseInt(e.dataset.pos, 10), parseFloat(e.dataset.weight)])",
    )


def test_clicked_token_shows_the_model_row(page, model, story, story_run, tmp_path):
    ids, tokens, att, _ = story_run
    T = len(ids)
    path = attention_widget(model, story[0]).save(tmp_path / "story.html")
    _open(page, path)
    assert page.locator(".slw-tokens .slw-tok").count() == T

    b, h, q = 4, 2, min(T - 1, 57)
    page.click(f'.slw-tokens .slw-tok[data-pos="{q}"]')
    page.select_option(".slw-block", str(b))
    page.select_option(".slw-head", str(h))
    root = page.locator(".slw-root")
    assert (root.get_attribute("data-block"), root.get_attribute("data-head"), root.get_attribute("data-query")) == (
        str(b),
        str(h),
        str(q),
    )
    assert page.text_content(".slw-badge") == head_label(b, h)

    shown = _shown_weights(page)
    assert [p for p, _ in shown] == list(range(q + 1))  # the query and every earlier token
    np.testing.assert_allclose([w for _, w in shown], att[b, h, q, : q + 1], atol=TOL, rtol=0)
    assert page.locator(".slw-tokens .slw-tok.slw-future").count() == T - 1 - q
    assert page.locator(".slw-tokens .slw-tok.slw-future[data-weight]").count() == 0
    top = page.locator(".slw-top-item").first
    assert float(top.get_attribute("data-weight")) == pytest.approx(att[b, h, q, : q + 1].max(), abs=TOL)

    # another token, then all 24 heads as small multiples of that row
    q2 = min(T - 1, 23)
    page.click(f'.slw-tokens .slw-tok[data-pos="{q2}"]')
    page.click(".slw-mode-all")
    assert page.locator(".slw-panel").count() == 24
    labels = page.eval_on_selector_all(".slw-panel", "els => els.map(e => e.dataset.label)")
    assert labels == [head_label(i, j) for i in range(6) for j in range(4)]
    for bb, hh in [(0, 0), (1, 3), (5, 2)]:
        cells = _shown_weights(page, f'.slw-panel[data-label="{head_label(bb, hh)}"] .slw-cell')
        assert [p for p, _ in cells] == list(range(q2 + 1))
        np.testing.assert_allclose([w for _, w in cells], att[bb, hh, q2, : q2 + 1], atol=TOL, rtol=0)
    page.click('.slw-panel[data-label="L2H4"]')  # a panel selects its head
    np.testing.assert_allclose([w for _, w in _shown_weights(page)], att[1, 3, q2, : q2 + 1], atol=TOL, rtol=0)
    assert page.text_content(".slw-badge") == "L2H4"
    assert page.errors == [] and page.requests == []


HOSTILE = 'Tom had a box. <script>window.__pwned=1</script> Tom said <img src=x onerror="window.__pwned=2"> bye.'


def test_story_text_cannot_run_script(page, browser, model, tmp_path):
    _open(page, attention_widget(model, HOSTILE).save(tmp_path / "hostile.html"))
    page.click('.slw-tokens .slw-tok[data-pos="5"]')
    page.wait_for_timeout(300)  # an injected <img> would have fired onerror by now
    assert page.evaluate("typeof window.__pwned") == "undefined"
    text = page.text_content(".slw-tokens")
    assert "<script>window.__pwned=1</script>" in text
    assert '<img src=x onerror="window.__pwned=2">' in text
    assert page.locator(".slw-root img").count() == 0
    assert page.locator("script").count() == 2  # our data and our code, nothing injected

    # Tokens that are whole tags, and a hostile title, in a notebook-style fragment
    # (no Content-Security-Policy to hide behind): still only text.
    evil = [
        "<eot>",
        "<script>window.__pwned=3</script>",
        '<img src=x onerror="window.__pwned=4">',
        "</script><script>window.__pwned=5</script>",
    ]
    att = np.tril(np.ones((4, 4)))
    att = np.broadcast_to(att / att.sum(1, keepdims=True), (6, 4, 4, 4))
    frag = AttentionWidget(evil, att, title="<script>window.__pwned=6</script>")._repr_html_()
    bare = tmp_path / "fragment.html"
    bare.write_text(
        f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{frag}</body></html>", encoding="utf-8"
    )
    pg2 = browser.new_page()
    pg2.goto(bare.as_uri())
    pg2.wait_for_selector('.slw-root[data-slw-ready="1"]', timeout=20_000)
    pg2.click('.slw-tok[data-pos="3"]')
    pg2.wait_for_timeout(300)
    assert pg2.evaluate("typeof window.__pwned") == "undefined"
    assert pg2.eval_on_selector_all(".slw-tokens .slw-tok", "els => els.map(e => e.textContent)") == evil
    assert pg2.text_content(".slw-title") == "<script>window.__pwned=6</script>"
    assert pg2.locator(".slw-root img").count() == 0
    pg2.close()
    assert page.errors == [] and page.requests == []


def test_toy_shares(page, tmp_path):
    toy = toy_widget()
    _open(page, toy.save(tmp_path / "toy.html"))

    def shares():
        return page.eval_on_selector_all(".slw-toy-row", "els => els.map(e => parseFloat(e.dataset.share))")

    got = shares()
    np.testing.assert_allclose(got[: toy.query + 1], toy.shares(), atol=1e-12)
    assert got[toy.query + 1 :] == [0.0] * (len(toy.words) - toy.query - 1)  # masked
    page.click('.slw-chip[data-index="9"]')  # "it"
    np.testing.assert_allclose(shares(), toy.shares(9), atol=1e-12)
    page.fill(".slw-q >> nth=0", "3")  # edit the query: q = (3, 1.5)
    toy.queries[9] = [3.0, 1.5]
    np.testing.assert_allclose(shares(), toy.shares(9), atol=1e-12)
    assert page.locator(".slw-q").first.evaluate("e => e === document.activeElement")
    with page.expect_download() as d:  # taken away as SVG: the words and the shares on screen
        page.click(".slw-toy .sl-export-svg")
    svg = open(d.value.path(), encoding="utf-8").read()
    assert d.value.suggested_filename == "toy-attention-it.svg" and svg.startswith("<svg")
    assert f"it {100 * toy.shares(9)[9]:.2f}%" in svg or f"it {100 * toy.shares(9)[9]:.1f}%" in svg
    assert page.errors == [] and page.requests == []
