"""`storylens report` end to end on the shipped model, and its refusals."""

import csv
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from storylens.cli import main
from storylens.data.stories import EOT
from storylens.lesson.checks import unit_roundoff
from storylens.lesson.report import build_report
from storylens.lesson.summary import ReportSummary, load
from storylens.lesson.tables import LESSON_TABLE, lesson_table
from storylens.lm import wrap


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep") / "report"
    assert main(["report", "--out", str(out), "--no-progress"]) == 0
    return out


def test_report_files_and_labels(report_dir):
    for name in (
        "report.html",
        "heads.csv",
        "heads.json",
        "summary.json",
        "all_heads.png",
        "causal_mask.png",
        "name_mass.png",
        "top_name_head.png",
        "widget.html",
        "explore.html",
        "all_heads.svg",
        "name_mass.svg",
    ):
        assert (report_dir / name).stat().st_size > 0, name
    rows = list(csv.DictReader(open(report_dir / "heads.csv")))
    assert [r["label"] for r in rows] == [f"L{b}H{h}" for b in range(1, 7) for h in range(1, 5)]
    assert all(r["label"] == f"L{r['block']}H{r['head']}" for r in rows)
    assert [p.name for p in report_dir.glob(".*")] == [".storylens.json"]  # the manifest; nothing temporary
    assert [p.name for p in report_dir.parent.glob(f".{report_dir.name}.*")] == []  # no lock file left


def test_summary_agrees_with_the_table(report_dir):
    heads = json.loads((report_dir / "heads.json").read_text())
    rows = heads["heads"] if isinstance(heads, dict) else heads
    s = json.loads((report_dir / "summary.json").read_text())
    best = max(rows, key=lambda r: r["name_mass"])
    assert s["number_to_reproduce"]["head"] == best["label"]
    assert s["number_to_reproduce"]["name_mass"] == pytest.approx(best["name_mass"])
    below = sum(r["name_mass"] < s["name_heads"]["baseline"] for r in rows)
    assert s["name_heads"]["below_baseline"] == below
    assert s["quiz"]["stories"] == 200


def test_report_html_is_self_contained(report_dir):
    page = (report_dir / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?https?://""", page)
    assert "<script src" not in page
    srcs = re.findall(r"<img[^>]*\ssrc=\"([^\"]*)\"", page)
    assert len(srcs) >= 4 and all(x.startswith("data:image/png;base64,") for x in srcs)
    # the overview: a grid per column (every detector raw, then norm-weighted, then the output share,
    # as the detectors declare); the sections' score heatmaps after it (the lesson's, then the ones
    # past it). Every cell the head's value in heads.json
    from storylens.looking.detectors import BUILTIN_COLUMNS, LESSON, MORE, OVERVIEW, SINKS

    overview = dict(re.findall(r'<div class="sl-ov" data-col="([a-z0-9_]+)">(.*?)</div>', page, flags=re.S))
    raw = ["name_mass", "name_ratio", "prev_token", "prev_argmax", "prev4", "marker", "duplicate_token", "induction"]
    heads = {r["label"]: r for r in json.loads((report_dir / "heads.json").read_text())["heads"]}
    have = [
        c.name for c in BUILTIN_COLUMNS if OVERVIEW in c.shown and any(h[c.name] is not None for h in heads.values())
    ]
    assert list(overview) == have  # the causal columns only where --causal computed them
    assert list(overview)[:8] == raw and list(overview)[-2:] == ["output_share", "context_share"]
    assert all(f"norm_{c}" in overview for c in raw)
    tables = re.findall(r'<table class="slh">(.*?)</table>', page, flags=re.S)
    sections = sum(bool({LESSON, MORE} & c.shown) for c in BUILTIN_COLUMNS)
    sinks = sum(SINKS in c.shown for c in BUILTIN_COLUMNS)  # the grids of sinks and dormant heads
    assert len(tables) == len(overview) + sections + sinks
    heads = {r["label"]: r for r in json.loads((report_dir / "heads.json").read_text())["heads"]}
    for col, grid in [*overview.items(), ("name_mass", tables[len(overview)])]:
        cells = dict(re.findall(r'data-head="(L\dH\d)" data-value="([^"]+)"', grid))
        assert list(cells) == list(heads) and all(float(v) == heads[k][col] for k, v in cells.items()), col


def _limits(page: str) -> list[str]:
    """The report's honest limits, as text."""
    block = re.search(r"Three honest limits</h2>\s*<ol>(.*?)</ol>", page, flags=re.S).group(1)
    return [" ".join(re.sub(r"<[^>]+>", "", li).split()) for li in re.findall(r"<li>(.*?)</li>", block, flags=re.S)]


def test_the_limits_point_to_the_section_that_switches_heads_off(report_dir, tmp_path):
    """Limit 2 names the section of this report that switches heads off: the truth section, which
    the report writes by default; section 8 only where --beyond wrote one; none where neither ran."""
    page = (report_dir / "report.html").read_text()
    limit = _limits(page)[1]
    assert 'id="truth"' in page and "Does attention tell the truth here?" in limit and "section 8" not in limit
    assert '<a href="#truth">' in page and "<h2>8." not in page
    bare = tmp_path / "bare"
    assert main(["report", "--out", str(bare), "--truth-stories", "0", "--no-progress"]) == 0
    page = (bare / "report.html").read_text()
    limit = _limits(page)[1]
    assert 'id="truth"' not in page and "switched none off either" in limit and "section 8" not in limit


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_stories_with_no_usable_names(capsys, tmp_path):
    quiz = tmp_path / "plain.txt"
    quiz.write_text("".join(f"the cat sat on the mat number {i}. the cat was happy.\n{EOT}\n" for i in range(5)))
    out = tmp_path / "out"
    assert "no story has a main character" in _err(
        capsys, ["report", "--quiz", str(quiz), "--out", str(out), "--no-progress"]
    )
    assert not out.exists()


def test_no_stories(capsys, tmp_path):
    quiz = tmp_path / "empty.txt"
    quiz.write_text("\n")
    out = tmp_path / "out"
    assert "empty.txt: no stories" in _err(capsys, ["report", "--quiz", str(quiz), "--out", str(out)])
    assert not out.exists()


def test_unwritable_out(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert "exists and is not a folder" in _err(capsys, ["report", "--out", str(blocker)])
    assert f"{blocker} is not a folder" in _err(capsys, ["report", "--out", str(blocker / "report")])
    assert blocker.read_text() == "x"


def test_model_folder_that_is_not_one(capsys, tmp_path):
    out = tmp_path / "out"
    assert "config.json: missing" in _err(capsys, ["report", "--model", str(tmp_path), "--out", str(out)])
    assert not out.exists()


def test_the_docs_lesson_table_is_the_reports(report_dir):
    """The docs' figures come from a report run: regenerate with scripts/readme_tables.py when this fails."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.readme_tables import shown_between

    assert shown_between(LESSON_TABLE) == lesson_table(load(report_dir))


def test_the_typed_summary_is_summary_json(report_dir):
    """summary.json read into the dataclasses and written back is the same file, byte for byte."""
    text = (report_dir / "summary.json").read_text(encoding="utf-8")
    s = load(report_dir)
    assert ReportSummary.from_dict(s.to_dict()) == s
    assert s.to_json() == text
    assert s.number_to_reproduce.head == s.name_heads.top[0].head and s.beyond is None


def test_the_summary_holds_the_results_themselves(report_dir):
    """No mirror classes: the summary's parts are the analysis results (the checks, the faithfulness
    table, the leakage figures, the model as score names it), read back as those types."""
    from storylens.lesson.checks import Check
    from storylens.table.run_info import ModelInfo
    from storylens.table.truth import Truth, TruthRow

    s = load(report_dir)
    assert isinstance(s.model, ModelInfo) and all(isinstance(c, Check) for c in s.numerics) and s.numerics
    assert isinstance(s.faithfulness, Truth) and isinstance(s.faithfulness.rows[0], TruthRow)
    assert s.faithfulness.stories_chosen and isinstance(s.faithfulness.agreements[0].moves, tuple)


def test_report_options_are_checked_once_when_built():
    from storylens.core.errors import UsageError
    from storylens.lesson.report import ReportOptions

    for bad in ({"batch_size": 0}, {"prev_limit": -1}, {"word": "two words"}, {"truth_stories": -1}, {"examples": -2}):
        with pytest.raises(UsageError):
            ReportOptions(**bad)


def test_the_page_escapes_a_hostile_model_name_and_quiz_name(tmp_path, shipped_model):
    """A model and a quiz file named like markup come out as text on the page, never as tags."""
    evil = "<script>window.__pwned=1</script>"
    quiz = tmp_path / "<img src=x onerror=alert(2)>.txt"
    quiz.write_text(
        "".join(
            f"Once upon a time {n} went to the park. {n} saw a big red ball. {n} was happy and played all day.\n{EOT}\n"
            for n in ("Lily", "Tom", "Mia", "Ben")
        )
    )
    report = build_report(
        tmp_path / "r",
        model=wrap(shipped_model, name=evil),
        quiz=str(quiz),
        progress=False,
        check_stories=1,
        check_tokens=4,
    )
    page = (tmp_path / "r" / "report.html").read_text()
    assert report.summary.model.display_name == evil and "<img src=x" in report.summary.quiz.source
    assert evil not in page and "<img src=x" not in page
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page and "&lt;img src=x onerror=alert(2)&gt;.txt" in page


@pytest.mark.slow  # a whole report; user detectors are one kind with the built-in ones in the fast tier (test_scores)
def test_a_user_detector_from_a_file(tmp_path, capsys):
    """--detector FILE: a pattern over token ids becomes a column of the head table. Attention on
    the opening marker from every later query is exactly the lesson's marker score."""
    det = tmp_path / "opening.py"
    det.write_text(
        "import torch\nNAME = 'opening'\n\ndef pattern(ids):\n"
        "    w = torch.zeros(ids.shape[0], ids.shape[1], ids.shape[1])\n"
        "    w[:, 1:, 0] = 1.0\n    return w\n"
    )
    out = tmp_path / "rep"
    assert main(["report", "--detector", str(det), "--out", str(out), "--no-progress"]) == 0
    heads = json.loads((out / "heads.json").read_text())["heads"]
    # two float32 paths (a weighted sum over keys, a product with the marker column), each summing
    # <= 256 keys and averaging <= 256 queries of totals <= 1: each within 2 * 256 * u of the exact mean
    tol = 2 * (2 * 256 * unit_roundoff(torch.float32))
    assert all(abs(h["opening"] - h["marker"]) <= tol for h in heads)
    # its norm-weighted twin is a column too (the marker's, the same keys), not a second user detector
    assert all(abs(h["norm_opening"] - h["norm_marker"]) <= tol for h in heads)
    page = (out / "report.html").read_text()
    assert "Detector opening" in page and "Detector norm_opening" not in page
    summary = load(out)
    assert {r.detector for r in summary.faithfulness.rows} >= {"opening", "prev_argmax"}
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('no')\n")
    assert "--detector" in _err(capsys, ["report", "--detector", str(bad), "--out", str(tmp_path / "x")])
    (tmp_path / "none.py").write_text("X = 1\n")
    assert "defines no function pattern" in _err(
        capsys, ["report", "--detector", str(tmp_path / "none.py"), "--out", str(tmp_path / "y")]
    )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_faithfulness_section_is_the_head_table(report_dir):
    """Where heads look, what they move, what they matter for: the rows are the top heads of the head
    table itself, with its raw and norm-weighted columns; the docs' table is this report's."""
    import math
    import sys

    from storylens.data.names import name_vocabulary
    from storylens.data.stories import load_split
    from storylens.engine.encode import encode_stories
    from storylens.lm import load_lm
    from storylens.looking.detectors import BUILTIN_DETECTORS, TRUTH
    from storylens.table.scores import HeadScores
    from storylens.table.truth import TRUTH_HEADS, TRUTH_STORIES, truth_budget_stories

    f = load(report_dir).faithfulness
    DETECTORS = [d.name for d in BUILTIN_DETECTORS if TRUTH in d.shown]  # the detectors the table checks
    assert DETECTORS[:7] == [
        "name_mass",
        "prev_token",
        "prev_argmax",
        "prev4",
        "marker",
        "duplicate_token",
        "induction",
    ]
    heads = {h["label"]: h for h in json.loads((report_dir / "heads.json").read_text())["heads"]}
    for d in DETECTORS:
        rows = [r for r in f.rows if r.detector == d]
        top = sorted(heads.values(), key=lambda h: -h[d])[:TRUTH_HEADS]
        assert [r.head for r in rows] == [h["label"] for h in top], d
        for r in rows:
            h = heads[r.head]
            assert (r.raw, r.norm, r.share) == (h[d], h["norm_" + d], h["output_share"])
            assert math.isfinite(r.zero_increase) and math.isfinite(r.mean_increase)
            assert r.where == ("name tokens" if d == "name_mass" else "next tokens")
            assert r.dormant == bool(h["dormant"])
    assert {a.detector for a in f.agreements} == set(DETECTORS)
    assert all(a.rho is None or -1 <= a.rho <= 1 for a in f.agreements)
    assert len(f.sentences) == len(DETECTORS) + 1
    # the first stories the ablations' budget allows, and the report says how they were chosen
    lm = load_lm()
    quiz = load_split().quiz
    lengths = [len(e.ids) for e in encode_stories(lm, quiz, name_vocabulary(quiz))]
    assert f.n_stories == truth_budget_stories(lm, HeadScores.from_json(report_dir / "heads.json"), lengths)
    assert f.stories_chosen.startswith(
        f"the first {f.n_stories} quiz stories, as many of the first {TRUTH_STORIES} as fit"
    )
    page = (report_dir / "report.html").read_text()
    assert "rank correlation" in page and all(f"{a.rho:.3f}" in page for a in f.agreements if a.rho is not None)
    examples = json.loads((report_dir / "examples.json").read_text())
    assert [h["label"] for h in examples["heads"]] == list(heads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.readme_tables import shown_between, truth_table

    assert shown_between("truth") == truth_table(f), "regenerate the docs with scripts/readme_tables.py"


def test_the_ablation_note_says_how_its_stories_were_chosen(shipped_model, corpus_split):
    from storylens.data.names import name_vocabulary
    from storylens.engine.encode import encode_stories
    from storylens.lesson.report import _truth_stories_note
    from storylens.lm import NativeLM
    from storylens.table.scores import score_heads
    from storylens.table.truth import truth_budget_stories

    lm = NativeLM(shipped_model)
    quiz = corpus_split.quiz[:3]
    encoded = encode_stories(lm, quiz, name_vocabulary(quiz))
    scores = score_heads(lm, encoded, progress=False)
    note = _truth_stories_note(lm, scores, encoded, 3, asked=10)
    assert note.startswith("the first 3 quiz stories, as asked (--truth-stories) (asked 10; the quiz holds 3): ")
    assert _truth_stories_note(lm, scores, encoded, 1, asked=1).startswith("the first quiz story, as asked")
    n = truth_budget_stories(lm, scores, [len(e.ids) for e in encoded])
    assert n == 3  # three short stories fit the teraflop on the shipped model
    note = _truth_stories_note(lm, scores, encoded, n, asked=None)
    assert note.startswith("the first 3 quiz stories, as many of the first 3 as fit the ablations' budget")
    assert "--truth-stories 3 runs" not in note  # nothing more to offer
