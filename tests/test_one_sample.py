"""Issue 61, class 4: an error that cannot be estimated (one pair, one story) is absent, and no sign is claimed
without it, everywhere. A table of commands run on one pair or one story of the shipped model: every JSON file
they write is strict JSON (no NaN, no Infinity) that its schema accepts and its reader reads back, no CSV cell is
``nan``, and what they print never shows ``± 0.000``, ``± nan`` or an effect outside brackets with no error
(``(+0.123, no error)`` is how one is written). The rule itself (storylens.core.figures) and the drawn tables
(HeadScores' grid) are checked on their own below."""

import json
import math

import numpy as np
import pytest

from storylens import load_circuit, load_heads, load_patch
from storylens.cli import main
from storylens.core.figures import bracketed, csv_cell, plus_minus, sign_claimed
from storylens.core.schema import check_schema, schema
from storylens.data.stories import EOT
from storylens.effects.patching import NAME_PAIRS, read_pairs
from storylens.viz.tables import head_heatmap_html


def _strict(path):
    def refuse(name):
        raise AssertionError(f"{path.name} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def one(corpus_split, tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    keys = ("clean", "corrupt", "answer", "wrong")
    (d / "p.jsonl").write_text(json.dumps({k: read_pairs(NAME_PAIRS)[0][k] for k in keys}) + "\n")
    (d / "s.txt").write_text(f"{corpus_split.quiz[0]}\n{EOT}\n")
    return d


RUNS = [  # (name, argv after the input, the input, the reader, the files and their schemas)
    ("patch", ["patch", "--estimator", "ig", "--backups", "2"], "p.jsonl", load_patch, {"patch.json": "patch"}),
    ("circuit", ["circuit", "--oracle", "2", "--resamples", "2"], "p.jsonl", load_circuit, {"circuit.json": "circuit"}),
    ("circuit-stories", ["circuit", "--ablation", "mean", "--oracle", "2"], "s.txt", load_circuit,
     {"circuit.json": "circuit"}),
    ("score-causal", ["score", "--causal", "--audit", "2", "--backups", "2"], "s.txt", load_heads,
     {"summary.json": "summary-score", "heads.json": None}),
]  # fmt: skip


@pytest.mark.parametrize("name, argv, source, reader, files", RUNS, ids=[r[0] for r in RUNS])
def test_one_sample_writes_no_error_and_claims_no_sign(one, tmp_path, capsys, name, argv, source, reader, files):
    flag = "--pairs" if source.endswith("jsonl") else "--stories"
    out = tmp_path / name
    assert main([*argv, flag, str(one / source), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    for bad in ("± 0.000", "± 0.0000", "nan", "NaN"):
        assert bad not in printed, f"{name} printed {bad!r}"
    assert "no error" in printed
    for file, sch in files.items():
        doc = _strict(out / file)
        if sch:
            check_schema(doc, schema(sch), str(out / file))
    for csv in out.glob("*.csv"):
        cells = [c for line in csv.read_text().splitlines() for c in line.split(",")]
        assert "nan" not in cells and "NaN" not in cells, csv.name
    reader(out)


def test_the_rule():
    assert not sign_claimed(0.5, None) and not sign_claimed(0.5, math.nan) and not sign_claimed(0.5, 0.25)
    assert sign_claimed(0.5, 0.2) and sign_claimed(-0.5, 0.2) and not sign_claimed(math.nan, 0.1)
    assert plus_minus(0.5, math.nan, one="pair") == "+0.500 (no error: one pair)"
    assert bracketed(0.5, None) == "(+0.500, no error)" and bracketed(0.5, 0.3) == "(+0.500 ± 0.300)"
    assert bracketed(0.5, 0.1) == "+0.500 ± 0.100" and bracketed(math.nan, 0.1) == ""
    assert csv_cell(math.nan) == csv_cell(None) == "" and csv_cell(0.25) == "0.25" and csv_cell(3) == "3"


def test_a_drawn_table_brackets_a_value_with_no_error():
    grid = np.array([[0.5, -0.5]])
    page = head_heatmap_html(grid, title="t", errors=np.array([[math.nan, 0.1]]))
    first, second = (
        page.split('data-head="L1H1"')[1].split("</td>")[0],
        page.split('data-head="L1H2"')[1].split("</td>")[0],
    )
    assert ">(0.50" in first and "no error" in first  # no error: in brackets, and said
    assert ">-0.50" in second and "no sign" not in second  # five errors from zero: its sign stands
