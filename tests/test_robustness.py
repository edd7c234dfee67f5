"""Robustness, round 3: corpora read as their authors wrote them, bounded readers, score's output
and checkpoints, user detectors, resources and exit codes. Each case asserts its exact line.

Exit codes: 2 for a usage error (an option wrong on its face), 1 for a problem found while
running, 130 when interrupted.
"""

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch
from cli_lines import one_line
from safetensors.torch import load_file, save_file

from storylens.cli import main
from storylens.data.sources import open_source
from storylens.data.stories import EOT, read_stories, split_stories
from storylens.model.hub import SHIPPED_MODEL

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def few(corpus_split):
    return corpus_split.quiz[:24]


@pytest.fixture(scope="module")
def corpus_file(few, tmp_path_factory):
    f = tmp_path_factory.mktemp("c") / "s.txt"
    f.write_text("".join(f"{s}\n{EOT}\n" for s in few))
    return f


def _score(out, *argv):
    return ["score", "--out", str(out), "--no-progress", "--batch-size", "8", "--chunk-stories", "8", *argv]


# ---------------------------------------------------------------- 1. corpora as their authors wrote them


def test_crlf_lone_cr_and_a_bom_read_as_the_same_stories(few, tmp_path):
    lf = "".join(f"{s}\n{EOT}\n" for s in few)
    variants = {
        "crlf.txt": ("\ufeff" + lf.replace("\n", "\r\n")).encode("utf-8"),
        "cr.txt": lf.replace("\n", "\r").encode("utf-8"),
        "crlf.txt.gz": gzip.compress(lf.replace("\n", "\r\n").encode("utf-8")),
    }
    for name, data in variants.items():
        (tmp_path / name).write_bytes(data)
        assert list(open_source(tmp_path / name)) == few, name
        assert read_stories(tmp_path / name) == few, name
        assert read_stories(tmp_path / name, limit=5) == few[:5], name
    assert split_stories("\ufeff" + lf.replace("\n", "\r\n")) == few
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_bytes(("\ufeff" + "".join(json.dumps({"text": s}) + "\r\n" for s in few)).encode("utf-8"))
    assert list(open_source(jsonl)) == few


def test_the_shared_corpus_with_crlf_endings_is_still_the_shipped_quiz(tmp_path):
    from storylens.data.stories import default_corpus_path
    from storylens.lesson.inputs import lesson_data

    crlf = tmp_path / "stories.txt.gz"
    text = gzip.decompress(default_corpus_path().read_bytes()).decode("utf-8")
    crlf.write_bytes(gzip.compress(text.replace("\n", "\r\n").encode("utf-8"), compresslevel=1))
    data = lesson_data(SHIPPED_MODEL, crlf)
    assert data.quiz == read_stories(default_corpus_path())[-200:]
    assert not any("\r" in s for s in data.quiz)


def test_crlf_scores_equal_lf_scores(few, corpus_file, tmp_path):
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(corpus_file.read_bytes().replace(b"\n", b"\r\n"))
    assert main(_score(tmp_path / "a", "--stories", str(corpus_file))) == 0
    assert main(_score(tmp_path / "b", "--stories", str(crlf))) == 0
    a, b = (json.loads((tmp_path / x / "heads.json").read_text()) for x in "ab")
    assert a == b


def test_a_marker_written_inside_a_story_is_text_not_the_marker_token(tmp_path, shipped_model):
    from storylens.lm import load_lm
    from storylens.model.tokenizer import encode_story

    f = tmp_path / "m.txt"
    f.write_text(f"Tom ran.{EOT}Ann sat.\n{EOT}\nSecond story.\n{EOT}\n")
    stories = list(open_source(f))
    assert stories == [f"Tom ran.{EOT}Ann sat.", "Second story."]  # a separator is a line of its own
    lm = load_lm()
    marker = lm.marker_id
    assert lm.encode(stories[0])[0] == marker and marker not in lm.encode(stories[0])[1:]
    assert marker not in encode_story(shipped_model.tokenizer, stories[0]).ids[1:]
    assert marker not in lm.encode_batch(stories)[0].ids
    assert lm.decode(lm.encode(stories[0])[1:]) == stories[0]  # and it reads back as written


def test_a_marker_in_a_prompt_is_text(capsys):
    from storylens.lm import load_lm

    lm = load_lm()
    assert lm.marker_id not in lm.encode(f"Once{EOT} upon")[1:]


def test_the_corpus_limit_applies_to_every_reader(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STORYLENS_MAX_CORPUS_MB", "1")
    line = "word " * 200 + "\n"
    text = (line * 30 + f"{EOT}\n") * 200  # about 6 MB of text, in stories of 30 KB
    bomb = tmp_path / "big.txt.gz"
    bomb.write_bytes(gzip.compress(text.encode(), compresslevel=9))
    jsonl = tmp_path / "big.jsonl.gz"
    jsonl.write_bytes(gzip.compress("".join(json.dumps({"text": line * 30}) + "\n" for _ in range(200)).encode()))
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(bomb))) == (
        f"storylens: error: {bomb}: more than 1 MB of text once unzipped; refusing to read more "
        "(raise $STORYLENS_MAX_CORPUS_MB if it is really a corpus)"
    )
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(jsonl))) == (
        f"storylens: error: {jsonl}: more than 1 MB of text once unzipped; refusing to read more "
        "(raise $STORYLENS_MAX_CORPUS_MB if it is really a corpus)"
    )
    assert one_line(capsys, ["train", "--stories", str(bomb), "--first", "300", "--out", str(tmp_path / "r")]) == (
        f"storylens: error: {bomb}: more than 1 MB of text once unzipped; refusing to read more "
        "(raise $STORYLENS_MAX_CORPUS_MB if it is really a corpus)"
    )
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


def test_one_huge_json_line_is_refused_while_streaming(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STORYLENS_MAX_STORY_MB", "2")
    f = tmp_path / "one.jsonl"
    f.write_text(json.dumps({"text": "a " * (10 * 2**20)}) + "\n")  # one 20 MB line
    tracemalloc.start()
    line = one_line(capsys, _score(tmp_path / "o", "--stories", str(f)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert line == (
        f"storylens: error: {f}: line 1 is longer than 2 MB; a line or a story is at most that "
        "(raise $STORYLENS_MAX_STORY_MB for longer ones)"
    )
    assert peak < 16 * 2**20  # stopped after 2 MB, never holding the 20 MB line


def test_a_story_with_no_marker_is_capped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STORYLENS_MAX_STORY_MB", "1")
    f = tmp_path / "no-marker.txt"
    f.write_text(("Tom ran to the park and back again. " * 20 + "\n") * 3000)  # 2 MB, no marker line
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(f))) == (
        f"storylens: error: {f}: a story longer than 1 MB (no line holding only {EOT} ends it; "
        "raise $STORYLENS_MAX_STORY_MB for longer stories)"
    )


class _Watched(list):
    """A list that records the highest index read (through indexing, slicing or iteration)."""

    def __init__(self, items):
        super().__init__(items)
        self.highest = -1

    def __getitem__(self, i):
        got = super().__getitem__(i)
        if isinstance(i, slice):
            stop = min(i.stop if i.stop is not None else len(self), len(self))
            self.highest = max(self.highest, stop - 1)
        else:
            self.highest = max(self.highest, i)
        return got

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


def test_positions_look_only_inside_the_window_so_a_long_story_is_linear(shipped_model):
    from storylens.data.names import main_character, pronoun_positions, pronoun_spans, token_positions
    from storylens.engine.encode import mention_first_tokens

    text = "Lily saw a cat. She smiled at Lily. " * 20_000  # 720 KB: 200,000 tokens, 40,000 mentions
    enc = shipped_model.tokenizer.encode(text)
    main = main_character(text, enc.offsets, {"Lily"}, 256)
    assert main.mentions == 40_000  # counted in the whole text, as the lesson defines
    for fn, spans in (
        (mention_first_tokens, main.spans),
        (token_positions, main.spans),
        (pronoun_positions, [s for _, s in pronoun_spans(text)]),
    ):
        offsets = _Watched(enc.offsets)
        got = fn(offsets, spans, 256)
        assert offsets.highest <= 256, fn.__name__  # the window's tokens and one more, never the rest
        assert got and max(got) < 256
        # the same positions as on the story cut short (where the old code looked everywhere)
        short = shipped_model.tokenizer.encode(text[:3000])
        short_spans = [s for s in spans if s[1] <= 3000]
        assert got == fn(short.offsets, short_spans, 256), fn.__name__


def test_deep_json_huge_limit_and_ignored_split_are_one_line(tmp_path, corpus_file, capsys):
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(deep))) == (
        f"storylens: error: {deep}: line 1 is JSON nested too deeply to read"
    )
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(corpus_file), "--limit", str(2**70)), code=2) == (
        f"storylens: error: --limit: must be between 1 and {sys.maxsize:,} (got {2**70:,})"
    )
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(corpus_file), "--split", "test"), code=2) == (
        f"storylens: error: --split: only for a Hugging Face dataset; {corpus_file} is a text file with no splits"
    )
    assert one_line(
        capsys, ["train", "--stories", str(corpus_file), "--first", str(2**70), "--out", str(tmp_path / "r")], code=2
    ) == (f"storylens: error: --first: must be between 1 and {sys.maxsize:,} (got {2**70:,})")


def test_a_saved_single_dataset_refuses_split_and_records_none(tmp_path, few, capsys):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": few[:8]}).save_to_disk(str(saved))
    capsys.readouterr()  # datasets' own progress bar while saving
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(saved), "--split", "test")) == (
        f"storylens: error: {saved}: a single saved dataset with no splits; drop --split test"
    )
    assert main(_score(tmp_path / "o", "--stories", str(saved))) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["stories"]["source"] == f"{saved} (hf, field 'text')"


# ---------------------------------------------------------------- 3. score's output and checkpoints


@pytest.mark.parametrize(
    "out, expect",
    [
        (".", ".: give the output folder a name of its own (not '.' or '..')"),
        ("./", ".: give the output folder a name of its own (not '.' or '..')"),
        ("/", "/: give the output folder a name of its own (not '.' or '..')"),
    ],
)
def test_score_out_that_names_no_folder_of_its_own(corpus_file, capsys, out, expect):
    assert one_line(capsys, ["score", "--out", out, "--stories", str(corpus_file)]) == f"storylens: error: {expect}"


def test_score_out_is_checked_before_any_story(corpus_file, tmp_path, capsys):
    assert one_line(capsys, ["score", "--out", "", "--stories", str(corpus_file)], code=2) == (
        "storylens: error: --out: empty; give the output folder a name"
    )
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("mine")
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert one_line(capsys, ["score", "--out", str(mine), "--stories", str(corpus_file)]) == (
        f"storylens: error: {mine}: holds files storylens did not write (thesis.tex); give an empty or new folder"
    )
    assert one_line(capsys, ["score", "--out", str(a_file), "--stories", str(corpus_file)]) == (
        f"storylens: error: {a_file}: exists and is not a folder"
    )
    assert one_line(capsys, ["score", "--out", "/proc/x", "--stories", str(corpus_file)]).startswith(
        "storylens: error: /proc/.x.lock: cannot create the lock file ("
    )
    assert (mine / "thesis.tex").read_text() == "mine" and a_file.read_text() == "x"
    assert list(tmp_path.glob(".*")) == []


@pytest.fixture(scope="module")
def killed_checkpoint(corpus_file, tmp_path_factory):
    """A run killed after its last checkpoint (16 of 24 stories), before its table is published."""
    out = tmp_path_factory.mktemp("killed") / "o"
    argv = [sys.executable, "-m", "storylens", *_score(out, "--stories", str(corpus_file), "--checkpoint-every", "1")]
    r = subprocess.run(argv, env={**ENV, "STORYLENS_INJECT_KILL": "folder-built"}, capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    ckpt = out.with_name(out.name + ".checkpoint.json")
    assert json.loads(ckpt.read_text())["stats"][0] == 16
    return ckpt.read_text()


def _with_checkpoint(text, tmp_path):
    ckpt = tmp_path / "o.checkpoint.json"
    ckpt.write_text(text)
    return ckpt


def test_two_score_runs_into_one_out_one_is_refused_and_no_checkpoint_is_lost(corpus_split, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("".join(f"{s}\n{EOT}\n" for s in corpus_split.quiz[:96]))
    out = tmp_path / "o"
    argv = [sys.executable, "-m", "storylens", *_score(out, "--stories", str(big), "--checkpoint-every", "1")]
    first = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpt = tmp_path / "o.checkpoint.json"
    deadline = time.time() + 120
    while not ckpt.exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.05)
    assert ckpt.exists()  # the first run holds the lock and has written a checkpoint
    second = subprocess.run(argv, env=ENV, capture_output=True, text=True)
    assert second.returncode == 1 and second.stderr == (
        f"storylens: error: {out}: another storylens run is writing it right now; "
        "try again when that one has finished\n"
    )
    assert first.wait() == 0, first.stderr.read()
    assert json.loads((out / "summary.json").read_text())["stories"]["stories"] == 96
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "o"]  # no lock file, no checkpoint left


@pytest.mark.parametrize(
    "tamper, why",
    [
        (lambda c: c.update(stats="x"), "stats 'x' are not three whole numbers of 0 or more"),
        (lambda c: c.update(stats=[16, -1, 3]), "stats [16, -1, 3] are not three whole numbers of 0 or more"),
        (
            lambda c: c.update(stats=[99, 0, 0]),
            "stats [99, 0, 0]: 99 stories done of 24, 0 cut and 0 with a main character cannot all hold",
        ),
        (
            lambda c: c["state"]["means"]["name_mass"]["total"][0].__setitem__(0, 17.7),
            "state: means.name_mass: a sum of 17.7 over COUNT stories is outside 0..COUNT",
        ),
        (
            lambda c: c["state"]["means"]["marker"]["total"][1].__setitem__(2, float("nan")),
            "state: means.marker: a sum of nan over 16 stories is outside 0..16",
        ),
        (
            lambda c: c["state"]["means"]["prev_token"]["total"][0].__setitem__(0, float("inf")),
            "state: means.prev_token: a sum of inf over 16 stories is outside 0..16",
        ),
        (
            lambda c: c["state"]["means"]["prev4"].__setitem__("count", -3),
            "state: means.prev4: count -3 is not a whole number from 0 to 16",
        ),
        (lambda c: c["state"]["first"].pop("prev4"), "state: first are for other scores (prev_token, prev_argmax)"),
        (lambda c: c["state"].__setitem__("means", "x"), "state: means are for other scores (x)"),
    ],
)
def test_a_tampered_checkpoint_is_refused_in_one_line(corpus_file, killed_checkpoint, tmp_path, capsys, tamper, why):
    c = json.loads(killed_checkpoint)
    count = c["state"]["means"]["name_mass"]["count"]
    tamper(c)
    ckpt = _with_checkpoint(json.dumps(c), tmp_path)
    assert one_line(
        capsys, _score(tmp_path / "o", "--stories", str(corpus_file), "--checkpoint-every", "1", "--resume")
    ) == (
        f"storylens: error: {ckpt}: not a valid checkpoint ({why.replace('COUNT', str(count))}); "
        "delete it to start again"
    )


def test_another_models_checkpoint_is_not_resumed(corpus_file, killed_checkpoint, tmp_path, capsys):
    ckpt = _with_checkpoint(killed_checkpoint, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(SHIPPED_MODEL, other)
    w = load_file(other / "model.safetensors")
    w["transformer.ln_f.weight"] = w["transformer.ln_f.weight"] * 1.001  # same names and shapes, other weights
    save_file(w, other / "model.safetensors")
    argv = _score(tmp_path / "o", "--stories", str(corpus_file), "--checkpoint-every", "1", "--resume")
    assert one_line(capsys, argv + ["--model", str(other)]) == (
        f"storylens: error: {ckpt}: was made with other settings, model or stories; delete it to start again"
    )
    assert main(argv) == 0  # with its own model it resumes
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["engine"]["resumed_from"] == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "other"]


# ---------------------------------------------------------------- 5. user detectors


DETECTORS = {
    "raises": (
        "def pattern(ids):\n    raise ValueError('boom')\n",
        "detector raises: pattern(ids) raised ValueError: boom",
    ),
    "shape": (
        "import torch\ndef pattern(ids):\n    return torch.zeros(3, 4)\n",
        "detector shape: pattern(ids) returned weights of shape (3, 4); expected (B, T, T) ([batch, query, key])",
    ),
    "text": (
        "def pattern(ids):\n    return 'all of them'\n",
        "detector text: pattern(ids) returned str; expected a [batch, query, key] tensor of shape (B, T, T)",
    ),
    "nan": (
        "import torch\ndef pattern(ids):\n    B, T = ids.shape\n    return torch.full((B, T, T), float('nan'))\n",
        "detector nan: pattern(ids) returned NaN or infinite weights; a weight is a number from 0 to 1",
    ),
    "inf": (
        "import torch\ndef pattern(ids):\n    B, T = ids.shape\n    return torch.full((B, T, T), float('inf'))\n",
        "detector inf: pattern(ids) returned NaN or infinite weights; a weight is a number from 0 to 1",
    ),
    "negative": (
        "import torch\ndef pattern(ids):\n    B, T = ids.shape\n    return -torch.ones(B, T, T)\n",
        "detector negative: pattern(ids) returned weights from -1 to 0; a weight is a number from 0 to 1 "
        "(how much that key counts)",
    ),
    "exits": ("import sys\ndef pattern(ids):\n    sys.exit(7)\n", "detector exits: pattern(ids) called sys.exit(7)"),
}


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_a_detector_that_misbehaves_is_one_line(corpus_file, tmp_path, capsys, name):
    import re

    code, why = DETECTORS[name]
    f = tmp_path / f"{name}.py"
    f.write_text(code)
    line = one_line(capsys, _score(tmp_path / "o", "--stories", str(corpus_file), "--limit", "8", "--detector", str(f)))
    # (B, T, T): 8 stories a batch, T the longest of them
    expect = re.escape(f"storylens: error: {why}").replace(re.escape("(B, T, T)"), r"\(8, (\d+), \1\)")
    assert re.fullmatch(expect, line), line
    assert not (tmp_path / "o").exists() and list(tmp_path.glob(".o*")) == []


@pytest.mark.parametrize(
    "name",
    [
        "name_ratio",
        "name_baseline",
        "prev_token_first",
        "label",
        "block",
        "head",
        "marker",
        "norm_marker",
        "output_share",
        "dormant",
    ],
)
def test_a_detector_name_that_is_already_a_column(tmp_path, corpus_file, capsys, name):
    f = tmp_path / "d.py"
    f.write_text(f"NAME = {name!r}\ndef pattern(ids):\n    return None\n")
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(corpus_file), "--detector", str(f))) == (
        f"storylens: error: --detector {f}: detector name {name!r} is already a column of the head table; "
        "choose another NAME"
    )


def test_a_detector_name_kept_for_a_norm_weighted_column(tmp_path, corpus_file, capsys):
    f = tmp_path / "d.py"
    f.write_text("NAME = 'norm_mine'\ndef pattern(ids):\n    return None\n")
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(corpus_file), "--detector", str(f))) == (
        f"storylens: error: --detector {f}: detector name 'norm_mine' starts with 'norm_', kept for the "
        "norm-weighted columns; choose another NAME"
    )


def test_reserved_columns_cover_the_head_table():
    from storylens.looking.detectors import BUILTIN_COLUMNS, RESERVED_COLUMNS
    from storylens.table.scores import HeadScore

    # a user column may take neither a built-in's name nor one a row answers to itself (row.label, row.at)
    own = {n for n in dir(HeadScore) if not n.startswith("_")}
    assert own | {c.name for c in BUILTIN_COLUMNS} <= RESERVED_COLUMNS


def test_a_detector_file_that_exits_while_loading(tmp_path, corpus_file, capsys):
    f = tmp_path / "d.py"
    f.write_text("import sys\nsys.exit(7)\n")
    assert one_line(capsys, _score(tmp_path / "o", "--stories", str(corpus_file), "--detector", str(f))) == (
        f"storylens: error: --detector {f}: called sys.exit(7) while loading"
    )


def test_weights_from_0_to_1_score_as_documented(corpus_file, tmp_path):
    """Half weight on the opening marker scores half the marker detector's mass."""
    f = tmp_path / "half_marker.py"
    f.write_text(
        "import torch\ndef pattern(ids):\n    B, T = ids.shape\n    w = torch.zeros(B, T, T)\n"
        "    w[:, 1:, 0] = 0.5\n    return w\n"
    )
    assert main(_score(tmp_path / "o", "--stories", str(corpus_file), "--detector", str(f))) == 0
    rows = json.loads((tmp_path / "o" / "heads.json").read_text())["heads"]
    for r in rows:
        # marker counts every marker key; in these stories the only one is the opening marker
        assert abs(r["half_marker"] - 0.5 * r["marker"]) <= 2 * 256 * 2.0**-24


# ---------------------------------------------------------------- 6. resources, the report, exit codes


def test_one_long_story_on_a_many_head_model_is_drawn_within_a_budget(tmp_path, shipped_model):
    transformers = pytest.importorskip("transformers")
    from storylens.lm import wrap
    from storylens.recording import FIGURE_BUDGET_BYTES, figure_tokens, story_attention

    cfg = transformers.LlamaConfig(
        hidden_size=72,
        intermediate_size=96,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=4096,
        vocab_size=shipped_model.tokenizer.get_vocab_size(),
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=shipped_model.tokenizer, bos_token=EOT, eos_token=EOT)
    lm = wrap(model, tok)
    story = "Tom saw a big red ball in the park. " * 400  # about 3,600 tokens
    assert len(lm.encode(story)) > 3000
    fits = figure_tokens(30, 9)
    tracemalloc.start()
    tokens, att, enc = story_attention(lm, story)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert att.shape == (30, 9, fits, fits) and enc.cut and len(tokens) == fits
    assert att.nbytes + att.nbytes // 2 <= FIGURE_BUDGET_BYTES
    assert peak < 2 * FIGURE_BUDGET_BYTES  # the full story's maps would be 30 * 9 * 3,600^2 * 12 bytes = 42 GB
    # a model with more heads than any story can be drawn for is refused in one line
    from storylens.core.errors import StorylensError

    with pytest.raises(StorylensError, match=r"heads are too many to draw one story's patterns within 0 MB"):
        story_attention(lm, story, budget=1000)


@pytest.mark.parametrize("word", ["", " ", "two words"])
def test_report_word_must_be_one_word(tmp_path, capsys, word):
    assert one_line(capsys, ["report", "--out", str(tmp_path / "r"), "--word", word], code=2) == (
        f"storylens: error: --word: give one word for the leakage check to count (the lesson's: Momo), not {word!r}"
    )


def test_exit_codes_follow_the_convention(tmp_path, capsys):
    assert main(["generate", "Once", "--temperature", "-1"]) == 2  # usage: an option wrong on its face
    capsys.readouterr()
    assert main(["perplexity", "--stories", str(tmp_path / "missing.txt")]) == 1  # found while running
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["generate"])  # argparse's own usage errors
    assert e.value.code == 2
    capsys.readouterr()
    # interrupted: 130, one line, and the run's checkpoint kept for --resume
    from storylens.data.stories import default_corpus_path

    big = tmp_path / "big.txt"
    # 1,000 stories: long enough after the first checkpoint that the signal lands in the run on a loaded machine
    big.write_text("".join(f"{s}\n{EOT}\n" for s in read_stories(default_corpus_path())[-1000:]))
    ckpt = tmp_path / "o.checkpoint.json"
    p = subprocess.Popen(
        [sys.executable, "-m", "storylens", *_score(tmp_path / "o", "--stories", str(big), "--checkpoint-every", "1")],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not ckpt.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert p.poll() is None, f"the run ended (exit {p.returncode}) before a checkpoint was seen"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.strip().splitlines() == ["storylens: interrupted"], err
    assert ckpt.exists() and not (tmp_path / "o").exists()


def test_no_lock_file_is_left_beside_an_output(corpus_file, tmp_path):
    assert main(_score(tmp_path / "o", "--stories", str(corpus_file), "--limit", "8")) == 0
    assert main(["export-hf", str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "o"]


def test_report_quiz_reads_json_lines_parquet_and_datasets_with_their_readers(few, tmp_path, capsys):
    from storylens.lesson.inputs import lesson_data

    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text("".join(json.dumps({"text": s}) + "\n" for s in few))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": few}), tmp_path / "q.parquet")
    for f in (jsonl, tmp_path / "q.parquet"):
        assert lesson_data(SHIPPED_MODEL, None, f).quiz == few, f
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"story": "x"}\n')
    assert one_line(capsys, ["report", "--out", str(tmp_path / "r"), "--quiz", str(bad)]) == (
        f"storylens: error: {bad}: line 1 has no field 'text' (choose one with --text-field)"
    )


def test_the_report_draws_a_story_cut_to_the_figures_budget(tmp_path, few, monkeypatch):
    """A story longer than the figures' budget is drawn cut, its name positions with it (they were
    positions past the cut: an IndexError, as a 3,000-token story on a 30 x 9 model showed)."""
    import storylens.recording as recording
    from storylens.lesson.report import build_report

    monkeypatch.setattr(recording, "FIGURE_BUDGET_BYTES", 12 * 24 * 60 * 60)  # 60 tokens for 24 heads
    quiz = tmp_path / "q.txt"
    quiz.write_text("".join(f"{s}\n{EOT}\n" for s in few[:8]))
    report = build_report(tmp_path / "r", quiz=str(quiz), progress=False, check_stories=2, check_tokens=8)
    assert report.summary.story_shown.main_character
    figures = json.loads((tmp_path / "r" / ".storylens.json").read_text())["files"]
    assert {"all_heads.png", "top_name_head.png", "widget.html"} <= set(figures)
    assert report.summary.story_shown.tokens == 60  # cut from the story's full window
