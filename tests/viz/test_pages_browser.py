"""report.html and the generation replay in headless Chromium: no script errors, no network
request, legible token labels, and a replay that shows each new token with its recorded row."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from storylens.cli import main

MIN_LABEL_PX = 9.0  # token labels of the 24-head grid, as shown on the page


def _assert_drawn(png: bytes) -> None:
    import io

    from matplotlib.image import imread

    img = imread(io.BytesIO(png))
    assert img.shape[0] > 300 and img.shape[1] > 300
    assert img[..., :3].std() > 0.05  # not a blank page


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pages") / "report"
    assert main(["report", "--out", str(out), "--no-progress"]) == 0
    return out


def test_report_page_loads_clean_with_legible_grid(page, report_dir):
    page.goto((report_dir / "report.html").as_uri())
    page.wait_for_selector('.slw-root[data-slw-ready="1"]', timeout=20_000)
    assert page.errors == [] and page.requests == []
    natural, shown, label_px = page.eval_on_selector(
        "figure.wide img", "e => [e.naturalWidth, e.getBoundingClientRect().width, parseFloat(e.dataset.labelPx)]"
    )
    assert natural > 0 and shown > 0
    assert label_px * shown / natural >= MIN_LABEL_PX  # the grid's token labels as drawn on screen
    # both widgets (the toy and the story) mounted; the lesson's order of sections
    assert page.eval_on_selector_all(".slw-root", "els => els.length") >= 2
    heads = page.eval_on_selector_all("h2", "els => els.map(e => e.textContent)")
    order = [
        "How attention works",
        "All 24 heads",
        "Leakage",
        "name-tracking head",
        "honest limits",
        "Previous-token",
        "number to reproduce",
    ]
    positions = [next(i for i, h in enumerate(heads) if key in h) for key in order]
    assert positions == sorted(positions)
    shot = page.screenshot(full_page=True)  # the page as a reader sees it: drawn, not blank
    _assert_drawn(shot)
    # the score heatmaps sit side by side, not stacked one under another
    pairs = page.eval_on_selector_all(
        ".pair",
        "els => els.map(p => [...p.querySelectorAll('figure')].map(f => Math.round(f.getBoundingClientRect().top)))",
    )
    assert sum(map(len, pairs)) >= 8  # the lesson's detectors and those past it, each a heatmap
    assert [len(set(tops)) for tops in pairs] == [(len(tops) + 1) // 2 for tops in pairs]  # two to a row


def _download(page, selector: str) -> tuple[str, bytes]:
    with page.expect_download() as d:
        page.click(selector)
    return d.value.suggested_filename, open(d.value.path(), "rb").read()


def test_report_overview_picks_heads_and_every_view_can_be_taken_away(page, report_dir):
    page.goto((report_dir / "report.html").as_uri())
    page.wait_for_selector('.slw-root.slw-attention[data-slw-ready="1"]', timeout=20_000)
    page.wait_for_selector('body[data-sl-ready="1"]', timeout=20_000)
    heads = json.loads((report_dir / "heads.json").read_text())["heads"]
    labels = page.eval_on_selector_all(".sl-ov:not([hidden]) td[data-head]", "els => els.map(e => e.dataset.head)")
    assert labels == [h["label"] for h in heads]  # every head, block-major
    shown = page.eval_on_selector_all(".sl-ov:not([hidden]) td[data-head]", "els => els.map(e => +e.dataset.value)")
    assert shown == [h["name_mass"] for h in heads]  # the overview opens on the name detector
    page.click('.sl-ov:not([hidden]) td[data-head="L3H2"]')
    root = ".slw-root.slw-attention"
    assert (page.get_attribute(root, "data-block"), page.get_attribute(root, "data-head")) == ("2", "1")

    name, png = _download(page, 'figure[data-name="all_heads"] .sl-export-png')
    assert name == "all_heads.png" and png == (report_dir / "all_heads.png").read_bytes()
    name, svg = _download(page, 'figure[data-name="all_heads"] .sl-export-svg')
    assert name == "all_heads.svg" and svg == (report_dir / "all_heads.svg").read_bytes()
    name, svg = _download(page, ".sl-ov:not([hidden]) .sl-export-svg")
    assert svg.startswith(b"<svg") and b"L6" in svg and b"H4" in svg
    name, svg = _download(page, root + " .sl-export-svg")  # one head on the story: the shaded text
    assert name.startswith("attention-L3H2-query") and b"<svg" in svg[:10]
    name, png = _download(page, root + " .sl-export-png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.errors == [] and page.requests == []


def test_generation_replay_steps_through_the_recorded_rows(page, tmp_path, model):
    from storylens.lm.generate import record_generation

    out = tmp_path / "replay.html"
    prompt = "Once upon a time, there was a dog named Rex."
    assert main(["generate", prompt, "--max-new-tokens", "25", "--seed", "4", "--record", "--html", str(out)]) == 0
    run = record_generation(model, prompt, 25, seed=4)
    page.goto(out.as_uri())
    page.wait_for_selector('.slw-root[data-slw-ready="1"]', timeout=20_000)
    assert page.errors == [] and page.requests == []
    root = ".slw-root"
    start, end = run.prompt_len, len(run.ids) - 1

    def visible():
        return page.eval_on_selector_all(".slw-tok", "els => els.filter(e => e.offsetParent !== null).length")

    # it opens on the whole story, its last token the query
    assert int(page.get_attribute(root, "data-written")) == end == int(page.get_attribute(root, "data-query"))
    assert visible() == len(run.ids)
    # every button's words are plain ASCII and its mark a drawn SVG path: no glyph a font can lack
    labels = page.eval_on_selector_all(".slw-replay button", "els => els.map(e => e.textContent)")
    assert labels == ["Prompt", "Back", "Step", "Play", "Whole story"]
    marks = page.eval_on_selector_all(
        ".slw-replay button", "els => els.map(e => e.querySelectorAll('svg path').length)"
    )
    assert marks == [1] * 5
    page.click(".slw-rp-first")
    assert int(page.get_attribute(root, "data-written")) == start - 1  # the prompt alone
    assert visible() == start
    for k in range(1, 4):
        page.click(".slw-rp-next")
        q = start - 1 + k
        assert int(page.get_attribute(root, "data-written")) == q and int(page.get_attribute(root, "data-query")) == q
        assert visible() == q + 1
        b, h = int(page.get_attribute(root, "data-block")), int(page.get_attribute(root, "data-head"))
        shown = page.eval_on_selector_all(
            ".slw-tokens .slw-tok[data-weight]", "els => els.map(e => parseFloat(e.dataset.weight))"
        )
        # the page embeds 16 bits: within half a step (7.6e-6) of the model's weights
        np.testing.assert_allclose(shown, run.patterns[b, h, q, : q + 1].numpy(), atol=0.5 / 65535 * (1 + 1e-9), rtol=0)
    _assert_drawn(page.screenshot())
    page.click(".slw-rp-play")
    assert page.text_content(".slw-rp-play") == "Pause"
    page.click(".slw-rp-last")  # stops playing; the whole story again
    assert page.text_content(".slw-rp-play") == "Play"
    assert int(page.get_attribute(root, "data-written")) == end and visible() == len(run.ids)


@torch.no_grad()
def test_recorded_rows_equal_a_full_forward_of_the_story(model):
    from storylens.lesson.checks import probability_bound
    from storylens.lm.generate import record_generation

    run = record_generation(model, "Lily found a shiny stone.", 40, seed=1)
    full = model(torch.tensor([run.ids]), record_attention=True).patterns
    worst = max((run.patterns[b] - full[b][0]).abs().max().item() for b in range(model.config.n_layer))
    assert worst <= probability_bound(model.config, torch.float32)
    assert run.patterns.shape[-1] == len(run.ids) > run.prompt_len
