"""Two OV-circuit scores that the interpretability literature reads from a head's weights, as TransformerLens's
users compute them from ``W_E``, ``W_V``, ``W_O`` and ``W_U`` (:class:`~storylens.effects.weights.HeadWeights`,
the norms folded in), a block and some rows of the full OV circuit ``W_E W_V^h W_O^h W_U`` at a time, so that the
``[vocab, vocab]`` matrix is never held (:data:`CHUNK_BYTES` of it at most).

``copy_suppression``
    McDougall et al. (2023), "Copy Suppression: Comprehensively Understanding an Attention Head" (GPT-2 small's
    L10H7): the share of tokens ``t`` whose own logit is among the ``k`` most lowered when the head reads ``t``
    (the row ``t`` of the full OV circuit, ``t``'s entry among its ``k`` smallest; the paper's ``k`` is 10). A head
    that suppresses what it reads scores near 1; one that copies, near 0. The paper reads the tokens through an
    effective embedding (the first MLP applied to ``W_E``); here ``W_E`` itself, as the copying score does.
``successor``
    Gould et al. (2023), "Successor Heads: Recurring, Interpretable Attention Heads In The Wild": over ordinal
    sequences (numbers, number words, ordinals, days, months, letters; :func:`ordinal_sequences` keeps the members
    the tokenizer makes one token), the share of members ``t`` (all but each sequence's last) for which, among
    the sequence's tokens, the head's output when it reads ``t`` raises the logit of ``t``'s successor the most.
    A head that maps each item to the next scores 1; chance is about one over the sequence's length. (The paper
    also uses the effective embedding; here ``W_E``.)
"""

from __future__ import annotations

import torch

from storylens.effects.weights import F64, HeadWeights

CHUNK_BYTES = 128 << 20  # the part of a block's full OV circuits formed at a time
SUPPRESSED = 10  # McDougall et al.'s k: the token's own logit among its row's k lowest

ORDINALS = {  # Gould et al.'s tasks, as words (each item's tokens are looked up with a leading space and without)
    "digits": [str(i) for i in range(1, 10)],
    "numbers": [str(i) for i in range(10, 21)],
    "number words": ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"],
    "ordinals": ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"],
    "days": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "months": [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ],  # fmt: skip
    "letters": [chr(c) for c in range(ord("A"), ord("Z") + 1)],
}


def _ov(w: HeadWeights) -> torch.Tensor:
    """``[layer, head, d_model, d_model]``: each head's ``W_V W_O`` (its key/value head's ``W_V``)."""
    return w.kv(w.W_V) @ w.W_O


def copy_suppression(w: HeadWeights, k: int = SUPPRESSED, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """``[layer, head]``: each head's copy suppression score (the module docstring) over ``tokens`` (token ids;
    None: the whole vocabulary). Ties count against the score: ``t`` is among the ``k`` lowest when fewer than
    ``k`` entries of its row are below or equal to it, itself aside."""
    ids = torch.arange(w.W_E.shape[0]) if tokens is None else tokens
    ov = _ov(w)  # [L, H, d, d]
    vocab = w.W_U.shape[1]
    rows = max(1, CHUNK_BYTES // (ov.shape[1] * vocab * 8))
    hits = torch.zeros(ov.shape[:2], dtype=F64)
    for layer in range(ov.shape[0]):
        for start in range(0, len(ids), rows):
            part = ids[start : start + rows]
            logits = (w.W_E[part] @ ov[layer]) @ w.W_U  # [H, rows, vocab]
            own = logits[:, torch.arange(len(part)), part]  # [H, rows]
            below = (logits <= own[..., None]).sum(-1) - 1  # entries at or below the token's own, itself aside
            hits[layer] += (below < k).sum(-1).to(F64)
    return hits / len(ids)


def successor(w: HeadWeights, runs: list[list[int]]) -> torch.Tensor:
    """``[layer, head]``: each head's successor score (the module docstring) over ``runs`` (token ids of
    consecutive members of an ordinal sequence, in order; :func:`ordinal_sequences`); NaN where no run has two."""
    ov = _ov(w)
    hits, total = torch.zeros(ov.shape[:2], dtype=F64), 0
    for run in runs:
        if len(run) < 2:
            continue
        ids = torch.tensor(run)
        logits = (w.W_E[ids[:-1]] @ ov) @ w.W_U[:, ids]  # [L, H, members - 1, members]: among the run's own
        best = logits.argmax(-1)  # ties: the earliest
        hits += (best == torch.arange(1, len(run))).sum(-1).to(F64)
        total += len(run) - 1
    return hits / total if total else torch.full(ov.shape[:2], float("nan"), dtype=F64)


def ordinal_sequences(encode) -> dict[str, list[list[int]]]:
    """:data:`ORDINALS` as runs of token ids: ``encode(text)`` gives a text's ids; each sequence is read with a
    leading space (as mid-sentence words are) and, where more of its members are one token so, without. A member
    that is not one token breaks its sequence into runs (its neighbours are not each other's successors); a
    sequence with no run of two is left out."""
    out = {}
    for name, words in ORDINALS.items():
        best: list[list[int]] = []
        for prefix in (" ", ""):
            runs: list[list[int]] = [[]]
            for x in words:
                ids = encode(prefix + x)
                if len(ids) == 1:
                    runs[-1].append(ids[0])
                elif runs[-1]:
                    runs.append([])
            runs = [r for r in runs if len(r) >= 2]
            if sum(map(len, runs)) > sum(map(len, best)):
                best = runs
        if best:
            out[name] = best
    return out
