"""What a transformers model asks for, checked before transformers builds or runs anything.

* **Custom code.** A ``config.json`` or ``tokenizer_config.json`` with an ``auto_map`` names Python
  classes shipped beside the weights; transformers would ask on stdin whether to run them (and run
  them on "y"). storylens never does: such a model is refused in one line before transformers reads
  it, whatever stdin holds (and transformers is always told ``trust_remote_code=False``).
* **Sizes.** Every size a config gives (layers, heads, hidden size, vocabulary, ...) is a whole
  number of at least 1, heads divide the hidden size, key/value groups divide the heads; and the
  parameters the config implies at the very least (the token embedding, and each layer's output
  projection: ``vocab * hidden + layers * hidden * heads * head_dim``; every decoder-only model has
  both, and more) must fit the memory available here and, for a folder, the weights it holds, so a
  config asking for 100,000 layers is refused before a single layer is built.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from storylens.core.errors import StorylensError
from storylens.core.files import checked_file
from storylens.core.memory import available_memory, gigabytes

try:  # huggingface_hub's strict dataclasses (transformers 5's configs): a field of the wrong type
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # older huggingface_hub: configs raise TypeError or ValueError themselves
    StrictDataclassError = ValueError  # type: ignore[assignment,misc]

# what reading a config that is no config raises (a field of the wrong type, a size of 0 divided by)
CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, StrictDataclassError)

_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_REQUIRED = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
_OPTIONAL = ("num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "max_position_embeddings")


def check_no_custom_code(source: str, kw: dict) -> None:
    """Refuse a model whose config or tokenizer config names custom code (``auto_map``), reading
    only those two JSON files (transformers' readers: a folder, the hub cache or, if allowed, the hub)."""
    from transformers import PretrainedConfig
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    config, _ = PretrainedConfig.get_config_dict(source, **kw)
    for name, doc in (("config.json", config), ("tokenizer_config.json", get_tokenizer_config(source, **kw))):
        if not isinstance(doc, dict):  # transformers would fail on it with an AttributeError
            raise StorylensError(f"{source}: {name}: not a JSON object")
        named = doc.get("auto_map")
        if named:
            shown = ", ".join(_classes(named)[:3]) or repr(named)
            raise StorylensError(
                f"{source}: {name} names custom code (auto_map: {shown}), which storylens never runs; "
                "it reads only models transformers itself implements (GPT-2, GPT-Neo, Llama, ...)"
            )


def _classes(named: Any) -> list[str]:
    """The class names an ``auto_map`` gives (``{"AutoTokenizer": [slow, fast]}``: both, where set)."""
    if isinstance(named, dict):
        return [c for v in named.values() for c in _classes(v)]
    if isinstance(named, (list, tuple)):
        return [c for v in named for c in _classes(v)]
    return [str(named)] if named else []


def _field(config: Any, name: str) -> str:
    """The name ``config.json`` gives a standard attribute (GPT-2's ``n_layer`` for ``num_hidden_layers``)."""
    return getattr(config, "attribute_map", {}).get(name, name)


def _sizes(source: str, config: Any) -> dict[str, int]:
    """The config's sizes, each a whole number of at least 1 (optional ones where given)."""
    sizes: dict[str, int] = {}
    for name in _REQUIRED + _OPTIONAL:
        value = getattr(config, name, None)
        if value is None and name in _OPTIONAL:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StorylensError(
                f"{source}: config.json: {_field(config, name)} {value!r} is not a whole number of at least 1"
            )
        sizes[name] = value
    return sizes


def _check_shapes(source: str, config: Any, s: dict[str, int]) -> None:
    hidden, heads = s["hidden_size"], s["num_attention_heads"]
    if "head_dim" not in s and hidden % heads:
        raise StorylensError(
            f"{source}: config.json: {_field(config, 'hidden_size')} {hidden} is not divisible by "
            f"{_field(config, 'num_attention_heads')} {heads}"
        )
    groups = s.get("num_key_value_heads", heads)
    if heads % groups:
        raise StorylensError(
            f"{source}: config.json: {_field(config, 'num_attention_heads')} {heads} is not divisible by "
            f"{_field(config, 'num_key_value_heads')} {groups}"
        )


def least_parameters(s: dict[str, int]) -> int:
    """The parameters a decoder-only model of these sizes has at the very least: its token embedding
    and each layer's output projection (everything else only adds)."""
    hidden, heads = s["hidden_size"], s["num_attention_heads"]
    head_dim = s.get("head_dim", hidden // heads)
    return s["vocab_size"] * hidden + s["num_hidden_layers"] * hidden * heads * head_dim


def built_parameters(config: Any, layers: int) -> int | None:
    """The parameters ``config`` builds with ``layers`` layers, counted exactly: the model built with one layer
    and with two on the meta device (no memory), the difference per layer, the rest once (tied weights counted
    once, as ``parameters()`` does). None where such a model cannot be built here (its class refuses a layer
    count its other fields contradict): :func:`least_parameters` is the bound then."""
    from transformers import AutoModelForCausalLM

    counts = []
    for n in (1, 2):
        small = copy.deepcopy(config)
        small.num_hidden_layers = n
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(small)
        except Exception:  # noqa: BLE001 - any class's own refusal: fall back to the bound
            return None
        counts.append(sum(p.numel() for p in model.parameters()))
    per_layer = counts[1] - counts[0]
    return counts[0] - per_layer + layers * per_layer


FLOATING = ("F64", "F32", "F16", "BF16")  # the safetensors dtypes of weights storylens reads (unquantised)


def stored_parameters(folder: Path, quantized: bool = False) -> int | None:
    """The numbers the folder's safetensors files hold, from their headers (no tensor is read); a tensor stored
    as anything but a floating-point type of :data:`FLOATING` (integers, booleans, float8) is refused in one line
    unless the config says the model is quantised (transformers would cast it to the config's dtype silently)."""
    total, files = 0, sorted(folder.glob("*.safetensors"))
    for file in files:
        checked_file(file, None)
        try:
            with safe_open(str(file), "pt") as f:
                for k in f.keys():
                    kind = f.get_slice(k).get_dtype()
                    mask = k.endswith((".attn.bias", ".attn.masked_bias"))  # GPT-2's causal-mask buffers: not loaded
                    if kind not in FLOATING and not quantized and not mask:
                        raise StorylensError(
                            f"{file}: {k} is stored as {kind}; storylens reads floating-point weights only"
                        )
                    n = 1
                    for d in f.get_slice(k).get_shape():
                        n *= d
                    total += n
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise StorylensError(f"{file}: corrupt or truncated weights ({' '.join(str(e).split())[:200]})") from None
    return total if files else None


def check_sizes(source: str, config: Any, folder: Path | None) -> None:
    """Refuse sizes that are no sizes, or that ask for more parameters than this machine's memory
    or (``folder``) the weights stored there hold, before anything is built."""
    quantized = getattr(config, "quantization_config", None) is not None  # packed numbers: no count to compare
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    s = _sizes(source, config)
    _check_shapes(source, config, s)
    built = built_parameters(config, s["num_hidden_layers"])
    least = least_parameters(s) if built is None else built
    what = (
        f"{'at least ' if built is None else ''}{least:,} parameters ({s['num_hidden_layers']:,} "
        f"layer{'s' if s['num_hidden_layers'] != 1 else ''}, hidden size {s['hidden_size']:,}, "
        f"{s['num_attention_heads']:,} heads, vocabulary {s['vocab_size']:,})"
    )
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    dtype = dtype.replace("torch.", "")
    if dtype not in _BYTES and not quantized:
        raise StorylensError(f"{source}: config.json: dtype {dtype} is not a floating-point type storylens reads")
    room = available_memory()
    need = least * _BYTES.get(dtype, 4)
    if room is not None and need > room:
        raise StorylensError(
            f"{source}: config.json asks for {what}: {gigabytes(need)} in {dtype if dtype in _BYTES else 'float32'}, "
            f"more than the {gigabytes(room)} of memory available here; refused before building it"
        )
    stored = stored_parameters(folder, quantized) if folder is not None else None
    floor = least_parameters(s) if built is None else built // 4  # past a quarter: no few tensors missing
    if stored is not None and floor > stored and not quantized:
        raise StorylensError(
            f"{source}: config.json asks for {what} but its weights hold {stored:,} numbers; refused before building it"
        )
