"""Figures on a real quiz story with the shipped model: shapes, labels and PNG output."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from storylens.core.heads import head_label
from storylens.viz import (
    all_heads_figure,
    causal_mask_figure,
    figure_data_uri,
    head_heatmap_figure,
    head_heatmap_html,
    name_attention_profile,
    name_even_share,
    name_head_figure,
    name_mass_bar_figure,
    save_png,
    token_texts,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LABELS = [head_label(b, h) for b in range(6) for h in range(4)]


def _png_shape(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return imread(io.BytesIO(data)).shape


def _name_mass(att, names):
    """Per head: mean share on the name over non-name queries after the first mention."""
    out = {}
    for b in range(att.shape[0]):
        for h in range(att.shape[1]):
            w, _ = name_attention_profile(att[b, h], names)
            out[head_label(b, h)] = float(w[names].sum())
    return out


def test_token_texts_show_marker_and_round_trip(model, story_run):
    ids, tokens, _, _ = story_run
    assert tokens[0] == "<eot>"
    tok = model.tokenizer
    if not any("\ufffd" in tok.decode([i]) for i in ids[1:]):  # whole characters only
        assert "".join(tokens[1:]) == tok.decode(ids[1:])
    # partial UTF-8 tokens fall back to their vocabulary entry, never to U+FFFD
    snowman = tok.encode("\u2603").ids
    assert all("\ufffd" not in t for t in token_texts(tok, snowman))


def test_all_heads_grid(story_run, tmp_path):
    _, tokens, att, _ = story_run
    fig = all_heads_figure(att, tokens, max_tokens=24)
    ax = fig.axes[0]
    heads = [t.get_text() for t in ax.texts if t.get_gid() == "head-label"]
    assert heads == LABELS and list(fig.head_panels) == LABELS  # 24 heads, L1H1 .. L6H4
    h, w, _ = _png_shape(save_png(fig, tmp_path / "all_heads.png"))
    assert h > w > 300  # a tall 6 x 4 grid
    rows = sorted({p[0].start for p in fig.head_panels.values()})
    cols = sorted({p[1].start for p in fig.head_panels.values()})
    assert (len(rows), len(cols)) == (6, 4)
    # each panel is the recorded attention, cropped, in the colour scale; the masked upper
    # triangle is not drawn as data
    first = fig.head_maps["L1H1"]
    assert first.shape == (24, 24)
    np.testing.assert_array_equal(np.ma.filled(first, 0.0), np.tril(att[0, 0, :24, :24]))  # the same numbers
    assert first.mask[0, 1] and not first.mask[1, 0]
    from matplotlib import colormaps
    from matplotlib.colors import PowerNorm

    rs, cs = fig.head_panels["L5H3"]
    drawn = fig.grid_image[rs, cs]
    expected = colormaps["viridis"](PowerNorm(0.5, 0.0, 1.0)(att[4, 2, :24, :24]))
    lower = ~np.triu(np.ones((24, 24), bool), 1)
    np.testing.assert_allclose(drawn[lower], expected[lower])
    assert np.all(drawn[~lower] == drawn[0, 1])  # one mask colour above the diagonal

    # token labels along the outer edges only: every one of the 24, per row and per column
    def token_labels(axis):
        return [t.get_text() for t in ax.texts if t.get_gid() == f"token-label-{axis}"]

    assert token_labels("y")[:1] == ["<eot>"] and len(token_labels("y")) == 6 * 24
    assert len(token_labels("x")) == 4 * 24


def test_all_heads_long_story_labels_every_kth(story_run):
    _, tokens, att, _ = story_run
    fig = all_heads_figure(att, tokens, max_tokens=None, max_labels=20)  # not drawn: cheap
    assert fig.head_maps["L1H1"].shape == (len(tokens), len(tokens))
    per_row = len([t for t in fig.axes[0].texts if t.get_gid() == "token-label-y"]) / 6
    assert 0 < per_row <= 20


def test_causal_mask_triangle(story_run, tmp_path):
    _, tokens, _, _ = story_run
    fig = causal_mask_figure(tokens[:6])
    ax = fig.axes[0]
    np.testing.assert_array_equal(ax.get_images()[0].get_array(), np.tril(np.ones((6, 6))))
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("−∞") == 15 and texts.count("score") == 21
    assert _png_shape(save_png(fig, tmp_path / "mask.png"))[0] > 100


def test_name_mass_bars_and_heatmap(story_run, tmp_path):
    _, tokens, att, names = story_run
    scores = _name_mass(att, names)
    baseline = len(names) / len(tokens)
    pairs = sorted(scores.items(), key=lambda kv: -kv[1])
    fig = name_mass_bar_figure(pairs[:6], baseline)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [label for label, _ in pairs[:6]]
    assert len(ax.patches) == 6
    np.testing.assert_allclose([p.get_height() for p in ax.patches], [v for _, v in pairs[:6]])
    assert any(np.allclose(line.get_ydata(), baseline) for line in ax.get_lines())
    save_png(fig, tmp_path / "bars.png")

    best = pairs[0][0]
    fig = head_heatmap_figure(scores, title="Name mass", highlight=best)
    ax = fig.axes[0]
    grid = ax.get_images()[0].get_array()
    assert grid.shape == (6, 4)
    assert grid[int(best[1]) - 1, int(best[3]) - 1] == pytest.approx(scores[best])
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"L{i}" for i in range(1, 7)]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"H{i}" for i in range(1, 5)]
    assert len(ax.texts) == 24
    assert _png_shape(save_png(fig, tmp_path / "heat.png"))[1] > 200
    # array input gives the same grid
    arr = np.array([[scores[head_label(b, h)] for h in range(4)] for b in range(6)])
    np.testing.assert_allclose(head_heatmap_figure(arr).axes[0].get_images()[0].get_array(), arr)


def test_name_head_figure_and_data_uri(story_run):
    _, tokens, att, names = story_run
    scores = _name_mass(att, names)
    best = max(scores, key=scores.get)
    b, h = int(best[1]) - 1, int(best[3]) - 1
    weights, queries = name_attention_profile(att[b, h], names)
    from storylens.lesson.checks import row_sum_bound

    # a mean of attention rows: sums to 1 up to a float32 softmax's rounding (storylens.lesson.checks)
    assert weights.shape == (len(tokens),)
    assert weights.sum() == pytest.approx(1.0, abs=row_sum_bound(torch.float32, len(tokens)))
    assert min(queries) > names[0] and not set(queries) & set(names)
    fig = name_head_figure(tokens, att[b, h], names, label=best)
    assert best in fig.get_suptitle()
    # the ratio divides this story's share by this story's even spread over the same queries
    share, even = float(weights[names].sum()), name_even_share(names, queries)
    assert f"{share:.3f} = {share / even:.1f}× this story's even spread ({even:.3f})" in fig.get_suptitle()
    assert f"both over the same {len(queries)} queries" in fig.get_suptitle()
    uri = figure_data_uri(fig)
    assert uri.startswith("data:image/png;base64,")
    assert base64.b64decode(uri.split(",", 1)[1])[:8] == PNG_MAGIC


def test_the_name_figures_even_spread_is_the_scores_baseline_on_its_story(model, quiz):
    """name_even_share on one story's scored queries equals the head scores' name_baseline scored on
    that story alone (two computations: numpy here, float64 torch in storylens.table.scores)."""
    from storylens.analysis import score_heads
    from storylens.data.names import name_vocabulary
    from storylens.engine.encode import encode_stories
    from storylens.lm import wrap

    lm = wrap(model)
    encoded = encode_stories(lm, quiz[:40], name_vocabulary(quiz))
    story = next(e for e in encoded if e.main is not None and len(e.main.positions) >= 3)
    positions = list(story.main.positions)
    n = len(story.ids)
    queries = [q for q in range(story.main.first_mention + 1, n) if q not in set(positions)]
    scores = score_heads(lm, [story], progress=False)
    assert scores.n_name_scored == 1
    even = name_even_share(positions, queries)
    # both float64 means of a few hundred terms: apart by at most a few hundred roundings (~1e-14)
    assert even == pytest.approx(scores.name_baseline, rel=1e-12, abs=0)
    # by hand on a tiny case: names at 1 and 3, queries 2 and 4: (1/3 + 2/5) / 2
    assert name_even_share([3, 1], [2, 4]) == pytest.approx((1 / 3 + 2 / 5) / 2, rel=1e-15)


def test_heatmap_table_colours_every_head_and_boxes_the_best():
    import re

    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    from storylens.viz import head_heatmap_html

    grid = np.arange(24, dtype=float).reshape(6, 4) / 23
    grid[5, 3] = np.nan
    page = head_heatmap_html(grid, title="Name <mass>", highlight="L2H3")
    assert "<caption>Name &lt;mass&gt;</caption>" in page
    cells = re.findall(
        r'<td( class="best")? data-head="(L\dH\d)"(?: data-value="([^"]+)")?[^>]*'
        r'style="background:(#[0-9a-f]{6})',
        page,
    )
    assert [c[1] for c in cells] == LABELS
    assert [c[1] for c in cells if c[0]] == ["L2H3"]
    assert float(cells[0][2]) == 0.0 and float(cells[22][2]) == grid[5, 2]
    assert cells[0][3] == to_hex(colormaps["magma"](0.0)) and cells[22][3] == to_hex(colormaps["magma"](1.0))
    assert cells[23][2] == "" and ">–</td>" in page  # no score: a dash, no colour scale


def test_effects_within_two_errors_of_zero_claim_no_sign():
    """With standard errors, a value within two of them of zero is parenthesised in the HTML table and
    the figure (no sign claimed); one beyond them is written as it is."""
    values = [[0.010, -0.030], [0.004, 0.0]]
    errors = [[0.004, 0.010], [0.003, 0.001]]  # 0.010 > 2 * 0.004; 0.030 > 2 * 0.010; 0.004 <= 0.006
    table = head_heatmap_html(values, fmt="{:+.3f}", errors=errors)
    assert ">+0.010<" in table and ">-0.030<" in table
    assert ">(+0.004)<" in table and ">(+0.000)<" in table
    assert "within two standard errors of zero" in table
    fig = head_heatmap_figure(values, fmt="{:+.3f}", errors=errors)
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"+0.010", "-0.030", "(+0.004)", "(+0.000)"} <= texts
    assert ">+0.004<" in head_heatmap_html(values, fmt="{:+.3f}")  # without errors: as before
