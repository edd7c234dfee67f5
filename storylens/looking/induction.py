"""The induction test on repeated random tokens, a head-table column of its own: ``induction_random``.

Olsson et al. 2022's probe, as TransformerLens's demos compute it: a sequence of ``length`` random
ordinary tokens (never a special one: their statistics are not a text's), fed twice after the
model's opening token, ``[marker] + r + r``. Where the second copy reaches token ``r[i]`` (position
``length + 1 + i``), an induction head looks back at the token that followed ``r[i]``'s first
occurrence (position ``2 + i``): ``key = query - length + 1``, the diagonal ``offset = 1 - length``
of the map. A head's score is the attention on that key, averaged over the second copy's
``length`` queries and over the sequences.

Random tokens carry no meaning, so a head scores high only by copying what followed before; a
previous-token head (key ``query - 1``) scores near 0. The value depends on the model and the seed
alone, not on the stories scored: it is measured once per run, after the stories, with one forward
pass of :data:`~storylens.looking.detectors.INDUCTION_SEQUENCES` sequences (4 x (1 + 2 x 50)
tokens by default, a sliver of any scoring pass), so a run on Ray, in one process, or resumed from a
checkpoint gets the same column.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from storylens.core.errors import StorylensError
from storylens.core.modes import eval_mode
from storylens.lm import AttentionLM
from storylens.looking.detectors import INDUCTION_LENGTH, INDUCTION_SEED, INDUCTION_SEQUENCES


def induction_sequences(
    vocab_size: int,
    special: Sequence[int],
    *,
    length: int,
    n: int,
    seed: int,
    marker: int,
) -> torch.Tensor:
    """``[n, 1 + 2 * length]``: the marker, then ``length`` random ordinary tokens (ids below
    ``vocab_size``, none in ``special``), twice. Its own random stream: no other is touched."""
    ordinary = torch.tensor([t for t in range(vocab_size) if t not in set(special)])
    if len(ordinary) < 2:
        raise StorylensError("induction test: the vocabulary has no ordinary tokens to draw")
    g = torch.Generator().manual_seed(seed)
    r = ordinary[torch.randint(len(ordinary), (n, length), generator=g)]
    return torch.cat([torch.full((n, 1), marker), r, r], dim=1)


def special_ids(lm: AttentionLM) -> list[int]:
    """The ids never drawn: the opening token and every special (added) token of the tokenizer."""
    return [lm.marker_id, *(int(t) for t in lm.tokenizer.get_added_tokens_decoder())]


def lm_sequences(
    lm: AttentionLM, *, n: int = INDUCTION_SEQUENCES, length: int = INDUCTION_LENGTH, seed: int = INDUCTION_SEED
) -> torch.Tensor | None:
    """The test's ``[n, 1 + 2 * length']`` ids for ``lm``: ``length`` cut so that both copies and the
    opening token fit its window, drawn from the ids both the model and its tokenizer know (a padded
    embedding's rows past the tokenizer were never trained); None when the window holds no test."""
    length = min(length, (lm.window - 1) // 2)
    if length < 2:
        return None
    vocab = min(lm.vocab_size, lm.tokenizer.get_vocab_size(with_added_tokens=True))
    return induction_sequences(vocab, special_ids(lm), length=length, n=n, seed=seed, marker=lm.marker_id)


def stripe_scores(patterns: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """``[layer, head]`` float64: each map's ``[batch, head, 1 + 2 * length, same]`` mean attention from the
    second copy's queries ``q = length + 1 .. 2 * length`` on ``q - length + 1``."""
    q = torch.arange(length + 1, 2 * length + 1)
    k = q - length + 1  # the token after the query's token in the first copy
    out = []
    for p in patterns:
        stripe = p[:, :, q.to(p.device), k.to(p.device)].double()  # [batch, head, length]
        out.append(stripe.mean((0, 2)).cpu())
    return torch.stack(out)


def induction_random(
    lm: AttentionLM, *, n: int = INDUCTION_SEQUENCES, length: int = INDUCTION_LENGTH, seed: int = INDUCTION_SEED
) -> torch.Tensor | None:
    """Every head's induction score on repeated random tokens, ``[layer, head]`` float64 (see the module
    docstring); None when the model's window is too short for the test."""
    ids = lm_sequences(lm, n=n, length=length, seed=seed)
    if ids is None:
        return None
    with torch.inference_mode(), eval_mode(lm.module):
        patterns = lm.patterns(ids.to(lm.device))
    return stripe_scores(patterns, (ids.shape[1] - 1) // 2)
