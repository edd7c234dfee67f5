"""Versioned outputs: heads.json, examples.json and summary.json of real runs (storylens score and
report on the shipped model, a few stories) and patch.json (storylens patch on a few example pairs)
carry schema_version and validate against the package's JSON Schemas, the heads schema naming every
column table_columns declares; load_heads and load_patch read a run back as typed results or frames;
an older run's files are one line, not a KeyError."""

import json
import shutil
from dataclasses import fields

import pytest

jsonschema = pytest.importorskip("jsonschema")

from storylens import load_heads, load_patch  # noqa: E402
from storylens.cli import main  # noqa: E402
from storylens.core.errors import StorylensError  # noqa: E402
from storylens.core.schema import SCHEMA_VERSION, SCHEMAS, heads_schema, schema  # noqa: E402
from storylens.corpus.summary import ScoreSummary  # noqa: E402
from storylens.data.stories import EOT  # noqa: E402
from storylens.effects.patching import CSV_COLUMNS, EXAMPLE_PAIRS, PatchResult, read_pairs  # noqa: E402
from storylens.lesson.summary import ReportSummary  # noqa: E402
from storylens.looking.detectors import BUILTIN_DETECTORS, FLAG, table_columns  # noqa: E402
from storylens.table.scores import HeadScores  # noqa: E402

N = 6


@pytest.fixture(scope="module")
def score_run(corpus_split, tmp_path_factory):
    d = tmp_path_factory.mktemp("score")
    (d / "s.txt").write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:N]))
    argv = ["score", "--stories", str(d / "s.txt"), "--out", str(d / "run"), "--no-progress", "--examples", "2"]
    assert main(argv) == 0
    return d / "run"


def validate(doc, sch):
    jsonschema.validators.validator_for(sch)(sch, format_checker=None).validate(doc)


def builtin_columns():
    return [c.name for c in table_columns(BUILTIN_DETECTORS) if c != FLAG]


def test_schemas_are_valid_draft_2020_12():
    for name in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema(name))
    jsonschema.Draft202012Validator.check_schema(heads_schema(builtin_columns()))


def test_a_score_run_validates(score_run):
    heads = json.loads((score_run / "heads.json").read_text())
    assert heads["schema_version"] == SCHEMA_VERSION == 1
    validate(heads, heads_schema(builtin_columns()))  # every declared column, in the table's order
    validate(json.loads((score_run / "examples.json").read_text()), schema("examples"))
    summary = json.loads((score_run / "summary.json").read_text())
    validate(summary, schema("summary-score"))
    optional = {"audit", "exact", "estimators", "backups"}  # only where run: tests/test_score_audit.py validates them
    sch = schema("summary-score")
    assert sch["required"] == ["schema_version", *(f.name for f in fields(ScoreSummary) if f.name not in optional)]
    assert set(sch["properties"]) == {*sch["required"], *optional}


def test_the_heads_schema_follows_the_declared_columns(score_run):
    heads = json.loads((score_run / "heads.json").read_text())
    sch = heads_schema([*builtin_columns(), "new_column"])  # a column declared later is required by name
    with pytest.raises(jsonschema.ValidationError, match="new_column"):
        validate(heads, sch)
    heads["heads"][0]["name_mass"] = "high"
    with pytest.raises(jsonschema.ValidationError):
        validate(heads, schema("heads"))


@pytest.mark.slow  # the whole report on the shipped model (its figures, checks and faithfulness pass)
def test_a_report_validates(tmp_path):
    out = tmp_path / "report"
    assert main(["report", "--out", str(out), "--no-progress", "--truth-stories", "0"]) == 0
    validate(json.loads((out / "heads.json").read_text()), heads_schema(builtin_columns()))
    summary = json.loads((out / "summary.json").read_text())
    validate(summary, schema("summary-report"))
    assert set(schema("summary-report")["properties"]) == {"schema_version", *(f.name for f in fields(ReportSummary))}
    run = load_heads(out)
    assert isinstance(run.summary, ReportSummary) and run.summary.to_dict() == summary


def test_load_heads_reads_a_run_back(score_run):
    run = load_heads(score_run)
    assert isinstance(run.heads, HeadScores) and isinstance(run.summary, ScoreSummary)
    assert run.heads.to_rows() == HeadScores.from_json(score_run / "heads.json").to_rows()
    assert run.summary.to_dict() == json.loads((score_run / "summary.json").read_text())
    assert run.examples == json.loads((score_run / "examples.json").read_text())


def test_load_heads_as_pandas(score_run):
    pd = pytest.importorskip("pandas")
    run = load_heads(score_run, as_pandas=True)
    pd.testing.assert_frame_equal(run.heads, pd.read_csv(score_run / "heads.csv"), check_exact=True)
    doc = json.loads((score_run / "examples.json").read_text())
    n = sum(len(kept) for h in doc["heads"] for kept in h["examples"].values())
    assert len(run.examples) == n > 0
    assert run.examples.iloc[0]["tokens"] == doc["heads"][0]["examples"][doc["detectors"][0]][0]["tokens"]


@pytest.mark.parametrize("file", ["heads.json", "examples.json", "summary.json"])
def test_an_older_or_other_run_is_one_line(score_run, tmp_path, file):
    for change, said in [
        (lambda d: d.pop("schema_version"), "written by an older storylens (no schema_version"),
        (lambda d: d.update(schema_version=2), "schema_version 2, but this storylens reads version 1"),
        (lambda d: d.pop("heads" if "heads" in d else "model"), f"{file}: not a "),
    ]:
        old = tmp_path / "old"
        shutil.rmtree(old, ignore_errors=True)
        shutil.copytree(score_run, old)
        doc = json.loads((old / file).read_text())
        change(doc)
        (old / file).write_text(json.dumps(doc))
        for as_pandas in (False, True):
            with pytest.raises(StorylensError) as e:
                load_heads(old, as_pandas=as_pandas)
            assert said in str(e.value) and str(e.value).startswith(str(old / file)) and "\n" not in str(e.value)


def test_not_a_run_is_one_line(tmp_path):
    with pytest.raises(StorylensError, match="no heads.json"):
        load_heads(tmp_path)


# ---------------------------------------------------------------- patch.json

PAIRS = 3


@pytest.fixture(scope="module")
def patch_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("patch")
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_pairs(EXAMPLE_PAIRS)[:PAIRS]))
    assert main(["patch", "--pairs", str(d / "p.jsonl"), "--out", str(d / "run"), "--no-progress"]) == 0
    return d / "run"


def test_a_patch_run_validates_and_reads_back(patch_run):
    doc = json.loads((patch_run / "patch.json").read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and list(doc)[0] == "schema_version"
    validate(doc, schema("patch"))
    optional = {"estimator", "estimate_spearman", "backups"}  # --estimator, --backups: a run before them lacks them
    assert schema("patch")["required"] == [
        "schema_version",
        *(f.name for f in fields(PatchResult) if f.name not in optional),
    ]
    assert set(schema("patch")["properties"]) == {"schema_version", *(f.name for f in fields(PatchResult))}
    result = load_patch(patch_run)
    assert isinstance(result, PatchResult) and result.pairs == PAIRS
    assert {"schema_version": SCHEMA_VERSION, **result.to_dict()} == doc  # every field, every float
    assert load_patch(patch_run / "patch.json") == result
    doc["heads"][0]["atp"] = "large"
    with pytest.raises(jsonschema.ValidationError):
        validate(doc, schema("patch"))


def test_patch_to_pandas(patch_run):
    pd = pytest.importorskip("pandas")
    result = load_patch(patch_run)
    heads = result.to_pandas()
    assert list(heads.columns) == list(CSV_COLUMNS) and len(heads) == result.n_layer * result.n_head
    assert heads["atp"].tolist() == [h.atp for h in result.heads]  # the very floats
    csv = pd.read_csv(patch_run / "patch.csv")  # written with 9 significant digits
    pd.testing.assert_frame_equal(heads, csv, check_exact=False, rtol=1e-8, atol=0)
    pairs = result.to_pandas("pairs")
    assert len(pairs) == PAIRS and pairs["clean_metric"].tolist() == [p.clean_metric for p in result.per_pair]
    with pytest.raises(ValueError, match="heads"):
        result.to_pandas("other")


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda d: d.pop("schema_version"), "written by an older storylens (no schema_version"),
        (lambda d: d.update(schema_version=2), "schema_version 2, but this storylens reads version 1"),
        (lambda d: d.pop("heads"), "'heads' is a required property"),
    ],
)
def test_an_older_or_other_patch_json_is_one_line(patch_run, tmp_path, change, said):
    doc = json.loads((patch_run / "patch.json").read_text())
    change(doc)
    (tmp_path / "patch.json").write_text(json.dumps(doc))
    with pytest.raises(StorylensError) as e:
        load_patch(tmp_path)
    assert said in str(e.value) and str(e.value).startswith(str(tmp_path / "patch.json")) and "\n" not in str(e.value)
    with pytest.raises(StorylensError, match="cannot read"):
        load_patch(tmp_path / "nowhere")
