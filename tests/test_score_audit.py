"""storylens score --causal --audit K: the report's audit of AtP against exact ablation, run after the
scoring on the first stories of the corpus, within the ablations' budget; written to summary.json (its
schema) and audit.csv, and printed. On a tiny seeded Llama with grouped key/value heads saved here, in
float64: the run's audit is the one :func:`storylens.effects.audit.audit_stories` computes on the same
stories, its cost is said before the scoring, and past the budget it is refused with nothing written."""

import csv
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from storylens.cli import main  # noqa: E402
from storylens.core.schema import schema  # noqa: E402
from storylens.data.names import name_vocabulary  # noqa: E402
from storylens.data.stories import EOT  # noqa: E402
from storylens.effects.audit import AUDIT_CSV, audit_budget_stories, audit_cost, audit_passes, audit_stories
from storylens.effects.cost import block_flops, head_flops  # noqa: E402
from storylens.engine.encode import encode_stories  # noqa: E402
from storylens.lm import load_lm  # noqa: E402

N, K, AUDITED = 8, 2, 3


@pytest.fixture(scope="module")
def folder(shipped_model, tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = LlamaConfig(
        vocab_size=shipped_model.tokenizer.get_vocab_size(),
        bos_token_id=tok.bos_token_id,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def texts(corpus_split):
    return [" ".join(s.split()[:40]) for s in corpus_split.quiz[:N]]


@pytest.fixture(scope="module")
def stories(texts, tmp_path_factory):
    path = tmp_path_factory.mktemp("stories") / "s.txt"
    path.write_text("".join(f"{s}\n{EOT}\n" for s in texts))
    return path


def _argv(folder, stories, out, *more):
    return ["score", "--model", str(folder), "--dtype", "float64", "--stories", str(stories), "--out", str(out),
            "--no-progress", "--examples", "0", "--batch-size", "4", *more]  # fmt: skip


@pytest.fixture(scope="module")
def run(folder, stories, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    assert main(_argv(folder, stories, out, "--causal", "--audit", str(K), "--audit-stories", str(AUDITED))) == 0
    return out


def test_the_run_holds_the_audit_the_report_runs_on_the_same_stories(run, folder, texts):
    summary = json.loads((run / "summary.json").read_text())
    import jsonschema

    jsonschema.Draft202012Validator(schema("summary-score")).validate(summary)
    a = summary["audit"]
    assert a["n_stories"] == AUDITED and a["seed"] == 0
    lm = load_lm(folder, dtype=torch.float64)
    ids = [e.ids for e in encode_stories(lm, texts, name_vocabulary(texts))][:AUDITED]
    assert a["n_tokens"] == sum(len(i) - 1 for i in ids)
    want = audit_stories(lm, encode_stories(lm, texts[:AUDITED], name_vocabulary(texts)), k=K, seed=0)
    assert want is not None
    assert [r["head"] for r in a["rows"]] == [r.head for r in want.rows]
    for got, w in zip(a["rows"], want.rows):
        for key in ("atp_mean", "exact_mean", "atp_zero", "exact_zero"):
            e = getattr(w, key)
            assert got[key]["nats"] == pytest.approx(e.nats, abs=1e-12)
            assert got[key]["se"] == pytest.approx(e.se, abs=1e-12)
    assert sum(r["why"] == "random" for r in a["rows"]) == K  # K drawn, and the top K of each mode
    assert K <= sum(r["why"] == "top" for r in a["rows"]) <= 2 * K


def test_audit_csv_is_the_summarys_audit(run):
    a = json.loads((run / "summary.json").read_text())["audit"]
    with open(run / "audit.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(AUDIT_CSV)
    assert [r["head"] for r in rows] == [r["head"] for r in a["rows"]]
    for r, s in zip(rows, a["rows"]):
        assert r["chosen"] == s["why"]
        for key in ("atp_mean", "exact_mean", "atp_zero", "exact_zero"):
            assert float(r[key]) == s[key]["nats"] and float(r[f"{key}_se"]) == s[key]["se"]


def test_the_cost_is_said_before_scoring_and_the_table_printed(folder, stories, tmp_path, capfd):
    out = tmp_path / "o"
    assert main(_argv(folder, stories, out, "--causal", "--audit", "--audit-stories", "2", "--seed", "5")) == 0
    got = capfd.readouterr()
    said = [line for line in got.err.splitlines() if "score --audit" in line]
    assert said == [
        f"storylens: score --audit 8: the first 2 stories, as asked (--audit-stories): {said[0].split(': ', 3)[3]}"
    ]
    assert "forward passes over the stories" in said[0] and "TFLOP" in said[0]
    a = json.loads((out / "summary.json").read_text())["audit"]
    assert a["seed"] == 5 and a["n_stories"] == 2 and len(a["rows"]) == 8  # every head of 2 x 4: top 8 covers all
    assert "AtP audited by exact ablation on 2 stories" in got.out and "L1H1" in got.out


def test_without_audit_the_summary_has_no_audit_key(folder, stories, tmp_path):
    out = tmp_path / "plain"
    assert main(_argv(folder, stories, out, "--causal")) == 0
    assert "audit" not in json.loads((out / "summary.json").read_text()) and not (out / "audit.csv").exists()


def test_the_default_stories_are_what_the_budget_allows(folder):
    """The budget's count: the most first stories whose audit cost fits max(budget x scoring, floor), at
    least one; the cost counts AtP (a forward, every block but the last again, a backward counted as two
    forwards), the clean losses and each head in each mode."""
    lm = load_lm(folder, dtype=torch.float64)
    blocks, outputs = audit_passes(lm, 6)
    assert (blocks, outputs) == ((4 * 2 - 1) + 2 + 2 * 6 * 2, 3 + 1 + 2 * 6)
    per_token = blocks * block_flops(lm) + outputs * head_flops(lm)
    assert audit_cost(lm, [10, 20], 6).flops == pytest.approx(30 * per_token, rel=1e-12)
    lengths = [10] * 50
    floor = 25 * 10 * per_token  # exactly 25 stories fit the floor
    assert audit_budget_stories(lm, lengths, 6, 0.0, floor_flops=floor * (1 + 1e-9)) == 25
    assert audit_budget_stories(lm, lengths, 6, 0.0, floor_flops=1.0) == 1  # never none
    scoring = lm.n_layer * block_flops(lm)  # a token's scoring work: 0.2 x what 10 x 40 tokens cost
    assert audit_budget_stories(lm, lengths, 6, 40 * 10 * per_token / scoring / 0.2 * (1 + 1e-9), floor_flops=0) == 40


def test_the_reports_truth_section_with_causal_gives_atp_and_exact_with_errors(folder, stories, tmp_path):
    """report --causal: every head's exact mean-ablation effect is measured over every quiz story in the
    scoring pass (whatever --truth-stories says of the faithfulness table's own ablations), and AtP is
    audited against it over every head; the faithfulness table's rows carry AtP and the exact effect, each
    as effect_text writes it (no sign within two errors), in place of the ablations' error-less loss
    changes; the summary validates."""
    import html
    import re

    import jsonschema

    from storylens.effects.cost import effect_text

    out = tmp_path / "rep"
    argv = ["report", "--model", str(folder), "--dtype", "float64", "--quiz", str(stories), "--out", str(out),
            "--no-progress", "--causal", "--truth-stories", "2"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    jsonschema.Draft202012Validator(schema("summary-report")).validate(summary)
    t, a = summary["faithfulness"], summary["audit"]
    c = t["causal"]
    assert c["atp_stories"] == summary["quiz"]["stories"] == N and c["exact_stories"] == a["n_stories"] == N
    heads = json.loads((out / "heads.json").read_text())["heads"]
    assert len(a["rows"]) == len(heads) and {r["why"] for r in a["rows"]} == {"every"}
    audited = {r["head"]: r["exact_mean"] for r in a["rows"]}
    for h in heads:  # the audit reads the table's own exact column (heads.json keeps it to float32's digits)
        got = audited[h["label"]]
        assert got["nats"] == pytest.approx(h["exact_mean"], rel=1e-6) and got["se"] == pytest.approx(
            h["exact_mean_se"], rel=1e-6
        )
    page = (out / "report.html").read_text()
    section = page[page.index('id="truth"') : page.index('id="audit"')]
    assert "AtP, mean ablation (nats)" in section and "loss +, zero" not in section
    cells = [html.unescape(re.sub(r"<[^>]+>", "", x)) for x in re.findall(r"<td[^>]*>(.*?)</td>", section)]
    rows = [cells[i : i + 8] for i in range(0, len(cells) - len(t["agreements"]) * 4, 8)]
    assert len(rows) == len(c["rows"])
    for row, e in zip(rows, c["rows"]):
        assert row[1] == e["head"] and row[5] == effect_text(e["atp"], e["atp_se"])
        exact = audited.get(e["head"])
        assert row[6] == ("" if exact is None else effect_text(exact["nats"], exact["se"]))
        assert e["exact"] is not None and exact is not None
    assert not any("switching it off changes the loss" in s for s in t["sentences"])


@pytest.mark.slow  # two reports
def test_the_reports_exact_effect_past_the_budget_falls_back_to_chosen_heads(
    folder, stories, tmp_path, monkeypatch, capsys
):
    """report --causal measures every head's exact effect over the quiz only where that fits the ablation
    budget: past it, it says so on stderr, measures none in the scoring pass, and audits AtP on chosen heads
    on the stories the budget allows (the audit of score --causal --audit); --over-budget measures it anyway."""
    monkeypatch.setattr("storylens.lesson.report.ABLATION_LIMIT_FLOPS", 1.0)
    common = ["report", "--model", str(folder), "--dtype", "float64", "--quiz", str(stories), "--no-progress",
              "--causal", "--sections", "causal"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "every head's exact effect over the" in err and "not measured; AtP is audited on chosen heads" in err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert "every" not in {r["why"] for r in summary["audit"]["rows"]}
    assert json.loads((tmp_path / "a" / "heads.json").read_text())["heads"][0]["exact_mean"] is None
    assert main([*common, "--out", str(tmp_path / "b"), "--over-budget"]) == 0
    assert {r["why"] for r in json.loads((tmp_path / "b" / "summary.json").read_text())["audit"]["rows"]} == {"every"}
