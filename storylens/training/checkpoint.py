"""Training checkpoints as one safetensors file: weights, optimizer moments, RNG states.

Written atomically (temporary file, fsync, rename), so a kill mid-write leaves the
previous checkpoint intact. Nothing is unpickled when reading one back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TypeGuard

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from storylens.core.errors import StorylensError
from storylens.core.files import checked_file
from storylens.core.publish import write_bytes_atomic
from storylens.model.gpt import GPT


def atomic_save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors bytes written whole or not at all (:func:`storylens.core.publish.write_bytes_atomic`)."""

    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    write_bytes_atomic(path, data, fault="checkpoint-before-replace")


def remove_stale_temporaries(path: Path) -> None:
    """Temporary checkpoint files a killed run left (call only while holding the run's lock)."""
    for p in Path(path).parent.glob(f".{Path(path).name}.tmp-*"):
        p.unlink(missing_ok=True)


def validate_state(path: Path, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """Refuse (one line) a checkpoint whose tensors are not exactly the expected keys, shapes and
    dtypes, or hold NaN or infinity."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise StorylensError(
            f"{path}: {what} does not match the run's model (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for k, ref in expected.items():
        t = tensors[k]
        if t.shape != ref.shape:
            raise StorylensError(f"{path}: {what} {k} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if t.dtype != ref.dtype:
            raise StorylensError(f"{path}: {what} {k} is {t.dtype}, expected {ref.dtype}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise StorylensError(f"{path}: {what} {k} holds NaN or infinite numbers")


def save_checkpoint(path: Path, model: GPT, optimizer, state: dict, rng: dict[str, torch.Tensor], ema=None) -> None:
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if ema is not None:
        tensors.update({f"ema.{k}": v.detach().clone() for k, v in ema.state_dict().items() if k != "lm_head.weight"})
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
    """Return (model_state, optimizer_state, state, rng, ema_state or None) or raise StorylensError."""
    path = Path(path)
    if not path.exists():
        raise StorylensError(f"{path}: no checkpoint to resume from")
    checked_file(path, None)
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        state = json.loads(meta["state"])
        groups = json.loads(meta["param_groups"])
        if not isinstance(state, dict) or not isinstance(groups, list):
            raise ValueError("its state is not a JSON object, or its parameter groups not a list")
        model_sd = _tied({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, "weights")
        opt_state: dict[int, dict] = {}
        for k, v in tensors.items():
            if k.startswith("optim."):
                _, pid, name = k.split(".", 2)
                opt_state.setdefault(int(pid), {})[name] = v
        rng = {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}
        ema = {k[4:]: v for k, v in tensors.items() if k.startswith("ema.")}
        ema_sd = _tied(ema, "EMA weights") if ema else None
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError, TypeError, RecursionError) as e:
        raise StorylensError(f"{path}: corrupt or truncated checkpoint ({type(e).__name__}: {e})") from None
    return model_sd, {"state": opt_state, "param_groups": groups}, state, rng, ema_sd


def _tied(weights: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """``weights`` with the output layer tied to the token embedding, as the model holds them."""
    if "transformer.wte.weight" not in weights:
        raise KeyError(f"the {what} miss transformer.wte.weight")
    return {**weights, "lm_head.weight": weights["transformer.wte.weight"]}


def _whole(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _seconds(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def check_run_state(path: Path, state: dict, max_steps: int) -> None:
    """Refuse (one line) a checkpoint's run state that no run of a training configuration writes: the step a whole number from 0 to
    ``max_steps``, one loss per step (finite numbers), evaluations at increasing steps no later than it, times
    finite and not negative."""
    step = state.get("step")
    if not _whole(step) or not 0 <= step <= max_steps:
        raise StorylensError(f"{path}: step {step!r} is not a whole number from 0 to max_steps {max_steps}")
    losses = state.get("losses")
    if not isinstance(losses, list) or len(losses) != step:
        got = len(losses) if isinstance(losses, list) else repr(losses)
        raise StorylensError(f"{path}: {got} losses for step {step}; a run records one loss per step")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in losses):
        raise StorylensError(f"{path}: a loss that is not a finite number")
    evals = state.get("evals")
    steps = [e.get("step") if isinstance(e, dict) else None for e in evals] if isinstance(evals, list) else None
    if steps is None or not all(_whole(s) and 0 <= s <= step for s in steps) or steps != sorted(set(steps)):  # type: ignore[type-var]
        raise StorylensError(f"{path}: evaluations that are not at increasing steps up to step {step}")
    for key in ("train_seconds", "timeline_seconds"):
        if key in state and not _seconds(state[key]):
            raise StorylensError(f"{path}: {key} {state[key]!r} is not a finite number of seconds, 0 or more")
