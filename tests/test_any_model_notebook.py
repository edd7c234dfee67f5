"""The practitioner's notebook (notebooks/any_model.ipynb) runs end to end on a transformers model
read from a folder: a small seeded Llama with grouped key/value heads, saved here with storylens's
tokenizer and never trained. Every tagged cell shows what its tag promises, counted from the
notebook's own cells, and the notebook on disk is what notebooks/make_any_model.py writes."""

import json
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "any_model.ipynb"
MAKER = ROOT / "notebooks" / "make_any_model.py"
N_LAYER, N_HEAD, N_KV_HEAD = 4, 4, 2


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A seeded random Llama (rotary positions, RMSNorm, 4 query heads sharing 2 key/value heads)
    with storylens's tokenizer, saved as transformers saves any model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from storylens.model.hub import load_model

    native = load_model().tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_object=native, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV_HEAD,
        max_position_embeddings=256,
        vocab_size=native.get_vocab_size(),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def executed(llama_folder, tmp_path_factory):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("pandas")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    path = tmp_path_factory.mktemp("nb")
    with pytest.MonkeyPatch.context() as mp:  # the kernel inherits this process's environment
        mp.setenv("STORYLENS_MODEL", str(llama_folder))
        nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path)}}
        ).execute()
    return nb, path


def _tags(cell):
    return set(cell.get("metadata", {}).get("tags", []))


def _outputs(cell, mime):
    return [o["data"][mime] for o in cell.get("outputs", []) if mime in o.get("data", {})]


def _stdout(nb):
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stdout")


def test_the_notebook_on_disk_is_what_the_script_writes(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    written = []
    monkeypatch.setattr(nbformat, "write", lambda nb, out: written.append((nb, Path(out))))
    runpy.run_path(str(MAKER), run_name="__main__")  # builds the notebook; the write is caught here
    ((nb, out),) = written
    assert out == NOTEBOOK
    on_disk = nbformat.read(NOTEBOOK, as_version=4)
    assert nbformat.reads(nbformat.writes(nb), as_version=4) == on_disk, (
        "notebooks/any_model.ipynb is not what notebooks/make_any_model.py writes: run it"
    )


def test_no_cell_raised_and_it_read_the_folder(executed):
    nb, _ = executed
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    text = _stdout(nb)  # the folder's model, not the shipped one (6 x 4) the notebook falls back to
    assert f"{N_LAYER} blocks x {N_HEAD} heads" in text and "is not set" not in text


def test_every_tagged_cell_shows_what_its_tag_promises(executed):
    nb, _ = executed
    figures = [c for c in nb.cells if "figure" in _tags(c)]
    widgets = [c for c in nb.cells if "widget" in _tags(c)]
    tables = [c for c in nb.cells if "table" in _tags(c)]
    assert figures and widgets and tables
    for c in figures:  # one picture per display( in the cell, and nothing else drawn
        assert len(_outputs(c, "image/png")) == c.source.count("display("), c.source[:80]
    pictures = sum(len(_outputs(c, "image/png")) for c in figures)
    assert pictures == sum(c.source.count("display(") for c in figures)
    untagged = [c for c in nb.cells if c.cell_type == "code" and not _tags(c) & {"figure"}]
    assert not any(_outputs(c, "image/png") for c in untagged)  # every picture is counted
    for c in widgets:  # a storylens view: its root element and its script
        html = "".join(_outputs(c, "text/html"))
        assert ("sle-root" in html or "slw-root" in html) and "<script" in html, c.source[:80]
    for c in tables:  # a data frame or a head grid, as HTML
        html = "".join(_outputs(c, "text/html"))
        assert "<table" in html, c.source[:80]


def test_the_explorer_holds_every_head_and_its_examples(executed):
    nb, _ = executed
    (cell,) = [c for c in nb.cells if "widget" in _tags(c) and "explorer(" in c.source]
    html = "".join(_outputs(cell, "text/html"))
    data = json.loads(
        re.search(r'<script type="application/json" id="sle-[0-9a-f]+-data">(.*?)</script>', html, re.S)[1]
    )
    assert len(data["rows"]) == N_LAYER * N_HEAD and data["examples"] is not None
    for c in ("sink_rate", "context_share", "atp_mean", "atp_mean_se", "dla", "dormant"):
        assert c in data["columns"]


def test_the_causal_and_patch_cells_measured(executed):
    nb, path = executed
    text = _stdout(nb)
    assert re.search(r"heads audited on 8 stories .* Spearman rho, AtP vs exact: mean -?\d\.\d{3}", text)
    assert "20 pairs on" in text and f"exact patching on {N_LAYER * N_HEAD} of {N_LAYER * N_HEAD} heads" in text
    assert (path / "patch-run" / "patch.json").is_file() and "read back equal: True" in text
