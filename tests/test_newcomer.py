"""What a newcomer trips on: installing the notebook's package, a report on another model with no
corpus, a long run that looks dead off a terminal, ``ablate --heads``, and wording that misleads."""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from storylens.cli import main
from storylens.core.progress import PROGRESS_EVERY_ENV, ProgressLines, progress_command
from storylens.data.stories import ENV_STORIES, EOT

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "lesson_02.ipynb"
WINDOW = 96


def _repository() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def _cells():
    return json.loads(NOTEBOOK.read_text())["cells"]


def _src(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


# ---------------------------------------------------------------- 1. installing from the one address


# "pip install storylens", "pip install -q 'storylens[hf]'": a name, not "storylens[ray] @ git+..."
BARE_INSTALL = re.compile(r"pip install\s+(-\S+\s+)*['\"]?storylens(\[[^\]]*\])?(?!\s*@)['\"]?(\s|$|`)")


def test_the_notebook_installs_from_the_repository_address_in_pyproject():
    url = _repository()
    assert url.startswith("https://github.com/")
    install = next(c for c in _cells() if c["cell_type"] == "code")
    src = _src(install)
    assert f'REPOSITORY = "{url}"' in src and 'pip install -q "git+{REPOSITORY}"' in src
    assert "raise" in src and "returncode" in src  # stops loudly when pip fails
    for c in _cells():  # no cell tells anyone to install an unpublished package by name
        assert not BARE_INSTALL.search(_src(c)), _src(c)[:200]


def test_the_readme_shows_the_same_address_and_no_bare_install():
    readme = (ROOT / "README.md").read_text()
    assert f'pip install "git+{_repository()}"' in readme
    assert not BARE_INSTALL.search(readme)


def test_the_docs_name_every_slow_test_with_its_reason():
    """The docs' "Tests" section (docs/development.md) lists exactly what tests/conftest.py marks slow, each with its
    reason, and every slow entry still names tests that exist (a renamed file is not silently fast)."""
    from tiers import SLOW

    section = (ROOT / "docs" / "development.md").read_text().split("## Tests\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([^`]+)` \| (.+) \|$", section, re.M))
    assert rows == SLOW
    for prefix in SLOW:
        assert (ROOT / prefix).exists(), prefix
    assert 'pytest -m "not slow"' in section


# ---------------------------------------------------------------- 3. progress lines off a terminal


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_lines_off_a_terminal_only():
    out = io.StringIO()
    with progress_command("report"):
        lines = ProgressLines("scoring", 4, every=0, stream=out)
        lines.update(1)
        lines.update(3)
    text = out.getvalue().splitlines()
    assert re.fullmatch(r"storylens: report: scoring 1/4 stories, about \d+ s left", text[0]), text
    assert text[1] == "storylens: report: scoring 4/4 stories"  # done: nothing left to estimate
    tty = _Tty()
    ProgressLines("scoring", 4, every=0, stream=tty).update(2)  # a terminal has tqdm's bar instead
    quiet = io.StringIO()
    ProgressLines("scoring", 4, every=0, stream=quiet, enabled=False).update(2)  # --no-progress
    slow = io.StringIO()
    ProgressLines("scoring", 4, every=3600, stream=slow).update(2)  # nothing before the first interval
    assert tty.getvalue() == quiet.getvalue() == slow.getvalue() == ""


def test_progress_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0")
    assert ProgressLines("scoring", 4).every == 0
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "soon")
    from storylens.core.errors import StorylensError

    with pytest.raises(
        StorylensError,
        match=r"^\$STORYLENS_PROGRESS_SECONDS: seconds between progress lines, "
        r"a number \(got 'soon'\)$",
    ):
        ProgressLines("scoring", 4)


def test_score_off_a_terminal_says_how_far_it_is_and_no_progress_silences_it(
    capsys, monkeypatch, corpus_split, tmp_path
):
    """score's stderr captured (not a terminal): a line per interval through the first pass and the
    scoring, as report and ablate print; --no-progress prints none, and the results are the same."""
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0")
    stories = tmp_path / "s.txt"
    stories.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:6]))
    argv = ["score", "--stories", str(stories), "--batch-size", "2", "--chunk-stories", "2", "--examples", "0"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err.splitlines()
    names = [x for x in err if x.startswith("storylens: score: first pass: names ")]
    scoring = [x for x in err if x.startswith("storylens: score: scoring ")]
    assert names == [f"storylens: score: first pass: names {i} stories" for i in range(1, 7)], err
    assert [x.split(",")[0] for x in scoring] == [f"storylens: score: scoring {i}/6 stories" for i in (2, 4, 6)], err
    assert all(
        re.fullmatch(r"storylens: score: scoring [24]/6 stories, about \d+ (s|min) left", x) for x in scoring[:2]
    )
    assert set(err) == set(names) | set(scoring), err  # nothing else on stderr
    assert main([*argv, "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert (tmp_path / "a" / "heads.csv").read_text() == (tmp_path / "b" / "heads.csv").read_text()


def test_no_progress_says_what_it_silences():
    """The same --no-progress help wherever a long command has it, naming both kinds of progress."""
    from storylens.cli import build_parser
    from storylens.core.progress import NO_PROGRESS_HELP

    for command in ("score", "report", "ablate", "train"):
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
        (flag,) = [a for a in sub._actions if "--no-progress" in a.option_strings]
        assert flag.help == NO_PROGRESS_HELP, command
    assert "terminal" in NO_PROGRESS_HELP and PROGRESS_EVERY_ENV in NO_PROGRESS_HELP


# ---------------------------------------------------------------- 2 and 5. another model, no corpus


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A seeded random GPT-2 with storylens's tokenizer (as tests/test_lm.py builds them)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

    from storylens.model.hub import load_model

    native = load_model()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=native.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_positions=WINDOW,
        vocab_size=native.tokenizer.get_vocab_size(),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    folder = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _run(args, env_extra, tmp_path):
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "storylens", *args], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )  # stderr is a pipe: not a terminal


@pytest.fixture(scope="module")
def no_corpus_report(tiny_gpt2, tmp_path_factory):
    """``storylens report --model X`` where no corpus is at hand, stderr not a terminal."""
    tmp = tmp_path_factory.mktemp("nocorpus")
    out = tmp / "report"
    r = _run(
        ["report", "--model", str(tiny_gpt2), "--out", str(out)],
        {ENV_STORIES: str(tmp / "no-such-corpus.txt.gz"), PROGRESS_EVERY_ENV: "0"},
        tmp,
    )
    return r, out


def test_a_transformers_model_with_no_corpus_gets_the_shipped_quiz(no_corpus_report):
    r, out = no_corpus_report
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    q = summary["quiz"]
    assert q["stories"] == 200 and q["shipped_with_storylens"] is True
    assert q["source"] == (
        "the lesson's 200 quiz stories, shipped with storylens: no corpus here, and the model ships no quiz of its own"
    )
    assert "lesson" not in summary["sections"] and "leakage" not in summary  # a practitioner's report
    page = (out / "report.html").read_text()
    assert "the lesson&#39;s 200 quiz stories, shipped with storylens" in page  # Jinja2's autoescape (markupsafe)


def test_the_lesson_on_another_model_says_the_shipped_quiz_cannot_be_checked_for_leakage(tiny_gpt2, tmp_path):
    out = tmp_path / "report"
    r = _run(
        ["report", "--model", str(tiny_gpt2), "--out", str(out), "--sections", "lesson", "--truth-stories", "0"],
        {ENV_STORIES: str(tmp_path / "no-such-corpus.txt.gz"), PROGRESS_EVERY_ENV: "0"},
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "summary.json").read_text())["leakage"]["computed"] is False
    assert "leakage: not computed: the quiz is the lesson's, shipped with storylens" in r.stdout


def test_a_long_report_off_a_terminal_says_how_far_it_is(no_corpus_report):
    r, _ = no_corpus_report
    lines = [x for x in r.stderr.splitlines() if x.startswith("storylens: report: scoring")]
    assert lines, r.stderr
    assert all(
        re.fullmatch(r"storylens: report: scoring \d+/200 stories(, about \d+ (s|min) left)?", x) for x in lines
    ), lines
    assert re.fullmatch(r"storylens: report: scoring \d+/200 stories, about \d+ (s|min) left", lines[0])
    assert lines[-1] == "storylens: report: scoring 200/200 stories"


def test_the_report_on_another_model_is_titled_and_worded_from_it(no_corpus_report):
    _, out = no_corpus_report
    page = (out / "report.html").read_text()
    assert "<title>storylens: tiny-gpt2's attention</title>" in page
    assert "<h1>Reading tiny-gpt2's attention</h1>" in page
    assert "Tiny Storyteller" not in page and "end-of-story marker" not in page
    assert "the opening token (BOS)" in page
    assert "(lesson:" not in page and "the lesson had 5 of 200" not in page  # no lesson column here
    assert json.loads((out / "summary.json").read_text())["marker"]["called"] == "the opening token (BOS)"


def test_colours_are_described_as_drawn_and_each_table_names_its_range(no_corpus_report):
    _, out = no_corpus_report
    page = (out / "report.html").read_text()
    assert "darker" not in page
    assert "brighter (towards yellow): a larger" in page  # viridis: bright is large
    tables = page.count('<table class="slh">')
    assert tables >= 8
    assert (
        len(
            re.findall(
                r"Colours: this table&#39;s own range, -?\d\.\d{3} \(black\) to -?\d\.\d{3} "
                r"\(light yellow\)",
                page,
            )
        )
        == tables
    )


def test_a_stories_file_that_is_missing_still_fails_and_names_quiz(tiny_gpt2, tmp_path):
    missing = tmp_path / "missing.txt.gz"
    r = _run(
        ["report", "--model", str(tiny_gpt2), "--stories", str(missing), "--out", str(tmp_path / "r")], {}, tmp_path
    )
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1, r.stderr
    assert err[0].startswith(f"storylens: error: {missing}: stories file not found; ")
    assert err[0].endswith(
        "; or pass --quiz FILE to measure stories of your own, or leave out --stories to use "
        "the quiz shipped with storylens"
    )
    assert not (tmp_path / "r").exists()


def test_commands_offer_quiz_only_where_they_have_it(capsys, tmp_path):
    missing = tmp_path / "missing.txt.gz"
    assert main(["ablate", "--stories", str(missing)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"storylens: error: {missing}: stories file not found; ") and "\n" not in err
    assert err.endswith(
        "; or pass --quiz FILE to measure stories of your own, or leave out --stories to use the "
        "quiz shipped with storylens"
    )
    assert main(["perplexity", "--stories", str(missing)]) == 1  # perplexity has no --quiz
    err = capsys.readouterr().err.strip()
    assert err.endswith("; or leave out --stories to use the quiz shipped with storylens") and "--quiz" not in err


def test_the_shipped_report_keeps_the_lesson_wording(tmp_path):
    """The shipped model still reads as the lesson's: its name, its marker and the lesson column."""
    from storylens.lesson.tables import marker_words
    from storylens.lm import load_lm
    from storylens.table.run_info import display_name

    lm = load_lm()
    assert display_name(lm) == "Tiny Storyteller" and marker_words(lm) == "the end-of-story marker"


# ---------------------------------------------------------------- 4. ablate --heads


def _rows(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("heads "))
    rows = []
    for x in lines[start + 1 :]:
        if not x.strip():
            break
        rows.append(x.split()[0])
    return rows


def test_ablate_heads_runs_only_those_heads(capsys, monkeypatch, corpus_split, tmp_path):
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0")
    quiz = tmp_path / "quiz.txt"  # 40 quiz stories: which heads run does not depend on how many stories
    quiz.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:40]))
    ablate = ["ablate", "--quiz", str(quiz), "--mode", "zero", "--heads"]
    assert main([*ablate, "L4H2"]) == 0
    out, err = capsys.readouterr()
    assert _rows(out) == ["L4H2"]  # one head: its own row, no group of one
    assert re.search(r"^storylens: ablate: ablating heads \d+/\d+ stories", err, re.M), err
    assert main([*ablate, "L5H4", "L4H2"]) == 0
    out, _ = capsys.readouterr()
    assert _rows(out) == ["L4H2", "L5H4", "L5H4+L4H2"]  # each alone, then together (in the order given)
    assert main([*ablate, "L4H2", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert _rows(out) == ["L4H2"] and err.splitlines() == [
        f"storylens: ablate: {_ablate_cost(['L4H2'], ('zero',), 0, quiz).describe()}"
    ]


def _ablate_cost(heads, modes, group, quiz_path=None):
    """What storylens ablate estimates on the shipped model and its quiz, or the stories of
    ``quiz_path`` (as ablate reads and counts them)."""
    from storylens.effects.cost import ablate_cost
    from storylens.lesson.inputs import lesson_data
    from storylens.lesson.report import _quiz_folder
    from storylens.lm import load_lm

    lm = load_lm(None)
    quiz = lesson_data(_quiz_folder(lm), None, quiz_path).quiz
    return ablate_cost(lm, [min(len(lm.encode(s)), lm.window) for s in quiz], heads, modes, group)


def test_ablate_says_its_cost_and_refuses_past_the_budget(capsys, monkeypatch):
    """Every head alone (no --heads) on the shipped model: its estimate under the budget is said and run;
    with the budget lowered below it (the shipped model is small), one line naming the estimate, the
    budget and --over-budget, exit 2, and nothing run; --over-budget runs it."""
    import storylens.effects.cost as budget

    every = _ablate_cost(None, ("zero", "mean"), 3)
    one = _ablate_cost(["L4H2"], ("zero",), 0)
    assert one.flops < every.flops < budget.ABLATION_LIMIT_FLOPS / 2  # the shipped model's whole ablate fits
    assert 0 < one.passes < every.passes and one.scoring == every.scoring
    monkeypatch.setattr(budget, "ABLATION_LIMIT_FLOPS", every.flops / 2)
    limit = f"{every.flops / 2e12:g}"
    assert main(["ablate"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"storylens: error: ablate: {every.describe()}, past the budget of {limit} TFLOP; "
        "pass --over-budget to run it anyway\n"
    )
    monkeypatch.setattr(budget, "ABLATION_LIMIT_FLOPS", one.flops / 2)
    assert main(["ablate", "--heads", "L4H2", "--mode", "zero", "--no-progress", "--over-budget"]) == 0
    out, err = capsys.readouterr()
    assert _rows(out) == ["L4H2"] and err == f"storylens: ablate: {one.describe()}\n"


def _truth_cost(quiz_file: Path, n: int):
    """What ``report --truth-stories n --quiz quiz_file`` estimates on the shipped model: its ablations'
    heads come from the scoring pass over the same stories, encoded as the report encodes them."""
    from storylens.data.names import name_vocabulary
    from storylens.engine.encode import encode_stories
    from storylens.lesson.inputs import lesson_data
    from storylens.lm import load_lm
    from storylens.table.scores import score_heads
    from storylens.table.truth import truth_cost

    lm = load_lm(None)
    quiz = lesson_data(None, None, str(quiz_file)).quiz
    encoded = encode_stories(lm, quiz, name_vocabulary(quiz))
    scores = score_heads(lm, encoded, progress=False)
    return truth_cost(lm, scores, [len(e.ids) for e in encoded], n)


def test_report_truth_stories_says_its_cost_and_refuses_past_the_budget(capsys, monkeypatch, corpus_split, tmp_path):
    """An explicit --truth-stories on a quiz of four stories: with the budget lowered below its estimate,
    one line naming the estimate, the budget and --over-budget, exit 2, no report folder; with
    --over-budget the line is said on stderr and the table runs on the stories asked."""
    import storylens.effects.cost as budget

    quiz = tmp_path / "quiz.txt"
    quiz.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:4]))
    cost = _truth_cost(quiz, 3)
    assert 0 < cost.scoring < cost.flops < budget.ABLATION_LIMIT_FLOPS / 2  # unpatched, it would just run
    monkeypatch.setattr(budget, "ABLATION_LIMIT_FLOPS", cost.flops / 2)
    out = tmp_path / "r"
    args = ["report", "--quiz", str(quiz), "--out", str(out), "--truth-stories", "3", "--no-progress"]
    assert main(args) == 2
    got, err = capsys.readouterr()
    assert got == "" and err == (
        f"storylens: error: report: --truth-stories: {cost.describe()}, past the budget of "
        f"{cost.flops / 2e12:g} TFLOP; pass --over-budget to run it anyway\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quiz.txt"]  # no report, no lock, no build folder
    assert main([*args, "--over-budget"]) == 0
    _, err = capsys.readouterr()
    assert err.splitlines()[0] == f"storylens: report: --truth-stories: {cost.describe()}", err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["faithfulness"]["n_stories"] == 3


def test_the_docs_state_the_budget_and_the_progress_interval_the_code_uses():
    """The docs' ablation budget and progress interval (docs/outputs.md, docs/lesson.md) are the constants
    the commands use, and the README says how storylens gets on the PATH after setup (which installs into
    .venv only)."""
    from storylens.core.progress import PROGRESS_EVERY, PROGRESS_EVERY_ENV
    from storylens.effects.cost import ABLATION_LIMIT_FLOPS, OVER_BUDGET_FLAG

    docs = " ".join(" ".join(p.read_text().split()) for p in sorted((ROOT / "docs").glob("*.md")))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"refuses past {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP in one line unless given `{OVER_BUDGET_FLAG}`" in docs
    assert f"refused past {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP without `{OVER_BUDGET_FLAG}`" in docs
    assert f"a progress line every {PROGRESS_EVERY:g} s (`${PROGRESS_EVERY_ENV}`)" in docs
    assert "`source .venv/bin/activate` puts `storylens`" in readme
    assert "python3 -m venv .venv" in (ROOT / "scripts" / "setup.sh").read_text()


def test_the_docs_perf_table_is_the_benchmark_run():
    """The docs' performance table (docs/benchmarks.md) is what scripts/readme_perf_table.py makes of benchmarks/perf.json,
    naming the commit each section was measured at."""
    sys.path.insert(0, str(ROOT))
    from scripts.readme_perf_table import table
    from scripts.readme_tables import shown_between

    run = json.loads((ROOT / "benchmarks" / "perf.json").read_text())
    shown = shown_between("perf")
    assert shown == table(run), "regenerate it: python scripts/readme_perf_table.py benchmarks/perf.json"
    assert "commit" in shown.splitlines()[0] and "≤ 7 s" not in shown  # the retired whole-report target


# ---------------------------------------------------------------- 5. the notebook's wording and cells


def _notebook_namespace():
    """Run the notebook's setup cell here (no kernel): ``model``, ``tok``, ``quiz``."""
    setup = next(_src(c) for c in _cells() if c["cell_type"] == "code" and "load_model()" in _src(c))
    ns: dict = {}
    exec("\n".join(x for x in setup.splitlines() if not x.lstrip().startswith("%")), ns)  # noqa: S102  (the notebook's own cells, run as Jupyter runs them)
    return ns


def test_the_notebook_describes_its_colours_truly_and_introduces_momo():
    md = [_src(c) for c in _cells() if c["cell_type"] == "markdown"]
    text = "\n".join(md)
    assert "darker = a larger share" not in text and "darker: a larger share" not in text
    assert "brighter" in text and "viridis" in text
    assert "own colour range" in text
    leak = next(i for i, c in enumerate(_cells()) if "lesson_leakage" in _src(c))
    before = " ".join(" ".join(_src(c) for c in _cells()[:leak]).split())
    assert "Momo the monkey" in before and "leakage check word" in before  # introduced before the check


def test_the_notebook_leakage_cell_prints_a_short_summary(capsys):
    ns = _notebook_namespace()
    cell = next(_src(c) for c in _cells() if c["cell_type"] == "code" and "lesson_leakage" in _src(c))
    capsys.readouterr()
    exec(cell, ns)  # noqa: S102  (the notebook's own cells, run as Jupyter runs them)
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 6 and len(out) < 600, out
    assert "identical to a training story: 0" in out and 'mentioning "Momo": 0' in out


def test_the_notebook_shows_the_record_attention_flag(capsys):
    cell = next(c for c in _cells() if c["cell_type"] == "code" and "record_attention=True" in _src(c))
    src = _src(cell)
    assert "model(ids, record_attention=True)" in src
    ns = _notebook_namespace()
    capsys.readouterr()
    exec(src, ns)  # noqa: S102  (the notebook's own cells, run as Jupyter runs them)
    out = capsys.readouterr().out
    m = re.search(r"largest logit difference, fused vs recorded: (\S+)", out)
    assert m and float(m.group(1)) < 1e-3, out
    assert re.search(r"patterns: 6 blocks, each \[1, 4, \d+, \d+\]", out), out
