"""`storylens report --sections` and the practitioner's report: on a model other than storylens's own
(a tiny seeded transformers Llama saved with the shipped tokenizer), the report leads with every head at
a glance, the detectors, sinks and dormant heads and the faithfulness table, and leaves the lesson (the
toy, the leakage check and Momo, the number to reproduce) out, with no key for it in summary.json; any
section can be asked for by name; a bad name is one line. The shipped model's default keeps every
section (tests/test_report.py checks its page and summary)."""

import json
import re
from html import unescape as html_unescape

import pytest
import torch

transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from storylens.cli import main  # noqa: E402
from storylens.core.errors import UsageError  # noqa: E402
from storylens.core.schema import schema  # noqa: E402
from storylens.data.stories import EOT  # noqa: E402
from storylens.lesson.page import PRACTITIONER, SECTIONS  # noqa: E402
from storylens.lesson.report import ReportOptions, default_sections  # noqa: E402
from storylens.lesson.summary import load  # noqa: E402
from storylens.lm import wrap  # noqa: E402

LESSON_KEYS = ("leakage", "name_heads", "previous_token", "number_to_reproduce", "numerics")


@pytest.fixture(scope="module")
def files(shipped_model, corpus_split, tmp_path_factory):
    """A seeded 2-block Llama (grouped key/value heads) and 8 quiz stories of 40 words."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        vocab_size=shipped_model.tokenizer.get_vocab_size(),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("sections")
    LlamaForCausalLM(cfg).save_pretrained(d / "llama")
    tok.save_pretrained(d / "llama")
    (d / "quiz.txt").write_text("".join(f"{' '.join(s.split()[:40])}\n{EOT}\n" for s in corpus_split.quiz[:8]))
    return d


def _report(files, out, *more):
    argv = ["report", "--model", str(files / "llama"), "--quiz", str(files / "quiz.txt"), "--out", str(out)]
    return main([*argv, "--no-progress", "--truth-stories", "1", "--examples", "2", *more])


@pytest.fixture(scope="module")
def practitioner(files):
    out = files / "default"
    assert _report(files, out) == 0
    return out


def validate(doc):
    sch = schema("summary-report")
    jsonschema.validators.validator_for(sch)(sch).validate(doc)


def test_another_models_default_is_the_practitioners_report(practitioner):
    summary = json.loads((practitioner / "summary.json").read_text())
    validate(summary)
    assert summary["sections"] == list(PRACTITIONER) and "lesson" not in PRACTITIONER
    assert not set(LESSON_KEYS) & set(summary) and "faithfulness" in summary
    assert load(practitioner).to_dict() == summary  # read back, typed, without the lesson's keys
    page = (practitioner / "report.html").read_text()
    for shown in ('id="overview"', 'data-col="induction_random"', "More detectors", 'id="sinks"', 'id="truth"'):
        assert shown in page, shown
    for left_out in ("How attention works", "Leakage check", "The number to reproduce", "Toy attention", "Momo"):
        assert left_out not in page, left_out
    assert page.index('id="overview"') < page.index('id="sinks"') < page.index('id="truth"')


def test_sections_are_chosen_by_name(files, tmp_path):
    out = tmp_path / "lesson"
    assert _report(files, out, "--sections", "lesson,overview") == 0
    summary = json.loads((out / "summary.json").read_text())
    validate(summary)
    assert summary["sections"] == ["overview", "lesson"]  # the page's order
    assert set(LESSON_KEYS) <= set(summary) and "faithfulness" not in summary  # truth not asked: not run
    page = (out / "report.html").read_text()
    assert "The number to reproduce" in page and 'id="truth"' not in page and 'id="sinks"' not in page


def test_a_bad_section_is_one_line_and_writes_nothing(files, tmp_path, capsys):
    out = tmp_path / "bad"
    assert _report(files, out, "--sections", "overview,lessons") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("storylens: error: --sections: 'lessons'")
    assert all(name in err[0] for name in SECTIONS) and not out.exists()
    with pytest.raises(UsageError):
        ReportOptions(sections=("truth", "nope"))


def test_storylens_own_model_keeps_every_section(shipped_model):
    assert default_sections(wrap(shipped_model)) == tuple(SECTIONS)
    assert ReportOptions(sections=("heads", "overview")).sections == ("overview", "heads")


def test_why_cards_explain_the_strongest_heads_and_link_their_writers(files, tmp_path, capsys):
    """--why N on the shipped model (8 short quiz stories): the strongest name, previous-token and induction heads each explained over the first N stories (a
    card on the page, a why folder each whose why.json passes its schema); every writer head in a why page links
    to its page in the report's explorer, nothing else does; a bad N is one line, exit 2."""
    from storylens.viz.why import shown_terms

    out = tmp_path / "why"
    argv = ["report", "--quiz", str(files / "quiz.txt"), "--no-progress", "--sections", "overview,heads"]
    assert main([*argv, "--why", "2", "--out", str(out)]) == 0  # the shipped model: its top heads read earlier heads
    doc = json.loads((out / "summary.json").read_text())
    validate(doc)
    heads = json.loads((out / "heads.json").read_text())["heads"]
    cards = doc["why"]
    assert [c["column"] for c in cards] == ["name_mass", "prev_token", "induction"]
    page = html_unescape((out / "report.html").read_text())
    assert any(c["page"] for c in cards)
    shown: set[str] = set()
    for c in cards:
        best = max(heads, key=lambda h: h[c["column"]] if h[c["column"]] is not None else -1)
        assert c["head"] == best["label"] and c["stories"] <= 2
        if c["page"] is None:  # none of its pairs in two short stories: said on the page, no figure
            assert c["note"] and c["note"] in page and c["total"] is None
            continue
        why = json.loads((out / c["page"]).with_name("why.json").read_text())
        jsonschema.validators.validator_for(schema("why"))(schema("why")).validate(why)
        assert why["head"] == c["head"] and why["positions"] == c["positions"]
        assert f'href="{c["page"]}"' in page and f'href="explore.html#{c["head"]}"' in page
        html = (out / c["page"]).read_text()
        linked = set(re.findall(r'href="\.\./\.\./explore\.html#([^"]+)"', html))
        table = shown_terms(why)[0]  # past 24 writers, the largest (the rest summed in one row)
        assert linked == {w for w in table if re.fullmatch(r"L\d+H\d+", w)}
        assert bool(linked) == (why["layer"] > 0)  # a head past the first block reads earlier heads
        shown.update(linked)
    assert shown  # some writer head linked
    capsys.readouterr()
    assert main([*argv, "--why", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert "--why" in capsys.readouterr().err and not (tmp_path / "bad").exists()
