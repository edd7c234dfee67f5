"""Training checkpoints as one safetensors file: weights, optimizer moments, RNG states.

Written atomically (temporary file, fsync, rename), so a kill mid-write leaves the
previous checkpoint intact. Nothing is unpickled when reading one back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import StorylensError


def atomic_save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(path: Path, model, optimizer, state: dict, rng: dict[str, torch.Tensor]) -> None:
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    opt_sd = optimizer.state_dict()
    for pid, st in opt_sd["state"].items():
        for k, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v)
            tensors[f"optim.{pid}.{k}"] = t.detach().clone().reshape(t.shape)
    for k, v in rng.items():
        tensors[f"rng.{k}"] = v
    meta = {"state": json.dumps(state), "param_groups": json.dumps(opt_sd["param_groups"])}
    atomic_save_tensors(tensors, path, meta)


def load_checkpoint(path: Path):
    """Return (model_state, optimizer_state, state, rng) or raise StorylensError."""
    path = Path(path)
    if not path.is_file():
        raise StorylensError(f"{path}: no checkpoint to resume from")
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        state = json.loads(meta["state"])
        groups = json.loads(meta["param_groups"])
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as e:
        raise StorylensError(f"{path}: corrupt or truncated checkpoint ({e})") from None
    model_sd = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    model_sd["lm_head.weight"] = model_sd["transformer.wte.weight"]
    opt_state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, pid, name = k.split(".", 2)
            opt_state.setdefault(int(pid), {})[name] = v
    rng = {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}
    return model_sd, {"state": opt_state, "param_groups": groups}, state, rng
