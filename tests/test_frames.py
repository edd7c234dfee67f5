"""Results as pandas data frames (storylens.core.frames): a real run's heads.csv read back by pandas
equals HeadScores.to_pandas() exactly, the examples come as one row each, and without pandas the
call is one line saying how to install it."""

import html
import math
import sys

import pytest

pd = pytest.importorskip("pandas")

from storylens.core.errors import StorylensError  # noqa: E402
from storylens.core.frames import to_frame  # noqa: E402
from storylens.table.scores import score_heads  # noqa: E402
from storylens.viz.tokens import token_text  # noqa: E402


@pytest.fixture(scope="module")
def scored(shipped_model, corpus_split):
    """Three quiz stories on the shipped model, with the previous-token *_first columns (a column of
    None where not asked is tested on to_frame below) and two examples per head and detector."""
    return score_heads(shipped_model, corpus_split.quiz[:3], max_stories_prev=2, examples=2, progress=False)


def test_to_pandas_equals_heads_csv_read_by_pandas(scored, tmp_path):
    frame = scored.to_pandas()
    read = pd.read_csv(scored.to_csv(tmp_path / "heads.csv"))
    pd.testing.assert_frame_equal(frame, read, check_exact=True)
    assert list(frame.columns) == list(scored.to_rows()[0])
    assert len(frame) == scored.n_layer * scored.n_head
    assert frame["label"].tolist() == [h.label for h in scored.heads]
    assert frame["name_mass"].tolist() == scored.column("name_mass")  # the very floats, not rounded
    assert frame["dormant"].dtype == bool


def test_to_frame_types_missing_values_as_csv_does():
    rows = [{"a": 1, "b": None, "c": True, "d": "x", "e": [1, 2]}, {"a": 2, "b": 0.5, "c": False, "d": "y"}]
    f = to_frame(rows, ["a", "b", "c", "d", "e", "f"])
    assert [str(t) for t in f.dtypes[["a", "b", "c", "e", "f"]]] == ["int64", "float64", "bool", "object", "float64"]
    assert f["d"].dtype == pd.Series(["x"]).dtype  # text as this pandas reads it from CSV
    assert math.isnan(f["b"][0]) and f["b"][1] == 0.5 and f["e"][0] == [1, 2] and f["e"][1] is None
    assert f["f"].isna().all()  # a column no row has: empty, as an empty CSV column reads


def test_examples_to_pandas_one_row_per_kept_example(scored, shipped_model):
    ex = scored.examples
    frame = ex.to_pandas(lambda i: token_text(shipped_model.tokenizer, i))
    heads = [(layer, head) for layer in range(ex.n_layer) for head in range(ex.n_head)]
    n = sum(len(ex.entries(layer, head, d)) for layer, head in heads for d in ex.detectors)
    assert len(frame) == n > 0
    first = frame.iloc[0]
    e = ex.entries(first["layer"] - 1, first["head"] - 1, first["detector"])[first["rank"]]
    assert (first["story"], first["query"], first["value"], first["key"]) == (e.story, e.query, e.value, e.key)
    assert first["tokens"] == [token_text(shipped_model.tokenizer, i) for i in e.tokens]
    ids = ex.to_pandas()
    assert ids.iloc[0]["tokens"] == list(e.tokens)


def test_without_pandas_one_line(scored, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    for call in (scored.to_pandas, scored.examples.to_pandas):
        with pytest.raises(StorylensError) as e:
            call()
        assert str(e.value).startswith("needs pandas: ") and "\n" not in str(e.value)
        assert "storylens[pandas]" in str(e.value)


def test_repr_html_is_the_block_by_head_grid(scored):
    from html.parser import HTMLParser

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.titles, self.tags = [], [], set()

        def handle_starttag(self, tag, attrs):
            self.tags.add(tag)
            if tag == "tr":
                self.rows.append([])
            if tag == "td":
                self.titles.append(dict(attrs)["title"])

        def handle_data(self, data):
            if self.rows and data.strip():
                self.rows[-1].append(data.strip())

    page = scored._repr_html_()
    p = Cells()
    p.feed(page)
    assert p.tags <= {"table", "caption", "b", "br", "small", "tr", "th", "td"}  # no script, style sheet or link
    assert "http" not in page and "src=" not in page
    assert len(p.rows) == 1 + scored.n_layer and p.rows[0] == [f"H{h + 1}" for h in range(scored.n_head)]
    shown = [float(v) for row in p.rows[1:] for v in row[1:]]
    assert shown == [round(v, 3) for v in scored.column("name_mass")]  # block-major, 3 decimals
    assert p.titles[0].startswith("L1H1: ") and p.titles[-1].startswith(f"{scored.heads[-1].label}: ")
    assert html.escape(scored.title("name_mass")) in page and f"{scored.n_stories:,} stories" in page


def test_grid_html_escapes_and_shows_missing_values():
    from storylens.viz.grid_html import grid_html

    page = grid_html([[0.0, None], [float("nan"), 1.0]], "<script>alert(1)</script>", "a & b")
    assert "<script>" not in page and "&lt;script&gt;" in page and "a &amp; b" in page
    assert page.count("not computed") == 2 and 'title="L2H2: 1"' in page
    assert "background:#ffffff" in page and "background:#2166ac" in page  # the column's smallest and largest


def test_the_explorer_inline_is_the_page_of_this_table(scored, shipped_model):
    """HeadScores.explorer(): the notebook view holds every head's row and its examples, decoded by the
    model's tokenizer, as explore.html would; without the tokenizer a table with examples is refused."""
    import json
    import re

    view = scored.explorer(shipped_model.tokenizer, title="t")
    fragment = view._repr_html_()
    assert 'class="sle-root"' in fragment and "<script" in fragment
    data = json.loads(re.search(r'id="sle-[0-9a-f]+-data">(.*?)</script>', fragment, re.S)[1])
    assert len(data["rows"]) == len(scored.heads) and data["columns"] == list(scored.to_rows()[0])
    labels = [r[data["columns"].index("label")] for r in data["rows"]]
    assert labels == [h.label for h in scored.heads]
    assert data["examples"] is not None and data["meanings"]["name_mass"] == scored.columns[0].meaning
    assert "Content-Security-Policy" in view.to_html()
    with pytest.raises(ValueError, match="tokenizer"):
        scored.explorer()
