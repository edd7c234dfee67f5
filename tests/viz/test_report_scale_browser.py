"""The report at the scale people study, in headless Chromium: a seeded random 30 x 9-head
Llama-style model (270 heads). Every head is reachable from the overview, the story's maps are
shown a block at a time with labels a reader can read, the page stays under its size budget,
the shown weights are within the quantisation step of the recorded ones, and every view can be
taken away as PNG and SVG.

Setup: see BROWSER_SETUP.md beside this file (skipped without a browser unless
STORYLENS_REQUIRE_BROWSER=1).
"""

from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np
import pytest
import torch

from storylens.cli import main
from storylens.core.heads import head_label

MIN_LABEL_PX = 9
REPORT_BUDGET = 8 * 2**20  # the budget for report.html on a 30 x 9-head model
N_STORIES = 16  # scored here; the page's size hardly depends on it (one story's maps, 270 table rows)


@pytest.fixture(scope="module")
def report_30x9(llama_30x9, quiz, tmp_path_factory):
    root = tmp_path_factory.mktemp("report30")
    src = root / "quiz.txt"
    src.write_text("".join(s.strip() + "\n<|endoftext|>\n" for s in quiz[:N_STORIES]), encoding="utf-8")
    out = root / "report"
    args = ["report", "--model", str(llama_30x9), "--quiz", str(src), "--out", str(out), "--no-progress"]
    args += ["--sections", "overview,widget,lesson,detectors,sinks,truth,heads"]  # the lesson's figures too
    assert main([*args, "--truth-stories", "2"]) == 0
    return out


def _payload(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="[^"]+-data">(\{"kind":"attention".*?)</script>', html, re.S)
    assert m, "no attention widget in the page"
    return json.loads(m.group(1))


def _download(page, click_selector: str):
    with page.expect_download() as d:
        page.click(click_selector)
    path = d.value.path()
    return d.value.suggested_filename, open(path, "rb").read()


def test_report_at_30x9_fits_its_budget_and_its_weights(report_30x9, llama_30x9, quiz):
    from storylens.lm import load_lm
    from storylens.recording import story_attention

    html = (report_30x9 / "report.html").read_text(encoding="utf-8")
    size = len(html.encode("utf-8"))
    print(f"report.html for 30 x 9 heads: {size / 2**20:.2f} MiB")
    assert size <= REPORT_BUDGET, size
    assert "All 270 heads, one quiz story" not in html  # no single picture of 270 maps
    d = _payload(html)
    assert (d["nBlock"], d["nHead"], d["mode"]) == (30, 9, "maps")
    levels = np.frombuffer(
        zlib.decompress(base64.b64decode(d["att"]["deflate"])), "<u2" if d["att"]["bits"] == 16 else "<u1"
    )
    shown = levels.reshape(30, 9, -1) / d["att"]["levels"]
    # the recorded maps of the story the page shows, recomputed: every weight within half a step
    summary = json.loads((report_30x9 / "summary.json").read_text())
    story = quiz[:N_STORIES][summary["story_shown"]["quiz_index"] - 1]
    _, att, _ = story_attention(load_lm(llama_30x9), story)
    att = np.asarray(att, dtype=np.float64)
    rows, cols = np.tril_indices(att.shape[-1])
    err = np.abs(shown - att[:, :, rows, cols]).max()
    print(f"largest quantisation error {err:.2e} at {d['att']['bits']} bits (bound {d['maxError']:.2e})")
    # half a step, plus what two float32 recordings of the same story may differ by
    assert err <= d["maxError"] + 1e-5, err


def test_report_at_30x9_in_a_browser(page, report_30x9):
    page.goto((report_30x9 / "report.html").as_uri())
    page.wait_for_selector('.slw-root[data-slw-ready="1"]', timeout=60_000)
    page.wait_for_selector('body[data-sl-ready="1"]', timeout=20_000)
    assert page.errors == [] and page.requests == []

    # the overview: one grid per detector, 270 heads each; one shown at a time
    cells = page.eval_on_selector_all(
        ".sl-ov:not([hidden]) td[data-head]",
        "els => els.map(e => [e.dataset.head, parseFloat(getComputedStyle(e).fontSize), e.getBoundingClientRect().width])",
    )
    assert [c[0] for c in cells] == [head_label(b, h) for b in range(30) for h in range(9)]
    assert min(c[1] for c in cells) >= MIN_LABEL_PX and min(c[2] for c in cells) >= 28
    page.select_option(".sl-ov-pick", "norm_prev_token")
    assert page.eval_on_selector_all(".sl-ov:not([hidden])", "els => els.map(e => e.dataset.col)") == [
        "norm_prev_token"
    ]

    # a head picked in the overview is shown in the widget, its block as maps
    page.click('.sl-ov:not([hidden]) td[data-head="L17H6"]')
    root = ".slw-root.slw-attention"
    assert page.get_attribute(root, "data-block") == "16" and page.get_attribute(root, "data-head") == "5"
    assert page.get_attribute(root, "data-mode") == "maps"
    maps = page.eval_on_selector_all(
        ".slw-map",
        "els => els.map(e => { const i = e.querySelector('img'); return [e.dataset.label, i.naturalWidth, i.getBoundingClientRect().width]; })",
    )
    assert [m[0] for m in maps] == [f"L17H{h}" for h in range(1, 10)]
    # drawn unscaled, so the 11 px token labels are 11 px on screen
    assert all(m[1] > 0 and abs(m[2] - m[1]) < 1 for m in maps)
    page.click(".slw-map-next")
    assert "tokens 32 to 63" in page.text_content(".slw-map-info")

    # take them away: the maps of the block, a figure, a heatmap table
    name, svg = _download(page, root + " .sl-export-svg")
    assert name.endswith(".svg") and svg.startswith(b"<svg") and b"L17H1" in svg and b"L17H9" in svg
    name, png = _download(page, root + " .sl-export-png")
    assert name.endswith(".png") and png[:8] == b"\x89PNG\r\n\x1a\n"
    name, svg = _download(page, ".sl-ov:not([hidden]) .sl-export-svg")
    assert svg.startswith(b"<svg") and b"L30" in svg and b"H9" in svg
    name, png = _download(page, ".sl-ov:not([hidden]) .sl-export-png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    name, svg = _download(page, 'figure[data-name="name_mass"] .sl-export-svg')
    assert name == "name_mass.svg" and b"<svg" in svg[:300]
    assert page.errors == [] and page.requests == []


def test_overview_grid_is_legible_at_48x16(page, tmp_path):
    """The overview's block x head table at the largest size the issue names: every cell wide
    enough for its number, labels at least 9 px, and the whole table inside the report's column."""
    from storylens.viz import HEATMAP_CSS, head_heatmap_html

    grid = np.random.default_rng(0).random((48, 16))
    path = tmp_path / "grid.html"
    table = head_heatmap_html(grid.tolist(), title="48 x 16 heads")
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><style>body{{max-width:1180px;margin:2em auto;padding:0 1em;"
        f"font:15px system-ui}}{HEATMAP_CSS}</style></head><body><figure>{table}</figure></body></html>",
        encoding="utf-8",
    )
    page.goto(path.as_uri())
    cells = page.eval_on_selector_all(
        "td[data-head]",
        "els => els.map(e => { const r = e.getBoundingClientRect(); return [e.dataset.head, r.width, r.right,"
        " parseFloat(getComputedStyle(e).fontSize), e.scrollWidth <= e.clientWidth]; })",
    )
    assert [c[0] for c in cells] == [head_label(b, h) for b in range(48) for h in range(16)]
    assert min(c[1] for c in cells) >= 28 and min(c[3] for c in cells) >= MIN_LABEL_PX
    assert all(c[4] for c in cells)  # every number fits its cell
    assert max(c[2] for c in cells) <= 1180 + 2 * 16  # inside the report's column


WIDGET_BUDGET = 30 * 2**20  # the budget: one story of 1,024 tokens on 144 heads


def test_widget_for_1024_tokens_on_144_heads(page, model, quiz, tmp_path):
    """A seeded random GPT-2-small-shaped model (12 x 12 heads, 1,024-token window) on one long
    story: the widget stays under its budget and opens, every head reachable a block at a time."""
    transformers = pytest.importorskip("transformers")
    from storylens.lm import load_lm
    from storylens.recording import attention_widget

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = transformers.GPT2Config(
        n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=model.tokenizer.get_vocab_size()
    )
    cfg.bos_token_id = cfg.eos_token_id = tok.bos_token_id
    torch.manual_seed(0)
    gpt2 = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights than the default init, so heads differ from an even spread
        for name, p in gpt2.named_parameters():
            if "attn" in name:
                p.mul_(8.0)
    folder = tmp_path / "gpt2"
    gpt2.save_pretrained(folder)
    tok.save_pretrained(folder)
    lm = load_lm(folder)
    text = " ".join(quiz[:12])  # long enough to fill the window
    w = attention_widget(lm, text, memory_budget=2**31)  # every token of the window
    path = w.save(tmp_path / "widget.html")
    size = path.stat().st_size
    print(f"widget, 1,024 tokens x 144 heads: {size / 2**20:.1f} MiB at {w.bits} bits")
    assert w.patterns.shape == (12, 12, 1024, 1024) and size <= WIDGET_BUDGET
    page.goto(path.as_uri())
    page.wait_for_selector('.slw-root[data-slw-ready="1"]', timeout=120_000)
    page.click(".slw-mode-all")  # past 48 heads: the query's row in every head of one block
    assert page.locator(".slw-panel").count() == 12
    page.select_option(".slw-block", "11")
    page.click(".slw-mode-maps")
    labels = page.eval_on_selector_all(".slw-map", "els => els.map(e => e.dataset.label)")
    assert labels == [f"L12H{h}" for h in range(1, 13)]
    q = 1000
    page.click(".slw-mode-one")
    page.click(f'.slw-tokens .slw-tok[data-pos="{q}"]')
    shown = page.eval_on_selector_all(
        ".slw-tokens .slw-tok[data-weight]", "els => els.map(e => parseFloat(e.dataset.weight))"
    )
    np.testing.assert_allclose(shown, w.patterns[11, 0, q, : q + 1], atol=w.max_error * (1 + 1e-9), rtol=0)
    assert page.errors == [] and page.requests == []
