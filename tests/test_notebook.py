"""The lesson notebook runs end to end on the shipped model and shows its pictures and widgets."""

import re
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "lesson_02.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    path = tmp_path_factory.mktemp("nb")
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path)}}
    ).execute()
    return nb


def _tags(cell):
    return set(cell.get("metadata", {}).get("tags", []))


def test_no_cell_raised(executed):
    assert not any(o.get("output_type") == "error" for c in executed.cells for o in c.get("outputs", []))


def test_every_figure_cell_shows_a_picture_and_every_widget_cell_html(executed):
    figures = [c for c in executed.cells if "figure" in _tags(c)]
    widgets = [c for c in executed.cells if "widget" in _tags(c)]
    assert len(figures) >= 5 and len(widgets) >= 3
    for c in figures:
        assert any("image/png" in o.get("data", {}) for o in c.outputs), c.source[:80]
    pictures = sum("image/png" in o.get("data", {}) for c in figures for o in c.outputs)
    assert pictures >= 7, pictures
    for c in widgets:
        html = [o["data"]["text/html"] for o in c.outputs if "text/html" in o.get("data", {})]
        assert html and "slw-root" in "".join(html), c.source[:80]


def test_it_measures_on_this_machine_and_teaches(executed):
    text = "\n".join(
        o.get("text", "")
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("name") == "stdout"
    )
    assert "fused vs explicit logits" in text and "float64" in text
    assert "cache 200 vs recompute 20,100" in text
    assert re.search(r"L\dH\d  name mass 0\.\d{3}", text)
    prose = sum(len(c.source) for c in executed.cells if c.cell_type == "markdown")
    assert prose > 7000, prose
    # check-yourself answers are folded until the reader opens them
    answers = [c for c in executed.cells if c.cell_type == "markdown" and "<details>" in c.source]
    assert len(answers) == 3
    # the first code cell installs storylens only where it is missing (Colab)
    first = next(c for c in executed.cells if c.cell_type == "code")
    assert 'find_spec("storylens") is None' in first.source and "pip install" in first.source
