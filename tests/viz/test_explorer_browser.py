"""explore.html in a real headless browser, on two score runs of a few quiz stories: the shipped model
(6 x 4 heads) and a seeded random 30 x 9-head Llama-style transformers model. No script error, no
network request, every head in the table and the grid, filters and sorting that agree with
heads.json, a head's examples and shading equal to examples.json, legible labels, a page under
budget, and a PNG and an SVG download from every view.

Setup: see BROWSER_SETUP.md beside this file (skipped without playwright or chromium unless
STORYLENS_REQUIRE_BROWSER=1)."""

from __future__ import annotations

import io
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from storylens.cli import main
from storylens.data.stories import EOT

N_STORIES = 6
BUDGET = 5 * 2**20  # bytes: the 30 x 9-head page with 8 examples per head and detector
MIN_LABEL_PX = 9.0


def _score(folder, quiz, *argv):
    stories = folder / "stories.txt"
    stories.write_text("".join(f"{s}\n{EOT}\n" for s in quiz[:N_STORIES]), encoding="utf-8")
    out = folder / "run"
    assert main(["score", "--stories", str(stories), "--out", str(out), "--no-progress", *argv]) == 0
    return out


@pytest.fixture(scope="session")
def shipped_run(quiz, tmp_path_factory):
    return _score(tmp_path_factory.mktemp("shipped"), quiz)


@pytest.fixture(scope="session")
def llama_run(llama_30x9, quiz, tmp_path_factory):
    """The seeded random 30 x 9-head Llama-style model (tests/viz/conftest.py), scored on a few quiz stories."""
    return _score(tmp_path_factory.mktemp("llama30x9"), quiz, "--model", str(llama_30x9))


@pytest.fixture(params=["shipped_run", "llama_run"])
def run(request):
    """(the run's folder, heads.json rows, examples.json)."""
    out = request.getfixturevalue(request.param)
    heads = json.loads((out / "heads.json").read_text())["heads"]
    return out, heads, json.loads((out / "examples.json").read_text())


def _open(page, out):
    page.goto((out / "explore.html").as_uri())
    page.wait_for_selector('.sle-root[data-ready="1"]', timeout=30_000)


def _visible_labels(page):
    return page.eval_on_selector_all("tr.sle-row", "rows => rows.filter(r => !r.hidden).map(r => r.dataset.label)")


def _labels_where(heads, keep):
    return [h["label"] for h in heads if keep(h)]


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_every_head_is_there_and_the_page_is_clean(page, run):
    out, heads, _ = run
    size = (out / "explore.html").stat().st_size
    _open(page, out)
    assert page.errors == [] and page.requests == []
    labels = [h["label"] for h in heads]
    assert _visible_labels(page) == labels  # every head listed, in the table's order, none paged away
    assert sorted(page.eval_on_selector_all(".sle-cell[data-label]", "els => els.map(e => e.dataset.label)")) == sorted(
        labels
    )
    assert page.get_attribute(".sle-root", "data-matches") == str(len(heads))
    # every column of heads.json, every value exactly as written
    columns = page.eval_on_selector_all("th[data-col]", "els => els.map(e => e.dataset.col)")
    assert columns == list(heads[0])
    shown = page.eval_on_selector_all("tr.sle-row", "rows => rows.map(r => [...r.cells].map(c => c.dataset.value))")
    for h, cells in zip(heads, shown):
        for c, v in zip(columns, cells):
            want = h[c] if _num(h[c]) else json.dumps(h[c]) if isinstance(h[c], bool) else (h[c] or "")
            assert (float(v) if _num(h[c]) else v) == want, (h["label"], c)
    # the grid: cells of at least 28 px with labels of at least 9 px
    w, hgt, px = page.eval_on_selector(
        ".sle-cell",
        "e => [e.getBoundingClientRect().width, e.getBoundingClientRect().height, parseFloat(getComputedStyle(e).fontSize)]",
    )
    assert w >= 28 and hgt >= 28 and px >= MIN_LABEL_PX
    assert (
        page.eval_on_selector_all(
            ".sle-row-label, .sle-col-label",
            "els => Math.min(...els.map(e => parseFloat(getComputedStyle(e).fontSize)))",
        )
        >= MIN_LABEL_PX
    )
    n_blocks, n_heads = max(h["block"] for h in heads), max(h["head"] for h in heads)
    if n_blocks == 30:
        assert size < BUDGET
        bare = len(json.dumps(heads))  # about what the table takes; the rest is the examples
        _, _, ex = run
        per = (size - bare) / (len(heads) * len(ex["detectors"]) * ex["k"])
        print(
            f"explore.html for {n_blocks} x {n_heads} heads: {size / 2**20:.2f} MiB, about {per:.0f} bytes per head x detector x example"
        )


def test_filters_and_sorting_agree_with_heads_json(page, run):
    out, heads, _ = run
    _open(page, out)

    def filtered(text):
        page.fill(".sle-filter", text)
        return _visible_labels(page)

    def at_least(c, x):
        return lambda h: _num(h[c]) and h[c] >= x

    assert filtered("prev_token > 0.5") == _labels_where(
        heads, lambda h: _num(h["prev_token"]) and h["prev_token"] > 0.5
    )
    middle = sorted(h["prev_token"] for h in heads)[len(heads) // 2]
    got = filtered(f"prev_token > {middle!r}")
    assert got == _labels_where(heads, lambda h: h["prev_token"] > middle) and 0 < len(got) < len(heads)
    assert page.text_content(".sle-count") == f"{len(got)} of {len(heads)} heads match"
    marker = sorted(h["norm_marker"] for h in heads)[len(heads) // 3]
    share = sorted(h["output_share"] for h in heads)[2 * len(heads) // 3]
    both = filtered(f"norm_marker >= {marker!r} and output_share < {share!r}")
    assert both == _labels_where(heads, lambda h: at_least("norm_marker", marker)(h) and h["output_share"] < share)
    assert filtered("layer = 3") == [h["label"] for h in heads if h["block"] == 3]
    assert filtered("(head = 1 or head = 2) and not layer > 2") == _labels_where(
        heads, lambda h: h["head"] in (1, 2) and h["block"] <= 2
    )
    # a filter that is not one: a one-line message, the table as it was
    for bad in ("prev_token >", "no_such_column > 1", "prev_token > high", "label < L1H1"):
        assert filtered(bad) == _labels_where(heads, lambda h: h["head"] in (1, 2) and h["block"] <= 2)
        message = page.text_content(".sle-filter-msg")
        assert message.startswith("Filter not applied: ") and "\n" not in message
    assert filtered("") == [h["label"] for h in heads] and page.text_content(".sle-filter-msg") == ""
    page.check(".sle-flagged")
    assert _visible_labels(page) == _labels_where(heads, lambda h: h["dormant"] is True)
    page.uncheck(".sle-flagged")

    # sorting: numbers numerically, largest first on the first click, missing values last both ways
    def key(h, c):
        return (not _num(h[c]), 0 if not _num(h[c]) else h[c])

    for c in ("prev_token", "output_norm", "prev_token_first"):
        page.click(f'button.sle-sort[data-col="{c}"]')
        down = [h["label"] for h in sorted(heads, key=lambda h: (not _num(h[c]), -h[c] if _num(h[c]) else 0))]
        assert _visible_labels(page) == down and page.get_attribute(f'th[data-col="{c}"]', "aria-sort") == "descending"
        page.click(f'button.sle-sort[data-col="{c}"]')
        assert _visible_labels(page) == [h["label"] for h in sorted(heads, key=lambda h: key(h, c))]
    page.click('button.sle-sort[data-col="label"]')
    assert _visible_labels(page) == [h["label"] for h in heads]  # L10 after L9: block and head order
    assert page.errors == [] and page.requests == []


def _shown(text: str) -> str:
    """A token as the page shows it (newlines and tabs as symbols, an empty one as a sign)."""
    return text.replace("\r", "").replace("\n", "\u21b5").replace("\t", "\u21e5") or "\u2205"


def _shown_window(x: dict) -> tuple[list[str], list[float], int]:
    """What the page shows of an example, in story order: where the key lies before the query's
    window, the key window's tokens before that window first; (tokens, weights up to the query, the
    query's place among the tokens)."""
    first = x["query"] - x["query_at"]
    tokens, weights = [], []
    if x["key"] < first:
        start = x["key"] - x["key_at"]
        n = min(len(x["key_tokens"]), first - start)
        tokens, weights = x["key_tokens"][:n], x["key_weights"][:n]
    return tokens + x["tokens"], weights + x["weights"], len(tokens) + x["query_at"]


def _strongest(heads, ex, label):
    """The detector on which the head's score is the largest share of the best head's (ties: the first)."""
    row = next(h for h in heads if h["label"] == label)
    best = {d: max((h[d] for h in heads if _num(h[d])), default=0) for d in ex["detectors"]}
    return max((d for d in ex["detectors"] if best[d] > 0 and _num(row[d])), key=lambda d: row[d] / best[d])


def test_a_head_shows_its_examples_as_examples_json_has_them(page, run):
    out, heads, ex = run
    _open(page, out)
    by_label = {h["label"]: h["examples"] for h in ex["heads"]}
    strongest = max(heads, key=lambda h: h["prev_token"])["label"]
    for label in (strongest, heads[-1]["label"]):
        page.click(f'.sle-cell[data-label="{label}"]')
        assert page.get_attribute(".sle-root", "data-head") == label == page.text_content(".sle-head-title")
        # a clicked head opens on the detector it fires on most, not the grid's column
        assert page.get_attribute(".sle-root", "data-detector") == _strongest(heads, ex, label)
        assert page.get_attribute(".sle-strongest", "data-detector") == _strongest(heads, ex, label)
        for detector in ex["detectors"]:
            page.select_option(".sle-detector", detector)
            want = by_label[label][detector]
            got = page.eval_on_selector_all(
                ".sle-example",
                """els => els.map(e => ({
                    value: parseFloat(e.dataset.value), story: +e.dataset.story, query: +e.dataset.query,
                    tokens: [...e.querySelectorAll('.sle-tokens .sle-tok')].map(t => t.textContent),
                    weights: [...e.querySelectorAll('.sle-tok[data-weight]')].map(t => parseFloat(t.dataset.weight)),
                    query_at: [...e.querySelectorAll('.sle-tokens .sle-tok')].findIndex(t => t.classList.contains('sle-query')),
                    key: [...e.querySelectorAll('.sle-tok.sle-key')].map(t => [+t.dataset.pos, parseFloat(t.dataset.weight)]),
                }))""",
            )
            assert [g["value"] for g in got] == [x["value"] for x in want], (label, detector)
            stories = [x["story"] for x in want]
            assert max(stories.count(s) for s in stories) <= ex["per_story"]  # spread across stories
            for g, x in zip(got, want):
                tokens, weights, query_at = _shown_window(x)
                assert (g["story"], g["query"], g["query_at"]) == (x["story"], x["query"], query_at)
                assert g["tokens"] == [_shown(t) for t in tokens]
                assert g["weights"] == weights  # the shading: exactly the kept weights
                # the most-attended key is always among them, marked, with its weight
                assert g["key"] == [[x["key"], round(x["key_weight"], 4)]]
    # the chosen example's map: one bar per key the query sees, the same weights
    page.select_option(".sle-detector", "prev_token")
    want = by_label[heads[-1]["label"]]["prev_token"]
    page.click('.sle-example[data-rank="2"] .sle-tokens')
    assert page.get_attribute(".sle-root", "data-example") == "1"
    bars = page.eval_on_selector_all(".sle-chosen .sle-bar-col", "els => els.map(e => parseFloat(e.dataset.weight))")
    assert bars == _shown_window(want[1])[1]
    # an example whose key lies before the query's window: its map holds the key's bar, after it a gap
    far = [
        (h["label"], d, i)
        for h in ex["heads"]
        for d, xs in h["examples"].items()
        for i, x in enumerate(xs)
        if x["key"] + 4 < x["query"] - x["query_at"]  # the key window ends before the query's
    ]
    assert far  # on both models
    label, detector, i = far[0]
    x = by_label[label][detector][i]
    page.click(f'.sle-cell[data-label="{label}"]')
    page.select_option(".sle-detector", detector)
    page.click(f'.sle-example[data-rank="{i + 1}"] .sle-tokens')
    key_bar = page.eval_on_selector(".sle-chosen .sle-bar-col.sle-key", "e => parseFloat(e.dataset.weight)")
    assert key_bar == round(x["key_weight"], 4) > 0
    assert page.eval_on_selector_all(".sle-chosen .sle-bar-gap", "els => els.length") == 1
    # token labels as drawn: at least 9 px everywhere
    for selector in (".sle-tok", ".sle-bar-tok", ".sle-bar-w", ".sle-key-tok"):
        px = page.eval_on_selector_all(
            selector, "els => Math.min(...els.map(e => parseFloat(getComputedStyle(e).fontSize)))"
        )
        assert px >= MIN_LABEL_PX, selector
    assert page.errors == [] and page.requests == []


def _download(page, button):
    with page.expect_download() as d:
        page.click(button)
    return d.value.suggested_filename, Path(d.value.path()).read_bytes()


def test_every_view_saves_as_png_and_svg(page, run):
    from PIL import Image

    out, heads, _ = run
    _open(page, out)
    label = heads[len(heads) // 2]["label"]
    page.click(f'tr.sle-row[data-label="{label}"]')
    page.select_option(".sle-column", "norm_prev4")  # the grid's column picks the examples' detector too
    assert page.get_attribute(".sle-root", "data-detector") == "prev4"
    views = {
        "grid": (
            ".sle-grid-box",
            "grid-norm_prev4",
            ["L1", f"H{heads[-1]['head']}", f"L{heads[-1]['block']}", "norm_prev4"],
        ),
        "example": ('.sle-example[data-rank="1"] .sle-example-head', f"{label}-prev4-example-1", [label, "prev4"]),
        "map": (".sle-map-head", f"{label}-prev4-example-1-map", [label, "attention over the window"]),
    }
    for view, (where, stem, texts) in views.items():
        name, svg = _download(page, f"{where} .sl-export-svg")
        assert name == stem + ".svg", view
        tree = ET.fromstring(svg.decode("utf-8"))  # parseable
        drawn = [t.text for t in tree.iter("{http://www.w3.org/2000/svg}text")]
        for t in texts:
            assert any(t in (s or "") for s in drawn), (view, t)
        name, png = _download(page, f"{where} .sl-export-png")
        assert name == stem + ".png" and png.startswith(b"\x89PNG"), view
        img = Image.open(io.BytesIO(png))
        assert img.width > 100 and img.height > 40 and len(img.convert("RGB").getcolors(1 << 24)) > 2, view
    assert page.errors == [] and page.requests == []


def test_an_address_naming_a_head_opens_its_page(page, run):
    """explore.html#L2H3 (why.html's writer heads and the report's why cards link so) opens that head's page."""
    out, heads, _ = run
    label = heads[len(heads) // 2]["label"]
    page.goto((out / "explore.html").as_uri() + "#" + label)
    page.wait_for_selector('.sle-root[data-ready="1"]', timeout=30_000)
    assert page.get_attribute(".sle-root", "data-head") == label
    assert page.errors == [] and page.requests == []
