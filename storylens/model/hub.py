"""Load, save and share Tiny Storyteller the Hugging Face way, offline by default.

``TinyStoryteller`` is the GPT of :mod:`storylens.model` plus ``huggingface_hub``'s
``ModelHubMixin``: ``save_pretrained`` / ``from_pretrained`` / ``push_to_hub``.
A model folder holds ``config.json``, ``model.safetensors`` and ``tokenizer.json``.
Weights are only ever read from safetensors (nothing is unpickled).

:func:`load_model` is what every command uses: a local folder, the shipped model
(default), or a hub id (downloaded only with ``allow_download=True``).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub import ModelHubMixin, snapshot_download
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from storylens.core.errors import StorylensError, install_hint
from storylens.core.files import checked_file, read_text
from storylens.core.offline import hub_offline
from storylens.core.publish import publish_folder
from storylens.data.stories import EOT
from storylens.model.gpt import GPT, GPTConfig
from storylens.model.tokenizer import eot_id, load_tokenizer

SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "pretrained" / "tiny-storyteller"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
HEAD, TIED = "lm_head.weight", "transformer.wte.weight"  # one tensor: the output head is the token embedding
MODEL_FOLDER_FILES = frozenset(
    {CONFIG, WEIGHTS, TOKENIZER, "README.md", "quiz.txt.gz", "leakage.json", "LICENSE-DATA.md", "heads_timeline.jsonl"}
)


class TinyStoryteller(
    GPT,
    ModelHubMixin,
    library_name="storylens",
    tags=["storylens", "tinystories", "interpretability", "gpt2"],
    license="cdla-sharing-1.0",
):
    """A :class:`GPT` that can ``save_pretrained``, ``from_pretrained`` and ``push_to_hub``."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.tokenizer = None  # set by load_model / from_pretrained
        self.source_folder = None  # the folder it was loaded from, if any

    def _save_pretrained(self, save_directory: Path) -> None:
        save_directory = Path(save_directory)
        save_file(stored_weights(self), str(save_directory / WEIGHTS), metadata={TIED: HEAD})  # tied: stored once
        if self.tokenizer is not None:
            self.tokenizer.save(str(save_directory / TOKENIZER))

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision=None,
        cache_dir=None,
        force_download=False,
        local_files_only=True,
        token=None,
        config: GPTConfig | dict | None = None,
        **kw,
    ):
        folder = Path(model_id)
        if not folder.is_dir():
            folder = Path(
                snapshot_download(
                    model_id,
                    revision=revision,
                    cache_dir=cache_dir,
                    local_files_only=local_files_only,
                    token=token,
                    allow_patterns=[CONFIG, WEIGHTS, TOKENIZER, "README.md"],
                )
            )
        return _load_folder(folder, cls)


def _read_config(folder: Path) -> GPTConfig:
    path = folder / CONFIG
    if not path.exists():
        raise StorylensError(f"{path}: missing (is {folder} a storylens model folder?)")
    try:
        raw = json.loads(read_text(path))  # a regular file of a config's size; its JSON judged below
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return GPTConfig.from_dict(raw)
    except UnicodeDecodeError:
        raise StorylensError(f"{path}: not UTF-8 text") from None
    except (ValueError, TypeError) as e:
        raise StorylensError(f"{path}: not a valid model config ({e})") from None


def _check_weights_file(wpath: Path, config: GPTConfig) -> None:
    """Check the file's header against the config (names, shapes, dtypes) before the model is
    built: the file bounds what a config can make storylens allocate. Reads no tensor."""
    checked_file(wpath, None)
    try:
        with safe_open(str(wpath), "pt") as f:
            keys = set(f.keys())
            blocks = {k.split(".")[2] for k in keys if k.startswith("transformer.h.") and k.count(".") >= 3}
            if len(blocks) != config.n_layer:
                raise StorylensError(f"{wpath}: holds {len(blocks)} blocks but {CONFIG} says n_layer={config.n_layer}")
            if {"lm_head.weight", "transformer.wte.weight"} <= keys:
                raise StorylensError(
                    f"{wpath}: holds both transformer.wte.weight and lm_head.weight; the output "
                    "head is the token embedding (tied), stored once under either name"
                )
            expected = config.weight_shapes()
            # the tied output head is the embedding: stored once, under either name
            named = {("transformer.wte.weight" if k == "lm_head.weight" else k): k for k in keys}
            missing = sorted(set(expected) - set(named))
            extra = sorted(set(named) - set(expected))
            if missing or extra:
                raise StorylensError(
                    f"{wpath}: weights do not match {CONFIG} (missing {missing[:3]}, unexpected {extra[:3]})"
                )
            for k, shape in expected.items():
                sl = f.get_slice(named[k])
                got = tuple(sl.get_shape())
                if got != shape:
                    raise StorylensError(f"{wpath}: {k} has shape {got} but {CONFIG} implies {shape}")
                dtype = sl.get_dtype()
                if dtype not in ("F32", "F16", "BF16", "F64"):
                    raise StorylensError(
                        f"{wpath}: {k} is stored as {dtype}; storylens reads floating-point "
                        "weights only (F32, F16, BF16, F64)"
                    )
    except StorylensError:
        raise
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise StorylensError(f"{wpath}: corrupt or truncated weights ({_one_line(e)})") from None


def stored_weights(model: GPT) -> dict[str, torch.Tensor]:
    """The weights a model folder stores: every tensor once (the tied head as ``lm_head.weight``), each
    contiguous in the usual ``[out, in]`` order whatever layout the model keeps it in."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != TIED}


def _load_weights(model: GPT, wpath: Path) -> None:
    """Read the (checked) file into ``model``, cast to its float32; then refuse NaN or infinite
    numbers (an F64 weight beyond float32's range among them)."""
    try:
        # strict: every weight of the model from the file and nothing else; the tied head (lm_head.weight is
        # transformer.wte.weight) read from whichever name was stored; copied into the model's own layout
        weights = load_file(str(wpath))
        for a, b in ((HEAD, TIED), (TIED, HEAD)):
            if a in weights and b not in weights:
                weights[b] = weights[a]
        model.load_state_dict(weights, strict=True)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise StorylensError(f"{wpath}: corrupt or truncated weights ({_one_line(e)})") from None
    with torch.no_grad():
        for k, p in model.named_parameters():  # the tied head once, as transformer.wte.weight
            if not torch.isfinite(p).all():
                raise StorylensError(f"{wpath}: {k} holds NaN or infinite numbers")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _load_folder(folder: Path, cls=None) -> TinyStoryteller:
    cls = cls or TinyStoryteller
    if not folder.is_dir():
        raise StorylensError(f"{folder}: not a model folder")
    config = _read_config(folder)
    wpath = folder / WEIGHTS
    if not wpath.exists():
        raise StorylensError(f"{wpath}: weights file missing")
    _check_weights_file(wpath, config)  # before anything is built: the file bounds the size
    model = cls(config)
    _load_weights(model, wpath)
    tpath = folder / TOKENIZER
    tok = load_tokenizer(tpath)
    if tok.get_vocab_size() != config.vocab_size:
        raise StorylensError(
            f"{tpath}: tokenizer has {tok.get_vocab_size()} tokens but the model expects {config.vocab_size}"
        )
    model.tokenizer = tok
    model.source_folder = folder  # where the model came from (its shipped quiz lives there too)
    model.eval()
    return model


def load_model(source: str | os.PathLike | None = None, *, allow_download: bool = False) -> TinyStoryteller:
    """Load a model folder (default: the shipped Tiny Storyteller) or, if asked, a hub id.

    The returned model is in eval mode and carries its tokenizer as ``model.tokenizer``.
    """
    if source is None:
        return _load_folder(SHIPPED_MODEL)
    path = Path(source)
    if path.exists():
        return _load_folder(path)
    s = str(source)
    looks_like_hub_id = s.count("/") == 1 and not s.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        hub = not allow_download and not any(c in s for c in "/\\") and not s.startswith((".", "~"))
        hint = " here, nor a hub id in the local cache (pass --allow-download to fetch a hub id)" if hub else ""
        raise StorylensError(f"{s}: no such model folder{hint}")
    try:
        with hub_offline(not allow_download):
            return TinyStoryteller.from_pretrained(s, local_files_only=not allow_download)
    except StorylensError:
        raise
    except Exception as e:
        if not allow_download:
            raise StorylensError(
                f"{s}: not a folder here and not in the local hub cache; storylens stays "
                "offline unless asked: pass --allow-download to fetch it"
            ) from None
        raise StorylensError(
            f"{s}: could not be loaded from the hub ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None


@contextmanager
def _safetensors_errors(folder):
    """safetensors reports a failed write (a full disk) as its own error type: make it one line."""
    try:
        yield
    except SafetensorError as e:
        msg = " ".join(str(e).split())
        reason = "No space left on device" if "No space left" in msg else msg
        raise StorylensError(f"{folder}: cannot write ({reason})") from None


def save_model_folder(
    model: GPT, tokenizer, folder: str | os.PathLike, extra_files: dict[str, bytes] | None = None
) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` (and ``extra_files``, name to
    bytes) into ``folder``, all published in one step."""
    if not isinstance(model, TinyStoryteller):
        hub_model = TinyStoryteller(model.config)
        hub_model.load_state_dict(model.state_dict())
        model = hub_model
    model.tokenizer = tokenizer
    with publish_folder(folder, "storylens model folder", owned=MODEL_FOLDER_FILES) as tmp:
        with _safetensors_errors(folder):
            model.save_pretrained(tmp)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
    return Path(folder)


def _gpt2_config(c: GPTConfig, marker: int):
    """The transformers ``GPT2Config`` of a model configured as ``c``: no dropout, GELU's tanh form,
    tied embeddings, the end-of-story ``marker`` as BOS and EOS."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=4 * c.n_embd,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        bos_token_id=marker,
        eos_token_id=marker,
        tie_word_embeddings=True,
    )


def _gpt2_state_dict(sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """Our weights under GPT-2's names. GPT-2's ``Conv1D`` stores ``[in, out]`` (our ``nn.Linear``:
    ``[out, in]``, so transposed) and query, key and value as one ``c_attn`` (``[in, 3*out]``)."""
    new = {
        "transformer.wte.weight": sd["transformer.wte.weight"],
        "transformer.wpe.weight": sd["transformer.wpe.weight"],
        "transformer.ln_f.weight": sd["transformer.ln_f.weight"],
        "transformer.ln_f.bias": sd["transformer.ln_f.bias"],
        "lm_head.weight": sd["transformer.wte.weight"],
    }
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        a = p + "attn."
        new[a + "c_attn.weight"] = torch.cat([sd[a + n + ".weight"] for n in ("query", "key", "value")], 0).T
        new[a + "c_attn.bias"] = torch.cat([sd[a + n + ".bias"] for n in ("query", "key", "value")], 0)
        new[a + "c_proj.weight"] = sd[a + "c_proj.weight"].T
        new[a + "c_proj.bias"] = sd[a + "c_proj.bias"]
        for ln in ("ln_1", "ln_2"):
            new[p + ln + ".weight"] = sd[p + ln + ".weight"]
            new[p + ln + ".bias"] = sd[p + ln + ".bias"]
        new[p + "mlp.c_fc.weight"] = sd[p + "mlp.c_fc.weight"].T
        new[p + "mlp.c_fc.bias"] = sd[p + "mlp.c_fc.bias"]
        new[p + "mlp.c_proj.weight"] = sd[p + "mlp.c_proj.weight"].T
        new[p + "mlp.c_proj.bias"] = sd[p + "mlp.c_proj.bias"]
    return {k: v.contiguous() for k, v in new.items()}


def export_hf(model: GPT, folder: str | os.PathLike) -> Path:
    """Write a transformers ``GPT2LMHeadModel`` folder with the same weights and tokenizer.

    GPT-2 stores query, key and value as one ``Conv1D`` (``c_attn``, weight ``[in, 3*out]``),
    so our three ``nn.Linear`` weights are transposed and concatenated.
    """
    try:
        from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
    except ImportError:
        raise StorylensError(f"export-hf needs transformers: {install_hint('hf')}") from None

    if model.tokenizer is None:
        raise StorylensError("export-hf: the model has no tokenizer to write beside it")
    c = model.config
    hf = GPT2LMHeadModel(_gpt2_config(c, eot_id(model.tokenizer)))
    missing, unexpected = hf.load_state_dict(_gpt2_state_dict(model.state_dict(), c.n_layer), strict=False)
    missing = [m for m in missing if not m.endswith(".attn.bias") and not m.endswith("masked_bias")]
    if missing or unexpected:
        raise RuntimeError(f"export mapping incomplete: missing {missing}, unexpected {unexpected}")
    folder = Path(folder)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=model.tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        model_max_length=c.block_size,
    )
    # a temporary folder beside the target, then one step; a folder holding files storylens
    # did not write is refused (see storylens.core.publish)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one small file: no "Writing model shards" bar on stderr
    try:
        with publish_folder(folder, "transformers GPT2LMHeadModel export") as tmp:
            with _safetensors_errors(folder):
                hf.save_pretrained(tmp)
            fast.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return folder
