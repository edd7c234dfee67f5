"""Every bad input: one exact line on stderr, a non-zero exit, and nothing written.

Each case was a traceback (or a silent wrong answer) before; the classes they stand for are
model folders, corpus files, generation options, report targets, training options and argparse.
"""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_lines import one_line
from safetensors.torch import load_file, save_file

from storylens.cli import main
from storylens.data.stories import EOT
from storylens.model.hub import SHIPPED_MODEL


def model_copy(tmp_path, name="m") -> Path:
    m = tmp_path / name
    shutil.copytree(SHIPPED_MODEL, m)
    return m


def set_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------- model folders


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("n_head", 0, "n_head must be a whole number of at least 1, not 0"),
        ("n_layer", -2, "n_layer must be a whole number of at least 1, not -2"),
        ("n_embd", "256", "n_embd must be a whole number of at least 1, not '256'"),
        ("block_size", 2.5, "block_size must be a whole number of at least 1, not 2.5"),
        ("vocab_size", True, "vocab_size must be a whole number of at least 1, not True"),
        ("dropout", 2, "dropout must be a probability below 1, not 2"),
        ("bias", "yes", "bias must be true or false, not 'yes'"),
    ],
)
def test_config_values_of_the_wrong_type_or_range(capsys, tmp_path, field, value, why):
    m = model_copy(tmp_path)
    set_config(m, **{field: value})
    line = one_line(capsys, ["generate", "Hi", "--model", str(m)])
    assert line == f"storylens: error: {m / 'config.json'}: not a valid model config ({why})"


@pytest.mark.parametrize(
    "field, value, expect",
    [
        ("n_layer", 100000, "holds 6 blocks but config.json says n_layer=100000"),
        (
            "vocab_size",
            10**12,
            "transformer.wte.weight has shape (4096, 256) but config.json implies (1000000000000, 256)",
        ),
        ("block_size", 4096, "transformer.wpe.weight has shape (256, 256) but config.json implies (4096, 256)"),
    ],
)
def test_absurd_configs_are_checked_against_the_weights_before_anything_is_built(
    capsys, tmp_path, field, value, expect
):
    m = model_copy(tmp_path)
    set_config(m, **{field: value})
    import tracemalloc

    tracemalloc.start()
    line = one_line(capsys, ["generate", "Hi", "--model", str(m)])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert line == f"storylens: error: {m / 'model.safetensors'}: {expect}"
    assert peak < 50 * 2**20  # nothing of the config's size was allocated


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_weights_are_refused_at_load(capsys, tmp_path, bad):
    m = model_copy(tmp_path)
    w = m / "model.safetensors"
    t = load_file(str(w))
    t["transformer.h.2.mlp.c_fc.weight"][3, 7] = bad
    save_file(t, str(w))
    line = one_line(capsys, ["generate", "Hi", "--model", str(m)])
    assert line == f"storylens: error: {w}: transformer.h.2.mlp.c_fc.weight holds NaN or infinite numbers"


def test_integer_weights_are_refused_not_cast(capsys, tmp_path):
    m = model_copy(tmp_path)
    w = m / "model.safetensors"
    t = load_file(str(w))
    t["transformer.ln_f.weight"] = t["transformer.ln_f.weight"].to(torch.int8)
    save_file(t, str(w))
    line = one_line(capsys, ["generate", "Hi", "--model", str(m)])
    assert line == (
        f"storylens: error: {w}: transformer.ln_f.weight is stored as I8; storylens reads "
        "floating-point weights only (F32, F16, BF16, F64)"
    )


def test_config_that_is_not_an_object(capsys, tmp_path):
    m = model_copy(tmp_path)
    (m / "config.json").write_text("[1, 2]")
    line = one_line(capsys, ["generate", "Hi", "--model", str(m)])
    assert line == f"storylens: error: {m / 'config.json'}: not a valid model config (not a JSON object)"


# ---------------------------------------------------------------- corpus files


def test_a_folder_or_a_fifo_is_named_for_what_it_is(capsys, tmp_path):
    line = one_line(capsys, ["perplexity", "--stories", str(tmp_path)])
    assert line == (
        f"storylens: error: {tmp_path}: is a folder, not a stories file; or leave out --stories "
        "to use the quiz shipped with storylens"
    )
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    line = one_line(capsys, ["perplexity", "--stories", str(fifo)])  # must not block on open
    assert line == (
        f"storylens: error: {fifo}: is a named pipe (FIFO), not a stories file; or leave out --stories "
        "to use the quiz shipped with storylens"
    )


def test_gzip_bomb_is_streamed_and_refused(capsys, tmp_path, monkeypatch):
    # 3 GiB of zeros would be ~3 MB gzipped; the same stream logic is shown on a smaller bomb with a
    # smaller limit: 64 MiB of text gzipped to ~64 KB, against a limit of 8 MB.
    bomb = tmp_path / "bomb.txt.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        block = (b"a" * 1009 + f"\n{EOT}\n".encode()) * 1024  # 1 MiB in stories of 1 KiB
        for _ in range(64):
            f.write(block)
    assert bomb.stat().st_size < 200_000
    monkeypatch.setenv("STORYLENS_MAX_CORPUS_MB", "8")
    import tracemalloc

    tracemalloc.start()
    line = one_line(capsys, ["perplexity", "--stories", str(bomb)])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert line == (
        f"storylens: error: {bomb}: more than 8 MB of text once unzipped; refusing to read more "
        "(raise $STORYLENS_MAX_CORPUS_MB if it is really a corpus); or leave out --stories to use the "
        "quiz shipped with storylens"
    )
    assert peak < 32 * 2**20  # stopped near the limit, never holding the 64 MiB


def test_stories_are_split_on_newlines_only():
    from storylens.data.stories import split_stories

    text = f"Ann\u2028sang.\x0cBen\x85ran.\r\n{EOT}\r\nTwo.\n{EOT}\n"
    assert split_stories(text) == ["Ann\u2028sang.\x0cBen\x85ran.", "Two."]


# ---------------------------------------------------------------- generate


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--temperature", "nan"], "--temperature: must be a finite number, 0 (greedy) or more (got nan)"),
        (["--temperature", "-1"], "--temperature: must be a finite number, 0 (greedy) or more (got -1.0)"),
        (["--seed", str(2**64)], f"--seed: must be between 0 and 2^64 - 1 (got {2**64})"),
        (["--seed", "-1"], "--seed: must be between 0 and 2^64 - 1 (got -1)"),
        (["--max-new-tokens", "-5"], "--max-new-tokens: must be 0 or more (got -5)"),
        (["--top-k", "-1"], "--top-k: must be 0 (off) or more (got -1)"),
    ],
)
def test_generate_options(capsys, argv, expect):
    assert one_line(capsys, ["generate", "Once", *argv], code=2) == f"storylens: error: {expect}"


@pytest.mark.parametrize("seed", ["-5", str(2**64)])
def test_ablate_refuses_a_seed_torch_would_wrap_before_the_model_loads(capsys, seed):
    assert one_line(capsys, ["ablate", "--seed", seed], code=2) == (
        f"storylens: error: --seed: must be between 0 and 2^64 - 1 (got {seed})"
    )


def test_prompt_that_is_not_valid_text(capsys):
    bad = b"Once \xff\xfe".decode("utf-8", "surrogateescape")  # what Python makes of non-UTF-8 argv bytes
    assert one_line(capsys, ["generate", bad], code=2) == (
        "storylens: error: prompt: not valid text (it holds bytes that are not UTF-8)"
    )


def test_a_tiny_temperature_is_greedy_not_nan(capsys):
    assert main(["generate", "Once upon a time", "--temperature", "1e-300", "--max-new-tokens", "12"]) == 0
    tiny = capsys.readouterr().out
    assert main(["generate", "Once upon a time", "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == tiny


# ---------------------------------------------------------------- report targets


def test_report_out_under_a_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("mine")
    line = one_line(capsys, ["report", "--out", str(f / "report"), "--no-progress"])
    assert line == f"storylens: error: {f / 'report'}: {f} is not a folder"
    assert f.read_text() == "mine"


def test_report_out_in_proc(capsys):
    line = one_line(capsys, ["report", "--out", "/proc/storylens-report", "--no-progress"])
    assert line.startswith("storylens: error: /proc/.storylens-report.lock: cannot create the lock file (")
    assert not Path("/proc/storylens-report").exists()


def test_report_refuses_a_folder_holding_someone_elses_files(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    line = one_line(capsys, ["report", "--out", str(out), "--no-progress"])
    assert line == (
        f"storylens: error: {out}: holds files storylens did not write (notes.txt); give an empty or new folder"
    )
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_report_story_picker_when_the_first_story_has_no_main_character(tmp_path, corpus_split, capsys):
    from storylens.analysis import find_main_characters
    from storylens.model.hub import load_model

    tok = load_model().tokenizer
    quiz = corpus_split.quiz[:30]
    mains = find_main_characters(tok, quiz)
    without = [s for s, m in zip(quiz, mains) if m is None][:2]
    with_main = [s for s, m in zip(quiz, mains) if m is not None][:3]
    assert without and with_main
    qf = tmp_path / "quiz.txt"
    qf.write_text("".join(f"{s}\n{EOT}\n" for s in without + with_main))
    assert main(["report", "--quiz", str(qf), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["story_shown"]["quiz_index"] > len(without)


# ---------------------------------------------------------------- training options


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--eval-every", "0"], "--eval-every: must be a whole number of at least 1 (got 0)"),
        (["--batch-size", "0"], "--batch-size: must be a whole number of at least 1 (got 0)"),
        (["--lr", "nan"], "--lr: must be a finite number, 0 or more (got nan)"),
        (["--dropout", "2"], "--dropout: a probability: at least 0 and below 1 (got 2.0)"),
        (["--max-steps", "-1"], "--max-steps: must be a whole number of at least 1 (got -1)"),
    ],
)
def test_train_options(capsys, tmp_path, argv, expect):
    out = tmp_path / "run"
    assert one_line(capsys, ["train", "--out", str(out), *argv], code=2) == f"storylens: error: {expect}"
    assert not out.exists()


def test_train_out_is_a_file(capsys, tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert one_line(capsys, ["train", "--out", str(f)]) == f"storylens: error: {f}: exists and is not a folder"


def test_corpus_too_small_for_the_vocabulary(capsys, tmp_path, corpus_split):
    small = tmp_path / "small.txt"
    small.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.train[:30] + corpus_split.quiz))
    line = one_line(capsys, ["train", "--stories", str(small), "--out", str(tmp_path / "run"), "--max-steps", "1"])
    assert line.startswith(
        "storylens: error: corpus: too small for a 4,096-token vocabulary (byte-level BPE found only "
    )
    assert line.endswith(
        "tokens in the training stories); give more stories or --vocab-size "
        + line.split("only ")[1].split(" ")[0].replace(",", "")
    )
    assert not (tmp_path / "run" / "tokenizer.json").exists()


# ---------------------------------------------------------------- argparse and --debug


def test_argparse_errors_are_one_line(capsys):
    for argv, expect in [
        (
            ["generate", "Hi", "--max-new-tokens", "x"],
            "storylens: error: argument --max-new-tokens: invalid int value: 'x' (see storylens generate --help)",
        ),
        (["nonsense"], "storylens: error: argument command: invalid choice: 'nonsense'"),
        ([], "storylens: error: the following arguments are required: command (see storylens --help)"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(expect), err


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_before_or_after_the_subcommand(tmp_path, where, capsys):
    argv = ["perplexity", "--stories", str(tmp_path / "none.gz")]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    assert main(argv) == 1  # the exit code it has without --debug
    err = capsys.readouterr().err
    assert "Traceback" in err and "StorylensError" in err and "stories file not found" in err.strip().splitlines()[-1]


def test_command_line_errors_in_a_real_process(tmp_path):
    (tmp_path / "f").write_text("")
    r = subprocess.run(
        [sys.executable, "-m", "storylens", "report", "--out", str(tmp_path / "f" / "x")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert (
        r.returncode == 1
        and r.stderr == f"storylens: error: {tmp_path / 'f' / 'x'}: {tmp_path / 'f'} is not a folder\n"
    )


@pytest.mark.parametrize("target", [".", ".."])
def test_dot_targets_are_refused(capsys, target):
    assert one_line(capsys, ["export-hf", target]) == (
        f"storylens: error: {target}: give the output folder a name of its own (not '.' or '..')"
    )


# ---------------------------------------------------------------- --examples within a stated budget


@pytest.mark.slow  # its last run keeps the most examples the budget allows, 24 heads x 9 detectors x 2,314 (~70 s)
def test_examples_past_the_budget_are_refused_and_nothing_is_written(capsys, tmp_path, corpus_split):
    """--examples K keeps heads x detectors x K examples: at most EXAMPLES_BUDGET in all (the
    shipped model: 24 heads x every built-in detector), refused past it before a story is scored."""
    from storylens.corpus.options import EXAMPLES_BUDGET
    from storylens.looking.detectors import BUILTIN_DETECTORS

    d = len(BUILTIN_DETECTORS)

    stories = tmp_path / "stories.txt"
    stories.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:3]))
    most = EXAMPLES_BUDGET // (24 * d)
    for k in (most + 1, 10**12):
        want = (
            f"storylens: error: --examples {k:,}: 24 heads x {d} detectors x {k:,} = {24 * d * k:,} examples, past "
            f"the budget of {EXAMPLES_BUDGET:,} kept in all (about 1 KB each in memory, and again in examples.json "
            f"and explore.html); at most {most:,} here"
        )
        argv = ["score", "--stories", str(stories), "--out", str(tmp_path / "o"), "--no-progress"]
        assert one_line(capsys, [*argv, "--examples", str(k)], 2) == want
        assert one_line(capsys, ["report", "--out", str(tmp_path / "r"), "--examples", str(k)], 2) == want
        assert sorted(p.name for p in tmp_path.iterdir()) == ["stories.txt"]
    out = tmp_path / "o"
    assert main(["score", "--stories", str(stories), "--out", str(out), "--no-progress", "--examples", str(most)]) == 0
    kept = json.loads((out / "examples.json").read_text())["heads"]
    assert len(kept) == 24 and all(len(h["examples"]["prev_token"]) <= most for h in kept)


@pytest.mark.parametrize(
    "more, expect",
    [
        (["--audit"], "--audit: only with --causal (it audits the causal columns)"),
        (["--audit", "3"], "--audit: only with --causal (it audits the causal columns)"),
        (["--causal", "--audit", "-1"], "--audit: a whole number of heads, 0 or more (got -1)"),
        (["--causal", "--audit", "--audit-stories", "0"], "--audit-stories: a whole number, 1 or more (got 0)"),
        (["--causal", "--audit-stories", "5"], "--audit-stories: only with --audit (the audit's stories)"),
        (["--causal", "--audit", "--seed", "-1"], "--seed: must be between 0 and 2^64 - 1 (got -1)"),
        (["--causal", "--graph-memory", "-1"], "--graph-memory: a whole number of MiB, 0 or more (got -1)"),
    ],
)  # fmt: skip
def test_score_audit_options_are_one_line_before_the_model_loads(capsys, tmp_path, more, expect):
    argv = ["score", "--stories", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o"), "--no-progress", *more]
    assert one_line(capsys, argv, code=2) == f"storylens: error: {expect}"
    assert list(tmp_path.iterdir()) == []


def test_report_graph_memory_is_one_line_before_the_model_loads(capsys, tmp_path):
    argv = ["report", "--out", str(tmp_path / "r"), "--no-progress", "--causal", "--graph-memory", "-5"]
    assert (
        one_line(capsys, argv, code=2) == "storylens: error: --graph-memory: a whole number of MiB, 0 or more (got -5)"
    )
    assert list(tmp_path.iterdir()) == []


def test_score_audit_past_the_budget_is_refused_before_scoring(capsys, tmp_path, corpus_split, monkeypatch):
    """The audit's cost is counted once the first pass has counted the stories, before the scoring:
    past the ablation limit it is one line naming --over-budget, and nothing is written."""
    import storylens.effects.cost as budget

    monkeypatch.setattr(budget, "ABLATION_LIMIT_FLOPS", 1e6)
    stories = tmp_path / "stories.txt"
    stories.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:2]))
    argv = ["score", "--stories", str(stories), "--out", str(tmp_path / "o"), "--no-progress", "--causal", "--audit"]
    line = one_line(capsys, argv, code=2)
    assert line.startswith("storylens: error: score --audit 8: the first 2 stories, as many as the ablation budget")
    assert line.endswith("past the budget of 1e-06 TFLOP; pass --over-budget to run it anyway")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories.txt"]
