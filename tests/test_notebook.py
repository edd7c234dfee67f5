"""The lesson notebook runs end to end on the shipped model."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "lesson_02.ipynb"


def test_lesson_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("name") == "stdout"
    )
    assert "The number to reproduce: L" in text
    assert "same tokens: True" in text
    html = [o for c in nb.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {})]
    assert len(html) >= 2  # the toy widget and the model's widget rendered as HTML
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
