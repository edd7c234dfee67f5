"""Issue 61, class 9: results are read back as strictly as they are written. Every reader of a result file
(load_patch, load_heads with its examples and summary, load_circuit) checks the file against its own schema
and its model's shape, and a file that is not what storylens wrote is one StorylensError line naming it:
a table of hostile edits of real runs (the shipped model), each of which the reader used to accept or
answer with a raw exception. A case the next class finds is one more row."""

import json
import os
import shutil

import pytest

from storylens import load_circuit, load_heads, load_patch
from storylens.circuits.edges import Graph
from storylens.circuits.faithfulness import Faithfulness
from storylens.circuits.run import CircuitResult, EdgeRow, circuit_json
from storylens.cli import main
from storylens.core import schema as schema_module
from storylens.core.errors import StorylensError
from storylens.data.stories import EOT
from storylens.effects.patching import EXAMPLE_PAIRS, read_pairs


@pytest.fixture(scope="module")
def runs(corpus_split, tmp_path_factory):
    """A patch run (3 pairs), a score run (4 quiz stories, with examples and summary) and a circuit.json of a
    grouped 2 x 4 model's whole graph."""
    d = tmp_path_factory.mktemp("runs")
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_pairs(EXAMPLE_PAIRS)[:3]))
    assert main(["patch", "--pairs", str(d / "p.jsonl"), "--out", str(d / "patch"), "--no-progress"]) == 0
    (d / "s.txt").write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:4]))
    argv = ["score", "--stories", str(d / "s.txt"), "--out", str(d / "score"), "--no-progress", "--examples", "2"]
    assert main(argv) == 0
    g = Graph(2, 4, 2)
    edges = [EdgeRow(g.writers[u], r, 0.5, 0.1, False) for v, r in enumerate(g.receivers) for u in range(g.upstream(v))]
    f = Faithfulness([0.5, 1.0], [3, 6], [3, 6], [0.4, 1.0], [0.1, 0.0], 0.7, 0.1, 0.3, 0.1, 1.0, 0.1, -1.0, 0.1)
    result = CircuitResult("m", "pairs", "corrupt", 2, None, None, "x", "eap", None, 1.0, 0.1, -1.0, 0.1, "v", 2, 4, 2,
                           g.n_edges, f, None, None, edges, None, None)  # fmt: skip
    (d / "circuit").mkdir()
    (d / "circuit" / "circuit.json").write_text(circuit_json(result))
    return d


def _swap_first_two(rows):
    rows[0], rows[1] = rows[1], rows[0]


PATCH = [  # (what, edit of patch.json, words the one line must hold)
    ("a string where a number belongs", lambda d: d["heads"][0].update(atp="large"), "'large' is not of type"),
    ("a boolean metric", lambda d: d.update(clean_metric=True), "True is not of type 'number'"),
    ("rho 5", lambda d: d.update(spearman=5), "5 is greater than the maximum of 1"),
    ("no heads", lambda d: d.update(heads=[]), "should be non-empty"),
    ("an extra key", lambda d: d.update(extra=1), "'extra' was unexpected"),
    ("a head twice", lambda d: d["heads"].__setitem__(1, dict(d["heads"][0])), "head 2 is block 0, head 0"),
    ("a head missing", lambda d: d["heads"].pop(), "23 heads, not the 24"),
    ("heads out of order", lambda d: _swap_first_two(d["heads"]), "head 1 is block 0, head 1"),
    ("a label not its position", lambda d: d["heads"][0].update(head="L1H2"), "labelled 'L1H2'"),
    ("a pair missing", lambda d: d["per_pair"].pop(), "2 pairs listed, but pairs is 3"),
    ("exact heads miscounted", lambda d: d.update(exact_heads=1), "but exact_heads is 1"),
    ("a negative error", lambda d: d.update(clean_metric_se=-1.0), "less than the minimum of 0"),
]

HEADS = [  # edits of heads.json
    ("a NaN score", lambda d: d["heads"][0].update(name_mass=float("nan")), "NaN is not a JSON number"),
    ("an infinite score", lambda d: d["heads"][0].update(name_mass=float("inf")), "Infinity is not a JSON number"),
    ("a string score", lambda d: d["heads"][0].update(name_mass="high"), "'high' is not of type"),
    ("no heads", lambda d: d.update(heads=[]), "should be non-empty"),
    ("23 of 24 heads", lambda d: d["heads"].pop(), "23 heads, not the 24"),
    ("a head twice", lambda d: d["heads"].__setitem__(5, dict(d["heads"][4])), "head 6 is block 2, head 1"),
    ("a declared column missing", lambda d: d["heads"][3].pop("name_mass"), "'name_mass' is a required property"),
    ("a label not its position", lambda d: d["heads"][2].update(label="L2H3"), "labelled 'L2H3'"),
    ("a negative count", lambda d: d["counts"].update(n_stories=-4), "less than the minimum of 0"),
]

OTHER = [  # (file, edit, words): the score run's other files, and circuit.json
    ("examples.json", lambda d: d.update(k="two"), "'two' is not of type 'integer'"),
    ("examples.json", lambda d: d["heads"][0].update(rogue=1), "'rogue' was unexpected"),
    ("summary.json", lambda d: d.update(stories="many"), "'many' is not of type"),
    ("circuit.json", lambda d: d["edges"].pop(), "edges listed"),
    ("circuit.json", lambda d: d["edges"][0].update(writer="L1H1"), "edge 1 is L1H1 -> L1H1.q, not the graph's input"),
    ("circuit.json", lambda d: d.update(n_kv_head=3), "do not share 3 key/value heads evenly"),
    ("circuit.json", lambda d: d.update(n_layer=10**9), "for 1000000000 x 4"),
    ("circuit.json", lambda d: d["edges"][0].update(score=float("nan")), "NaN is not a JSON number"),
    ("circuit.json", lambda d: d["faithfulness"]["f"].pop(), "not one entry per size"),
    ("circuit.json", lambda d: d["edges"][0].update(score_se=-0.1), "less than the minimum of 0"),
]


def _edited(runs, tmp_path, folder, file, edit):
    copy = tmp_path / folder
    shutil.copytree(runs / folder, copy)
    doc = json.loads((copy / file).read_text())
    edit(doc)
    (copy / file).write_text(json.dumps(doc))  # NaN and Infinity written as Python writes them
    return copy


def _one_line(call, where, words):
    with pytest.raises(StorylensError) as e:
        call()
    said = str(e.value)
    assert said.startswith(str(where)) and "\n" not in said and words in said, said


@pytest.mark.parametrize("what, edit, words", PATCH, ids=[c[0] for c in PATCH])
def test_patch_json_is_read_back_strictly(runs, tmp_path, what, edit, words):
    copy = _edited(runs, tmp_path, "patch", "patch.json", edit)
    _one_line(lambda: load_patch(copy), copy / "patch.json", words)


@pytest.mark.parametrize("what, edit, words", HEADS, ids=[c[0] for c in HEADS])
def test_heads_json_is_read_back_strictly(runs, tmp_path, what, edit, words):
    copy = _edited(runs, tmp_path, "score", "heads.json", edit)
    for as_pandas in (False, True):
        _one_line(lambda p=as_pandas: load_heads(copy, as_pandas=p), copy / "heads.json", words)


@pytest.mark.parametrize("file, edit, words", OTHER, ids=[f"{c[0]}-{c[2][:20]}" for c in OTHER])
def test_the_other_results_are_read_back_strictly(runs, tmp_path, file, edit, words):
    folder = "circuit" if file == "circuit.json" else "score"
    copy = _edited(runs, tmp_path, folder, file, edit)
    load = load_circuit if folder == "circuit" else load_heads
    _one_line(lambda: load(copy), copy / file, words)


def test_the_unedited_runs_read_back(runs):
    assert load_patch(runs / "patch").pairs == 3
    assert len(load_heads(runs / "score").heads.heads) == 24
    assert load_circuit(runs / "circuit").n_edges == Graph(2, 4, 2).n_edges


def test_deep_nesting_a_fifo_and_an_oversized_file_are_one_line(runs, tmp_path, monkeypatch):
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "patch.json").write_text("[" * 100_000 + "]" * 100_000)  # past Python's parser: RecursionError
    _one_line(lambda: load_patch(deep), deep / "patch.json", "nested too deeply")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "circuit.json")  # opening it would wait for a writer forever
    _one_line(lambda: load_circuit(fifo), fifo / "circuit.json", "not a regular file")
    monkeypatch.setattr(schema_module, "MAX_RESULT_BYTES", 1000)  # the bound it reads with
    _one_line(lambda: load_patch(runs / "patch"), runs / "patch" / "patch.json", "a file of its kind can have")
