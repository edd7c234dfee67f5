"""Models that are not what they claim: a transformers folder with missing, extra or wrongly shaped
weights, NaN or infinite weights, pickled weights, an encoder or a sequence-to-sequence model, each
refused in one line naming the folder; generation on transformers' cache API that stays; and
``--device`` / ``--dtype`` on every command that runs a model."""

import json
import os
import re
import shutil
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cli_lines import one_line
from safetensors.torch import load_file, save_file

from storylens.cli import build_parser, main
from storylens.core.errors import StorylensError, UsageError
from storylens.data.stories import EOT
from storylens.lm import load_lm
from storylens.model.hub import load_model

WINDOW = 64


@pytest.fixture(scope="module")
def native():
    return load_model()


@pytest.fixture(scope="module")
def fast_tokenizer(native):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=native.tokenizer, bos_token=EOT, eos_token=EOT)


def _save(model, tok, folder):
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _causal(kind, vocab, marker, **extra):
    from transformers import GPT2Config, GPTNeoConfig, LlamaConfig

    common = dict(vocab_size=vocab, bos_token_id=marker, eos_token_id=marker)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=WINDOW, **common)
    elif kind == "gpt_neo":  # a local layer whose window (8) is shorter than the generation
        cfg = GPTNeoConfig(
            num_layers=2,
            num_heads=4,
            hidden_size=32,
            max_position_embeddings=WINDOW,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            **common,
        )
    else:
        cfg = LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=WINDOW,
            **common,
            **extra,
        )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def folders(native, fast_tokenizer, tmp_path_factory):
    """A seeded random model per architecture, saved with storylens's tokenizer (and an untied Llama)."""
    vocab, marker = native.tokenizer.get_vocab_size(), fast_tokenizer.bos_token_id
    root = tmp_path_factory.mktemp("models")
    out = {
        kind: _save(_causal(kind, vocab, marker), fast_tokenizer, root / kind) for kind in ("gpt2", "gpt_neo", "llama")
    }
    out["llama_untied"] = _save(
        _causal("llama", vocab, marker, tie_word_embeddings=False), fast_tokenizer, root / "llama_untied"
    )
    return out


@pytest.fixture(scope="module")
def corpus(native, tmp_path_factory):
    from storylens.lesson.inputs import lesson_quiz

    stories = lesson_quiz(native)[0][:12]
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    path.write_text("".join(f"{s}\n{EOT}\n" for s in stories))
    return path


def _edit(src, dst, change):
    """A copy of folder ``src`` whose model.safetensors is ``change(state_dict)``."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    change(sd)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------- 1. missing or unexpected weights


def test_missing_weights_are_refused_not_initialised(folders, corpus, tmp_path, capfd):
    def drop_block(sd):
        for k in [k for k in sd if k.startswith("transformer.h.1.")]:
            del sd[k]

    bad = _edit(folders["gpt2"], tmp_path / "missing", drop_block)
    for argv in (
        ["perplexity"],
        ["score", "--stories", str(corpus), "--out", str(tmp_path / "o")],
        ["generate", "Once upon a time"],
    ):
        assert one_line(capfd, [*argv, "--model", str(bad)], 1) == (
            f"storylens: error: {bad}: weights do not match config.json: 12 missing (transformer.h.1.attn.c_attn.bias, "
            "transformer.h.1.attn.c_attn.weight, transformer.h.1.attn.c_proj.bias, ...)"
        )
    assert not (tmp_path / "o").exists()


def test_unexpected_and_misshapen_weights_are_refused(folders, tmp_path, capfd):
    def change(sd):
        sd["transformer.h.0.extra.weight"] = torch.zeros(3)
        sd["transformer.ln_f.bias"] = torch.zeros(5)

    bad = _edit(folders["gpt2"], tmp_path / "odd", change)
    assert one_line(capfd, ["perplexity", "--model", str(bad)], 1) == (
        f"storylens: error: {bad}: weights do not match config.json: 1 unexpected (transformer.h.0.extra.weight); "
        "1 of the wrong shape (transformer.ln_f.bias: [5] in the file, [32] by config.json)"
    )


def test_a_tied_head_may_be_absent_an_untied_one_may_not(folders, tmp_path, capfd):
    assert "lm_head.weight" not in load_file(folders["gpt2"] / "model.safetensors")  # tied: stored once
    lm = load_lm(folders["gpt2"])
    assert lm.module.lm_head.weight.data_ptr() == lm.module.transformer.wte.weight.data_ptr()
    assert "lm_head.weight" in load_file(folders["llama_untied"] / "model.safetensors")
    load_lm(folders["llama_untied"])
    bad = _edit(folders["llama_untied"], tmp_path / "headless", lambda sd: sd.pop("lm_head.weight"))
    assert one_line(capfd, ["perplexity", "--model", str(bad)], 1) == (
        f"storylens: error: {bad}: weights do not match config.json: 1 missing (lm_head.weight)"
    )


# ---------------------------------------------------------------- 2. NaN or infinite weights


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_by_every_command(folders, corpus, tmp_path, capfd, value):
    def poison(sd):
        sd["transformer.h.0.attn.c_attn.weight"][3, 5] = value

    bad = _edit(folders["gpt2"], tmp_path / "poisoned", poison)
    want = (
        f"storylens: error: {bad / 'model.safetensors'}: transformer.h.0.attn.c_attn.weight "
        "holds NaN or infinite numbers"
    )
    assert (
        one_line(
            capfd,
            ["score", "--stories", str(corpus), "--out", str(tmp_path / "o"), "--no-progress", "--model", str(bad)],
            1,
        )
        == want
    )
    assert not (tmp_path / "o").exists()
    assert one_line(capfd, ["generate", "Once upon a time", "--model", str(bad)], 1) == want
    assert one_line(capfd, ["report", "--out", str(tmp_path / "r"), "--model", str(bad)], 1) == want
    with pytest.raises(StorylensError, match="holds NaN or infinite numbers"):
        load_lm(bad)


def test_weights_beyond_the_asked_dtype_are_refused(folders, tmp_path, capfd):
    def big(sd):
        sd["transformer.h.1.mlp.c_fc.weight"][0, 0] = 1e6  # fine in float32, infinite in float16

    bad = _edit(folders["gpt2"], tmp_path / "big", big)
    load_lm(bad)
    assert one_line(capfd, ["perplexity", "--model", str(bad), "--dtype", "float16"], 1) == (
        f"storylens: error: {bad / 'model.safetensors'}: transformer.h.1.mlp.c_fc.weight holds numbers beyond "
        "float16's range (infinite once cast); run it in float32 or bfloat16"
    )


# ---------------------------------------------------------------- 3. pickled weights


def test_pickled_weights_are_refused_unopened(folders, tmp_path, capfd):
    bad = tmp_path / "pickled"
    shutil.copytree(folders["gpt2"], bad)
    sd = load_file(bad / "model.safetensors")
    (bad / "model.safetensors").unlink()
    tripwire = tmp_path / "unpickled"

    class Payload:  # unpickling this would make the tripwire folder
        def __reduce__(self):
            return os.makedirs, (str(tripwire),)

    torch.save({**sd, "payload": Payload()}, bad / "pytorch_model.bin")
    assert one_line(capfd, ["perplexity", "--model", str(bad)], 1) == (
        f"storylens: error: {bad}: holds pickled weights (pytorch_model.bin), which storylens never opens "
        "(unpickling runs code the file holds); storylens reads only safetensors weights: convert them where you "
        "trust the file (transformers' from_pretrained, then save_pretrained, writes model.safetensors)"
    )
    assert not tripwire.exists()
    (bad / "pytorch_model.bin").unlink()
    assert one_line(capfd, ["perplexity", "--model", str(bad)], 1) == (
        f"storylens: error: {bad}: no model.safetensors; storylens reads only safetensors weights"
    )


# ---------------------------------------------------------------- 4. not a causal language model


def _encoder_and_seq2seq(kind):
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        BertModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    torch.manual_seed(0)
    if kind == "bert":
        return BertModel(
            BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
        )
    if kind == "t5":
        return T5ForConditionalGeneration(
            T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=100)
        )
    return BartForConditionalGeneration(
        BartConfig(
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            vocab_size=100,
        )
    )


@pytest.mark.parametrize(
    "kind, why",
    [
        (
            "bert",
            " (encoder-only), not a causal language model; storylens reads decoder-only models "
            "(GPT-2, GPT-Neo, Llama, ...)",
        ),
        (
            "bart",
            " (sequence-to-sequence), not a causal language model; storylens reads decoder-only models "
            "(GPT-2, GPT-Neo, Llama, ...)",
        ),
        (
            "t5",
            f", not a causal language model (transformers {transformers.__version__} has no causal-LM class for `t5`)",
        ),
    ],
)
def test_encoders_and_seq2seq_models_are_refused(kind, why, fast_tokenizer, tmp_path, capfd):
    folder = _save(_encoder_and_seq2seq(kind), fast_tokenizer, tmp_path / kind)
    capfd.readouterr()
    for argv in (["perplexity"], ["generate", "Once upon a time"]):
        assert one_line(capfd, [*argv, "--model", str(folder)], 1) == (
            f"storylens: error: {folder}: is a `{kind}` model{why}"
        )


# ---------------------------------------------------------------- 5. generation on the cache API that stays


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neo", "llama"])
def test_cached_generation_warns_nothing_and_equals_uncached(folders, kind):
    from transformers.utils import logging as hf_logging

    lm = load_lm(folders[kind], dtype=torch.float64)
    idx = torch.tensor([lm.encode("Once upon a time")])
    n = WINDOW - idx.shape[1]  # past GPT-Neo's 8-token local window many times over

    def tokens(cache):
        gen = torch.Generator().manual_seed(7)
        return [s.token for s in lm.generate_stream(idx, n, temperature=1.0, generator=gen, use_kv_cache=cache)]

    hf_logging.warning_once.cache_clear()  # transformers says a deprecation once per process: say it again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = tokens(True)
    assert not [str(w.message) for w in caught]
    assert cached == tokens(False) and len(cached) == n


def test_generate_command_on_a_transformers_model_is_quiet(folders, capfd):
    from transformers.utils import logging as hf_logging

    def run(*extra):
        hf_logging.warning_once.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert (
                main(
                    [
                        "generate",
                        "Once upon a time",
                        "--model",
                        str(folders["gpt2"]),
                        "--max-new-tokens",
                        "30",
                        "--no-stop",
                        "--seed",
                        "3",
                        *extra,
                    ]
                )
                == 0
            )
        out, err = capfd.readouterr()
        assert err == "" and not caught, (err, [str(w.message) for w in caught])
        return out

    text = run("--dtype", "float64")
    assert text.startswith("Once upon a time") and text == run("--dtype", "float64", "--no-cache")
    assert run().startswith("Once upon a time")


# ---------------------------------------------------------------- 6. --device and --dtype


MODEL_COMMANDS = ["generate", "report", "ablate", "perplexity", "score", "check", "export-hf"]


def test_every_command_that_runs_a_model_has_device_and_dtype():
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in MODEL_COMMANDS:
        opts = {o: a for a in sub.choices[name]._actions for o in a.option_strings}
        assert {"--model", "--allow-download", "--device", "--dtype"} <= set(opts), name
        want = ["both", "float32", "float64"] if name == "check" else ["float32", "float64", "bfloat16", "float16"]
        assert opts["--dtype"].choices == want, name  # check's --dtype: the precisions it measures in
    assert sub.choices["train"]._option_string_actions["--dtype"].choices == ["fp32", "bf16"]  # its own, untouched
    assert "--device" not in sub.choices["train"]._option_string_actions


@pytest.mark.parametrize(
    "argv",
    [
        ["perplexity"],
        ["generate", "hi"],
        ["score", "--stories", "x.txt", "--out", "y"],
        ["check"],
        ["export-hf", "z"],
        ["ablate"],
        ["report"],
    ],
)
def test_a_device_that_is_no_device_is_a_usage_error(argv, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text(f"Tom ran.\n{EOT}\n")
    assert one_line(capfd, [*argv, "--device", "gpu"], 2) == (
        "storylens: error: --device gpu: not a device (cpu, cuda, cuda:N, mps)"
    )
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_a_device_this_machine_lacks_is_refused(capfd):
    if not torch.cuda.is_available():
        for d in ("cuda", "cuda:1"):
            assert one_line(capfd, ["perplexity", "--device", d], 1) == (
                f"storylens: error: --device {d}: not available on this machine "
                f"(torch {torch.__version__} sees no CUDA device)"
            )
    else:
        n = torch.cuda.device_count()
        assert "not available on this machine" in one_line(capfd, ["perplexity", "--device", f"cuda:{n}"], 1)
    if not torch.backends.mps.is_available():
        assert one_line(capfd, ["perplexity", "--device", "mps"], 1) == (
            "storylens: error: --device mps: not available on this machine "
            f"(torch {torch.__version__} has no usable MPS backend here)"
        )
    with pytest.raises(SystemExit) as e:  # argparse's own usage error
        main(["perplexity", "--dtype", "float128"])
    assert e.value.code == 2
    err = capfd.readouterr().err
    assert err.startswith("storylens: error: argument --dtype: invalid choice: 'float128'"), err


def test_load_lm_takes_device_and_dtype(folders, native):
    for source in (folders["llama"], None):
        lm = load_lm(source, device="cpu", dtype="float64")
        assert lm.device == torch.device("cpu") and lm.dtype == torch.float64
        assert load_lm(source, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(UsageError, match=r"^device cuda:x: not a device \(cpu, cuda, cuda:N, mps\)$"):
        load_lm(None, device="cuda:x")
    with pytest.raises(UsageError, match=r"^dtype int8: not a dtype storylens runs in"):
        load_lm(None, dtype="int8")


@pytest.mark.slow  # every command in float64; the float64 loading is checked in the fast tier
def test_commands_run_in_float64(folders, corpus, tmp_path, capfd):
    """Analysis follows the model's dtype and device: perplexity and score in float64, storylens's own
    model and a transformers one."""
    for name, model in (("native", []), ("gpt2", ["--model", str(folders["gpt2"])])):
        assert main(["perplexity", "--dtype", "float64", "--device", "cpu", *model]) == 0
        assert capfd.readouterr().out.startswith("quiz perplexity ")
        out = tmp_path / name
        assert (
            main(
                [
                    "score",
                    "--stories",
                    str(corpus),
                    "--out",
                    str(out),
                    "--no-progress",
                    "--dtype",
                    "float64",
                    "--device",
                    "cpu",
                    *model,
                ]
            )
            == 0
        )
        capfd.readouterr()
        heads = json.loads((out / "heads.json").read_text())["heads"]
        assert heads and all(isinstance(h["prev_token"], float) and 0 <= h["prev_token"] <= 1 for h in heads)


def test_ray_actors_would_ignore_device_and_dtype_so_they_are_refused(corpus, tmp_path, capfd):
    assert one_line(
        capfd,
        ["score", "--stories", str(corpus), "--out", str(tmp_path / "o"), "--engine", "ray", "--dtype", "float64"],
        2,
    ) == ("storylens: error: --dtype: only with --engine local (Ray actors load the model as stored)")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- 7. custom code, impossible sizes


def _gpt2_parameters(vocab: int, positions: int, layers: int, d: int) -> int:
    """GPT-2's parameters by its architecture: token and position embeddings, per layer two LayerNorms (2d each),
    attention (d x 3d + 3d, d x d + d) and MLP (d x 4d + 4d, 4d x d + d), the final LayerNorm; the head tied."""
    return vocab * d + positions * d + layers * (12 * d * d + 13 * d) + 2 * d


PAYLOAD = """import pathlib
pathlib.Path({marker!r}).write_text("the payload ran")
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
class PayloadConfig(GPT2Config):
    model_type = "payload_gpt"
class PayloadModel(GPT2LMHeadModel):
    config_class = PayloadConfig
class PayloadTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _set_json(path, **changes):
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_model_naming_custom_code_is_refused_whatever_stdin_says(folders, tmp_path, where):
    """transformers would ask "Do you wish to run the custom code? [y/N]" on stdin and run it on
    "y": storylens refuses the folder first, and the payload never runs (nor is copied to run)."""
    import subprocess
    import sys

    bad, marker, hf_home = tmp_path / "custom", tmp_path / "payload-ran", tmp_path / "hf"
    shutil.copytree(folders["gpt2"], bad)
    (bad / "payload.py").write_text(PAYLOAD.format(marker=str(marker)))
    if where == "config.json":  # a model type transformers lacks: it would ask, then import payload.py
        auto = {"AutoConfig": "payload.PayloadConfig", "AutoModelForCausalLM": "payload.PayloadModel"}
        _set_json(bad / "config.json", model_type="payload_gpt", auto_map=auto)
        named = "payload.PayloadConfig, payload.PayloadModel"
    else:
        _set_json(bad / "tokenizer_config.json", auto_map={"AutoTokenizer": [None, "payload.PayloadTokenizer"]})
        named = "payload.PayloadTokenizer"
    env = {**os.environ, "HF_HOME": str(hf_home)}
    for argv in (["perplexity"], ["generate", "Once upon a time"]):
        r = subprocess.run(
            [sys.executable, "-m", "storylens", *argv, "--model", str(bad)],
            input="y\n",
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert (r.returncode, r.stdout) == (1, ""), r.stderr
        assert r.stderr == (
            f"storylens: error: {bad}: {where} names custom code (auto_map: {named}), which storylens never runs; "
            "it reads only models transformers itself implements (GPT-2, GPT-Neo, Llama, ...)\n"
        )
    assert not marker.exists()
    assert not list(hf_home.rglob("payload.py"))  # transformers copies a module it is about to import


@pytest.mark.parametrize(
    "kind, changes, why",
    [
        ("gpt2", {"n_layer": 0}, "config.json: n_layer 0 is not a whole number of at least 1"),
        ("gpt2", {"n_head": -4}, "config.json: n_head -4 is not a whole number of at least 1"),
        ("gpt2", {"n_head": 0}, "config.json: n_head 0 is not a whole number of at least 1"),
        ("gpt2", {"n_embd": 0}, "config.json: n_embd 0 is not a whole number of at least 1"),
        ("gpt2", {"vocab_size": -5}, "config.json: vocab_size -5 is not a whole number of at least 1"),
        ("gpt2", {"n_positions": 0}, "config.json: n_positions 0 is not a whole number of at least 1"),
        ("gpt2", {"n_embd": 30}, "config.json: n_embd 30 is not divisible by n_head 4"),
        (
            "llama",
            {"num_key_value_heads": 3},
            "config.json: num_attention_heads 4 is not divisible by num_key_value_heads 3",
        ),
        ("llama", {"intermediate_size": 0}, "config.json: intermediate_size 0 is not a whole number of at least 1"),
        (
            "gpt2",
            {"n_layer": 100_000},
            f"config.json asks for {_gpt2_parameters(4096, 64, 100_000, 32):,} parameters (100,000 layers, hidden "
            "size 32, 4 heads, vocabulary 4,096) but its weights hold 158,592 numbers; refused before building it",
        ),
        (
            "gpt2",
            {"n_layer": "two"},
            "cannot load as a transformers causal LM (StrictDataclassFieldValidationError: Validation error for "
            "field 'n_layer': TypeError: Field 'n_layer' expected int, got str (value: 'two'))",
        ),
    ],
)
def test_impossible_sizes_are_refused_before_anything_is_built(folders, tmp_path, capfd, kind, changes, why):
    bad = tmp_path / "sizes"
    shutil.copytree(folders[kind], bad)
    _set_json(bad / "config.json", **changes)
    assert one_line(capfd, ["perplexity", "--model", str(bad)], 1) == f"storylens: error: {bad}: {why}"


def test_a_config_past_this_machines_memory_is_refused_before_building(folders, tmp_path, capfd):

    from storylens.core.memory import available_memory

    assert available_memory() is not None  # Linux: /proc/meminfo
    bad = tmp_path / "huge"
    shutil.copytree(folders["gpt2"], bad)
    _set_json(bad / "config.json", n_layer=1_000_000, n_embd=4096, n_head=32)  # at least 16.8 T parameters
    line = one_line(capfd, ["perplexity", "--model", str(bad)], 1)
    least = _gpt2_parameters(4096, 64, 1_000_000, 4096)
    assert re.fullmatch(
        re.escape(
            f"storylens: error: {bad}: config.json asks for {least:,} parameters (1,000,000 layers, "
            f"hidden size 4,096, 32 heads, vocabulary 4,096): {least * 4 / 1e9:,.1f} GB in float32, more than the "
        )
        + r"[\d,]+\.\d GB"
        + re.escape(" of memory available here; refused before building it"),
        line,
    ), line


def test_attention_that_overflows_is_refused_naming_the_head_and_nothing_is_written(folders, corpus, tmp_path, capfd):
    """Queries and keys of block 2 scaled so that their products pass float32's range: its
    attention is NaN, and every score after it; refused in one line naming the first such head."""

    def overflow(sd):
        for k in ("q_proj", "k_proj"):
            sd[f"model.layers.1.self_attn.{k}.weight"] *= 1e20  # each about 1e19: q . k about 1e40 > 3.4e38

    bad = _edit(folders["llama"], tmp_path / "overflow", overflow)
    load_lm(bad)  # every weight finite: only the attention overflows
    want = re.compile(
        r"storylens: error: L2H1: its name_mass score is NaN or infinite on story \d+ "
        r"\(its queries, keys or values overflow float32\); refused, nothing written"
    )
    for argv in (
        ["score", "--stories", str(corpus), "--out", str(tmp_path / "o"), "--no-progress"],
        ["report", "--out", str(tmp_path / "r"), "--no-progress"],
    ):
        line = one_line(capfd, [*argv, "--model", str(bad)], 1)
        assert want.fullmatch(line), line
    assert one_line(capfd, ["perplexity", "--model", str(bad)], 1) == (
        "storylens: error: perplexity: the model's loss is NaN or infinite (a number overflows inside it)"
    )  # was "quiz perplexity nan", exit 0
    page = tmp_path / "replay.html"
    argv = [
        "generate",
        "Once upon a time",
        "--max-new-tokens",
        "5",
        "--record",
        "--html",
        str(page),
        "--model",
        str(bad),
    ]
    assert one_line(capfd, argv, 1) == (  # was torch.multinomial's RuntimeError traceback
        "storylens: error: generate: the model's next-token scores are NaN or infinite (a number overflows inside it)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overflow"]  # no output, checkpoint or lock


def test_recorded_generation_on_a_sliding_window_cache(native, fast_tokenizer, tmp_path, capfd):
    """Mistral's sliding-window cache holds only the latest 8 keys, so each new token's recorded row
    is 8 keys long (it ended in a RuntimeError while the replay was filled): the replay equals one
    whole forward pass over the generated ids, zeros outside the window included."""
    from types import SimpleNamespace

    from transformers import MistralConfig

    from storylens.lesson.checks import probability_bound
    from storylens.lm.generate import record_generation

    marker = fast_tokenizer.bos_token_id
    cfg = MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=WINDOW,
        sliding_window=8,
        vocab_size=native.tokenizer.get_vocab_size(),
        bos_token_id=marker,
        eos_token_id=marker,
    )
    torch.manual_seed(0)
    folder = _save(transformers.AutoModelForCausalLM.from_config(cfg), fast_tokenizer, tmp_path / "mistral")
    lm = load_lm(folder, dtype=torch.float64)
    run = record_generation(lm, "Once upon a time", max_new_tokens=40, stop_at_marker=False, seed=1)
    n = len(run.ids)
    assert n == 45
    whole = lm.patterns(torch.tensor([run.ids]))
    far = torch.ones(n, n, dtype=torch.bool).tril(-8)  # keys 8 or more back: outside the window
    sizes = SimpleNamespace(n_layer=2, n_embd=32, block_size=WINDOW, head_size=8)
    for b in range(lm.n_layer):
        assert not run.patterns[b][:, far].any() and not whole[b][0][:, far].any()
        # rotary angles are float32 in transformers whatever the model's dtype: a float32 bound
        worst = float((run.patterns[b] - whole[b][0]).abs().max())
        assert worst <= probability_bound(sizes, torch.float32), worst
    page = tmp_path / "replay.html"
    argv = ["generate", "Once upon a time", "--max-new-tokens", "30", "--record", "--html", str(page)]
    assert main([*argv, "--model", str(folder)]) == 0
    assert "replay written to" in capfd.readouterr().err and page.stat().st_size > 1000


@pytest.mark.parametrize(
    "spoil, why",
    [
        (
            lambda d: (d / "model.safetensors").write_bytes(os.urandom(1000)),
            "{bad}/model.safetensors: corrupt or truncated weights (",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:300_000]),
            "{bad}/model.safetensors: corrupt or truncated weights (",
        ),
        (
            lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"),
            "{bad}: tokenizer_config.json: not a JSON object",
        ),
        (
            lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
            "{bad}: tokenizer: encodes text as no tokens at all (is its tokenizer.json missing?)",
        ),
    ],
    ids=["garbage-weights", "truncated-weights", "tokenizer-config-a-list", "no-tokenizer"],
)
def test_hostile_files_in_a_transformers_folder_are_one_line(folders, corpus, tmp_path, capfd, spoil, why):
    """Each was a traceback (a tokenizer config that is a list), or ran on transformers' empty
    stand-in tokenizer (no tokenizer files: 'no token to predict')."""
    bad = tmp_path / "bad"
    shutil.copytree(folders["gpt2"], bad)
    spoil(bad)
    for argv in (["perplexity"], ["score", "--stories", str(corpus), "--out", str(tmp_path / "o"), "--no-progress"]):
        line = one_line(capfd, [*argv, "--model", str(bad)], 1)
        assert line.startswith("storylens: error: " + why.format(bad=bad)), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
