"""Why a retrain on another CPU does not give the shipped weights bit for bit: one seeded training
step of the shipped recipe's model (the same initial weights, the same batch), run in a fresh
process under different CPU settings, and a digest of every gradient's bytes.

    python benchmarks/determinism.py

The same setting run twice gives the same digest (training here is deterministic run to run).
A different vector instruction set for torch's own kernels (``ATEN_CPU_CAPABILITY``), MKL's
other code path (``MKL_CBWR=COMPATIBLE``) or another thread count gives other bits: the kernels a
CPU is dispatched to decide the rounding, so a run on another processor (the shipped model was
trained on an Intel Xeon) parts from it from the first step and never meets it again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEP = """
import hashlib, torch
from storylens.model.gpt import GPT, GPTConfig
torch.manual_seed(1337)
model = GPT(GPTConfig(dropout=0.1, attn_dropout=0.0))
x = torch.randint(4096, (16, 257), generator=torch.Generator().manual_seed(1337))
loss = model(x[:, :-1], x[:, 1:]).loss
loss.backward()
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.grad.numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), f"{loss.item():.9f}", digest.hexdigest()[:16])
"""

SETTINGS = [
    ("as installed", {}),
    ("as installed, again", {}),
    ("ATEN_CPU_CAPABILITY=avx2", {"ATEN_CPU_CAPABILITY": "avx2"}),
    ("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}),
    ("MKL_CBWR=COMPATIBLE", {"MKL_CBWR": "COMPATIBLE"}),
    ("OMP_NUM_THREADS=1", {"OMP_NUM_THREADS": "1"}),
]


def main() -> None:
    from bench_perf import _cpu  # the same machine description as the other benchmarks

    print(f"one seeded training step on {_cpu()}, {os.cpu_count()} cores")
    print(f"{'setting':<30} {'kernels':<8} {'threads':>7}  {'loss':<12} gradient digest")
    for label, env in SETTINGS:
        out = subprocess.run(
            [sys.executable, "-c", STEP], env={**os.environ, **env}, capture_output=True, text=True, check=True
        ).stdout.split()
        print(f"{label:<30} {out[0]:<8} {out[1]:>7}  {out[2]:<12} {out[3]}")


if __name__ == "__main__":
    main()
