"""report.html and the generation replay in headless Chromium: no script errors, no network
request, legible token labels, and a replay that shows each new token with its recorded row."""

from __future__ import annotations

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
    tops = page.eval_on_selector_all(".pair figure", "els => els.map(e => Math.round(e.getBoundingClientRect().top))")
    assert len(tops) == 8 and len(set(tops)) == 4  # two to a row


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
    start = run.prompt_len
    assert int(page.get_attribute(root, "data-written")) == start - 1  # only the prompt at first

    def visible():
        return page.eval_on_selector_all(".slw-tok", "els => els.filter(e => e.offsetParent !== null).length")

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
        # the page embeds 5 decimals: within 5e-6 of the model's weights
        np.testing.assert_allclose(shown, run.patterns[b, h, q, : q + 1].numpy(), atol=1e-5, rtol=0)
    _assert_drawn(page.screenshot())
    page.click(".slw-rp-last")
    assert int(page.get_attribute(root, "data-written")) == len(run.ids) - 1 and visible() == len(run.ids)


@torch.no_grad()
def test_recorded_rows_equal_a_full_forward_of_the_story(model):
    from storylens.lesson.checks import probability_bound
    from storylens.lm.generate import record_generation

    run = record_generation(model, "Lily found a shiny stone.", 40, seed=1)
    full = model(torch.tensor([run.ids]), record_attention=True).patterns
    worst = max((run.patterns[b] - full[b][0]).abs().max().item() for b in range(model.config.n_layer))
    assert worst <= probability_bound(model.config, torch.float32)
    assert run.patterns.shape[-1] == len(run.ids) > run.prompt_len
