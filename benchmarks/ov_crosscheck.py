"""Every head's OV copying score from storylens beside TransformerLens's, on the shipped model's transformers export
(unprocessed weights, float64): the table the closing note of issue 59 shows.

    python benchmarks/ov_crosscheck.py [--json benchmarks/ov_crosscheck.json]

storylens: :func:`storylens.effects.weights.ov_copying` (the eigenvalues of ``W_O W_U W_E W_V``, through factors);
TransformerLens: ``(W_E @ OV @ W_U).eigenvalues`` of its ``FactoredMatrix``, ``Re(sum) / sum |.|``, as its users
compute the copying score. tests/analysis/test_crosscheck.py holds the two equal within derived bounds."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from storylens.core.heads import head_label
from storylens.effects.weights import head_weights, ov_copying
from storylens.lm import load_lm
from storylens.model.hub import export_hf, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from transformer_lens.model_bridge import TransformerBridge

    os.environ["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(load_model(), Path(tmp) / "tiny-storyteller")
        ours = ov_copying(head_weights(load_lm(str(folder), dtype=torch.float64), fold=False))
        bridge = TransformerBridge.boot_transformers(str(folder), device="cpu", dtype=torch.float64).eval()
        eig = (bridge.W_E @ bridge.OV @ bridge.W_U).eigenvalues
        theirs = (eig.sum(-1).real / eig.abs().sum(-1)).detach()
    rows = [
        {"head": head_label(layer, h), "storylens": float(ours[layer, h]), "transformerlens": float(theirs[layer, h])}
        for layer in range(ours.shape[0])
        for h in range(ours.shape[1])
    ]
    print("| head | storylens | TransformerLens | difference |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['head']} | {r['storylens']:+.6f} | {r['transformerlens']:+.6f} | {r['storylens'] - r['transformerlens']:.1e} |"
        )
    gap = max(abs(r["storylens"] - r["transformerlens"]) for r in rows)
    print(f"largest difference: {gap:.1e}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "largest_difference": gap}, indent=1) + "\n")


if __name__ == "__main__":
    main()
