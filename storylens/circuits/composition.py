"""Q, K and V composition between every pair of heads, from the weights (Elhage et al. 2021), as TransformerLens's
``all_composition_scores`` defines them and with its conventions, grouped key/value heads native.

For an earlier head ``a`` writing ``OV_a = W_V^a W_O^a`` (``[d_model, d_model]``, row vectors: ``x OV_a`` is what
it writes) and a later head ``b`` reading through ``QK_b = W_Q^b W_K^b^T`` or ``OV_b``:

    Q composition  |OV_a QK_b|   / (|OV_a| |QK_b|)
    K composition  |OV_a QK_b^T| / (|OV_a| |QK_b|)
    V composition  |OV_a OV_b|   / (|OV_a| |OV_b|)

``|.|`` the Frobenius norm; 0 for a pair not in rising blocks (a head of the same block or a later one writes
nothing the reader sees). Never formed at ``[d_model, d_model]``: with ``R_a`` the triangular factor of
``W_V^a`` (``W_V^a = Q R_a``, so ``|W_V^a M| = |R_a M|`` for any ``M``) and ``S_b`` that of ``W_K^b`` (or of
``W_Q^b``, or of ``W_O^b^T``), ``|OV_a QK_b| = |R_a (W_O^a W_Q^b) S_b^T|``, a ``[head_size, head_size]`` product
per pair: ``pairs x head_size^2 x d_model`` multiplications in float64. The weights are
:func:`storylens.effects.weights.head_weights`'s, the norms folded into the readers (``fold=False``: as stored,
TransformerLens's unprocessed bridge). A key/value head's factor is made once and read by every query head of its
group.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from storylens.core.heads import Head
from storylens.effects.weights import HeadWeights

MODES = ("q", "k", "v")


def _factor(W: torch.Tensor) -> torch.Tensor:
    """``[..., dh, dh]``: ``R`` with ``|W M| = |R M|`` for ``W [..., d, dh]`` (the QR factor; ``W^T W = R^T R``)."""
    return torch.linalg.qr(W, mode="r")[1]


def composition_scores(w: HeadWeights) -> dict[str, torch.Tensor]:
    """``{"q", "k", "v"}``: ``[layer, head, layer, head]`` scores, writer first (the module docstring)."""
    L, H = w.shape
    left = w.kv(_factor(w.W_V)) @ w.W_O  # [L, H, dh, d]: R_a W_O^a, as long as OV_a
    size = left.flatten(-2).norm(dim=-1)  # [L, H]: |OV_a|
    reads = {  # the reader's matrix M_b = F_b G_b^T, seen as F_b and the factor S_b of G_b: |X M_b| = |X F_b S_b^T|
        "q": (w.W_Q, w.kv(_factor(w.W_K))),  # QK_b = W_Q W_K^T
        "k": (w.kv(w.W_K), _factor(w.W_Q)),  # QK_b^T = W_K W_Q^T
        "v": (w.kv(w.W_V), _factor(w.W_O.transpose(-1, -2))),  # OV_b = W_V W_O
    }
    out = {}
    for mode, (F, S) in reads.items():
        reader = (F @ S.transpose(-1, -2)).flatten(-2).norm(dim=-1)  # [L, H]: |M_b|
        scores = torch.zeros(L, H, L, H, dtype=left.dtype)
        for a in range(L - 1):  # [H, dh, d] with every later block's [L', H, d, dh]: [H, L', H, dh, dh]
            product = torch.einsum("hid,lgdj->hlgij", left[a], F[a + 1 :]) @ S[a + 1 :].transpose(-1, -2)
            scores[a, :, a + 1 :] = product.flatten(-2).norm(dim=-1)
        out[mode] = scores / size[:, :, None, None] / reader[None, None]
    return out


# the most multiplications composition.csv is made with unless asked (--composition): the shipped model's are
# about 9.4e8 (a fraction of a second); a 30 x 9 Llama's about 2.8e11 (tens of seconds on a 2-core CPU)
COMPOSITION_BUDGET = 4 * 10**9


def composition_cost(w: HeadWeights) -> int:
    """Multiplications :func:`composition_scores` makes: three modes, each pair in rising blocks ``head_size^2 x
    d_model`` (and as much again for the reader's factor)."""
    L, H = w.shape
    pairs = H * H * L * (L - 1) // 2
    dh, d = w.W_O.shape[-2], w.W_O.shape[-1]
    return 3 * pairs * dh * dh * (d + dh)


COMPOSITION_CSV = ("writer", "reader", "q", "k", "v")


def write_composition_csv(scores: dict[str, torch.Tensor], path: Path) -> Path:
    """``composition.csv``: one row per (writer, reader) pair in rising blocks, labels as people read them
    (``L{block}H{head}`` from 1) and the three scores, strongest Q, K or V composition first."""
    L, H = scores["q"].shape[:2]
    rows: list[tuple[str, str, list[float]]] = []
    for a in Head.every(L, H):
        for b in Head.every(L, H):
            if b.layer > a.layer:
                at = (a.layer, a.head, b.layer, b.head)
                rows.append((a.label, b.label, [float(scores[m][at]) for m in MODES]))
    rows.sort(key=lambda r: -max(r[2]))
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(COMPOSITION_CSV)
        out.writerows((writer, reader, *(f"{x:.6g}" for x in xs)) for writer, reader, xs in rows)
    return path
