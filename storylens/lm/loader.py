"""Opening a model: :func:`load_lm` reads a storylens model folder, a transformers model folder or (with
``allow_download``) a hub id, and refuses what is not what it claims before anything runs: custom code, pickled
weights, sizes past the memory (:mod:`storylens.lm.configs`), non-floating or non-finite weights, a model that
is not causal. :func:`wrap` wraps a model already in memory; :func:`resolve_device` and :func:`resolve_dtype`
read the ``--device`` and ``--dtype`` a user gives."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch
from torch import nn

from storylens.core.errors import StorylensError, UsageError, install_hint
from storylens.core.files import read_json
from storylens.lm.configs import CONFIG_ERRORS, check_no_custom_code, check_sizes
from storylens.lm.hooks import AttentionLM
from storylens.lm.native import NativeLM
from storylens.lm.transformers_lm import TransformersLM
from storylens.model.gpt import GPT
from storylens.model.hub import hub_offline, load_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


ModelLike: TypeAlias = "GPT | PreTrainedModel | AttentionLM"


"""What the public entry points take as a model: storylens's GPT, a transformers causal LM or an
:class:`AttentionLM`; each calls :func:`wrap` once and hands the :class:`AttentionLM` on."""


def wrap(model: ModelLike, tokenizer=None, name: str | None = None) -> AttentionLM:
    """An :class:`AttentionLM` for a model in memory: storylens's GPT or a transformers causal LM
    (with its tokenizer). An :class:`AttentionLM` is returned as it is."""
    if isinstance(model, AttentionLM):
        return model
    config = getattr(model, "config", None)
    layers = getattr(config, "n_layer", None) if isinstance(model, GPT) else getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:  # what the loader refuses in a config, refused in memory alike
        raise StorylensError(f"{type(model).__name__}: {layers} blocks; a model needs at least 1 (n_layer)")
    if isinstance(model, GPT):
        return NativeLM(model, tokenizer, **({"name": name} if name else {}))
    if hasattr(model, "config") and isinstance(model, nn.Module):
        if tokenizer is None:
            raise StorylensError(f"{type(model).__name__}: pass its tokenizer (a transformers fast tokenizer)")
        return TransformersLM(model, tokenizer, name)
    raise StorylensError(f"{type(model).__name__}: not a causal language model storylens can read")


def is_transformers_folder(path: Path) -> bool:
    """A transformers model folder: a config.json with ``model_type`` (storylens's own has none)."""
    try:
        return "model_type" in read_json(path / "config.json")
    except (OSError, ValueError, TypeError, AttributeError, StorylensError):  # the native loader says what is wrong
        return False


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


_DEVICE = re.compile(r"^(cpu|mps|cuda(?::\d+)?)$")


def resolve_dtype(dtype, option: str = "dtype") -> torch.dtype | None:
    """``dtype`` as a torch dtype: a torch floating dtype or one of :data:`DTYPES`' names."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise UsageError(f"{option} {dtype}: not a dtype storylens runs in ({', '.join(DTYPES)})")


def resolve_device(device, option: str = "device") -> torch.device | None:
    """``device`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``) as a torch device, refused in one line when
    it is not a device at all (:class:`UsageError`) or not one this machine has."""
    if device is None:
        return None
    text = str(device)
    if not _DEVICE.match(text):
        raise UsageError(f"{option} {text}: not a device (cpu, cuda, cuda:N, mps)")
    if text.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise StorylensError(
                f"{option} {text}: not available on this machine (torch {torch.__version__} sees no CUDA device)"
            )
        index = int(text.split(":")[1]) if ":" in text else 0
        if index >= n:
            seen = "cuda:0" if n == 1 else f"cuda:0 .. cuda:{n - 1}"
            raise StorylensError(
                f"{option} {text}: not available on this machine (torch sees {n} CUDA "
                f"device{'s' if n > 1 else ''}: {seen})"
            )
    if text == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise StorylensError(
                f"{option} mps: not available on this machine "
                f"(torch {torch.__version__} has no usable MPS backend here)"
            )
    return torch.device(text)


class _NotFound(StorylensError):
    """Not a transformers model that can be found here: :func:`load_lm` then tries storylens's own loader."""


def load_lm(
    source: str | os.PathLike | None = None,
    *,
    allow_download: bool = False,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> AttentionLM:
    """Open ``source``: a storylens model folder (default: the shipped Tiny Storyteller), a
    transformers model folder, or a hub id (only with ``allow_download``, unless cached), in
    ``dtype`` (default: as stored) on ``device`` (default: the CPU).

    Refused in one line (:class:`StorylensError`): a model whose weights do not all match its
    config, hold NaN or infinite numbers, are pickled (only safetensors is read), that is not
    a causal language model, whose config or tokenizer config names custom code (never run), or
    whose config gives sizes that are no sizes or past this machine's memory or its weights
    (:mod:`storylens.lm.configs`, before anything is built)."""

    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    if source is not None and (Path(source) / "config.json").is_file() and is_transformers_folder(Path(source)):
        return _load_transformers(str(source), allow_download=False, dtype=dtype, device=device)
    if source is not None and not Path(source).exists():
        try:
            with hub_offline(not allow_download):
                return _load_transformers(str(source), allow_download=allow_download, dtype=dtype, device=device)
        except _NotFound:
            pass  # not a transformers model on the hub: try storylens's own loader (and its message)
    model = load_model(source, allow_download=allow_download)  # refuses NaN or infinite weights itself
    where = (model.source_folder or Path(str(source))) / "model.safetensors"
    model = _move(model, str(source or "the shipped model"), dtype, device)
    if dtype is not None:
        _check_finite(model, lambda k: str(where), cast=dtype)
    return NativeLM(model)


_M = TypeVar("_M", bound=nn.Module)


def _move(model: _M, source: str, dtype: torch.dtype | None, device: torch.device | None) -> _M:
    if dtype is None and device is None:
        return model
    try:
        if device is not None:
            model = model.to(device=device)
        return model if dtype is None else model.to(dtype=dtype)
    except (RuntimeError, TypeError) as e:  # float64 on MPS, out of device memory, ...
        what = " as ".join(str(x).replace("torch.", "") for x in (device, dtype) if x is not None)
        raise StorylensError(f"{source}: cannot run on {what} ({_one_line(e)[:200]})") from None


def _check_finite(model: nn.Module, where: Callable[[str], str], cast: torch.dtype | None = None) -> None:
    """Refuse a parameter holding NaN or infinite numbers (``cast``: the dtype it was just cast to,
    whose range it may have overflowed)."""
    with torch.no_grad():
        for k, p in model.named_parameters():  # a tied weight once
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                if cast is not None:
                    name = str(cast).replace("torch.", "")
                    raise StorylensError(
                        f"{where(k)}: {k} holds numbers beyond {name}'s range (infinite once "
                        "cast); run it in float32 or bfloat16"
                    )
                raise StorylensError(f"{where(k)}: {k} holds NaN or infinite numbers")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' loader chatter (its load report, progress bars, warnings) kept off stderr:
    storylens says what is wrong in its own single line."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


_OTHER_WEIGHTS = ("*.h5", "*.msgpack", "*.gguf", "*.onnx")


def _check_weight_files(folder: Path) -> None:
    """Only safetensors is read: a folder with pickled (or other) weights and none in safetensors is
    refused before transformers sees it (unpickling a file runs code it holds)."""
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(f.name for pattern in _PICKLES for f in folder.glob(pattern))
    if pickles:
        raise StorylensError(
            f"{folder}: holds pickled weights ({', '.join(pickles[:3])}), which storylens never opens (unpickling "
            "runs code the file holds); storylens reads only safetensors weights: convert them where you trust "
            "the file (transformers' from_pretrained, then save_pretrained, writes model.safetensors)"
        )
    other = sorted(f.name for pattern in _OTHER_WEIGHTS for f in folder.glob(pattern))
    raise StorylensError(
        f"{folder}: no model.safetensors"
        + (f" (only {', '.join(other[:3])})" if other else "")
        + "; storylens reads only safetensors weights"
    )


def _check_causal(source: str, config) -> None:
    """A causal language model (decoder-only) by its config, before any weight is read."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise StorylensError(
            f"{source}: is a `{kind}` model, not a causal language model (transformers "
            f"{transformers.__version__} has no causal-LM class for `{kind}`)"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise StorylensError(
            f"{source}: is a `{kind}` model (sequence-to-sequence), not a causal language model; "
            "storylens reads decoder-only models (GPT-2, GPT-Neo, Llama, ...)"
        )
    if (
        kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(config, "is_decoder", False)
        and not getattr(config, "causal", False)
    ):
        raise StorylensError(
            f"{source}: is a `{kind}` model (encoder-only), not a causal language model; "
            "storylens reads decoder-only models (GPT-2, GPT-Neo, Llama, ...)"
        )


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _tied_names(model: nn.Module) -> set[str]:
    """The weights that are another weight (``lm_head.weight`` as the embedding): legitimately
    absent from the file."""
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers 5: the ties in force, target -> source
    if tied is None:  # transformers 4: the class's tieable names, tied when the config says so
        if not getattr(getattr(model, "config", None), "tie_word_embeddings", True):
            return set()
        tied = getattr(model, "_tied_weights_keys", None) or ()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def _check_loading_info(source: str, model: nn.Module, info: dict) -> None:
    """Every weight of the model from the file, nothing else, each the shape the config implies."""

    def matching(keys, patterns):
        return [k for k in keys if not any(re.search(p, k) for p in patterns or ())]

    missing = set(info.get("missing_keys") or ()) - _tied_names(model)
    missing = matching(missing, getattr(model, "_keys_to_ignore_on_load_missing", None))
    unexpected = matching(
        set(info.get("unexpected_keys") or ()), getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    )
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: _natural(m[0]))
    if not (missing or unexpected or mismatched):
        return

    def few(names):
        names = sorted(names, key=_natural)
        return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({few(unexpected)})")
    if mismatched:
        k, got, want = mismatched[0]
        parts.append(
            f"{len(mismatched)} of the wrong shape ({k}: {list(got)} in the file, "
            f"{list(want)} by config.json{', ...' if len(mismatched) > 1 else ''})"
        )
    raise StorylensError(f"{source}: weights do not match config.json: {'; '.join(parts)}")


def _weights_file(source: str) -> Callable[[str], str]:
    """The file a weight was read from (a sharded checkpoint's index names it), for messages."""
    folder = Path(source)
    if not folder.is_dir():
        return lambda k: source
    index = {}
    try:
        index = read_json(folder / "model.safetensors.index.json").get("weight_map", {})
    except (OSError, ValueError, AttributeError, StorylensError):
        pass
    return lambda k: str(folder / index.get(k, "model.safetensors"))


def _load_transformers(source: str, *, allow_download: bool, dtype, device) -> TransformersLM:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise StorylensError(
            f"{source}: a transformers model needs the transformers package: {install_hint('hf')}"
        ) from None
    # never custom code: transformers would ask on stdin, and run it on "y"
    kw = {"local_files_only": not allow_download, "trust_remote_code": False}
    folder = Path(source) if Path(source).is_dir() else None
    if folder is not None:
        _check_weight_files(folder)
    with _quiet_transformers():
        try:
            check_no_custom_code(source, {"local_files_only": not allow_download})
            config = AutoConfig.from_pretrained(source, **kw)
        except CONFIG_ERRORS as e:
            raise _NotFound(
                f"{source}: cannot load as a transformers causal LM ({type(e).__name__}: {_one_line(e)[:200]})"
            ) from None
        _check_causal(source, config)
        check_sizes(source, config, folder)  # before anything is built
        try:
            tok = AutoTokenizer.from_pretrained(source, **kw)
            # safetensors only (nothing is unpickled); a wrong shape is reported below, not raised
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                source,
                config=config,
                attn_implementation="eager",
                use_safetensors=True,
                ignore_mismatched_sizes=True,
                output_loading_info=True,
                **kw,
            )
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise StorylensError(
                f"{source}: cannot load as a transformers causal LM ({type(e).__name__}: {_one_line(e)[:200]})"
            ) from None
    model, info = loaded  # output_loading_info: (model, loading info)
    _check_loading_info(source, model, info)
    _check_finite(model, _weights_file(source))
    model.eval()
    model = _move(model, source, dtype, device)
    if dtype is not None:
        _check_finite(model, _weights_file(source), cast=dtype)
    try:
        lm = TransformersLM(model, tok, name=source)
    except StorylensError as e:
        raise StorylensError(f"{source}: {e}") from None
    if Path(source).is_dir():
        lm.source_folder = Path(source)
    return lm
