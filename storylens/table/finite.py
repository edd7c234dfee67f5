"""A batch whose scores are not finite is refused, naming the earliest head (the head table's check)."""

from __future__ import annotations

import torch

from storylens.core.errors import StorylensError
from storylens.core.heads import Head
from storylens.engine.encode import StoryBatch

Scores = dict[str, tuple[torch.Tensor, torch.Tensor]]  # detector: ([batch, layer, head] values, [batch] counted)


def refuse_non_finite(
    batch: StoryBatch,
    raw: Scores,
    norm: Scores,
    output: tuple[torch.Tensor, torch.Tensor] | None,
    dtype: torch.dtype,
) -> None:
    """Refuse a batch in which a head's score of a story that counts is NaN or infinite (its
    attention, formed from overflowing queries or keys, or its value vectors are): one line naming
    the earliest such head (the layers after it only inherit it), L{layer}H{head} from 1."""
    found: list[tuple[int, int, int, str]] = []  # (layer, head, batch row, what)
    kinds = [(raw, "{} score"), (norm, "norm-weighted {} score")]
    named = [(what.format(k), v, keep) for scores, what in kinds for k, (v, keep) in scores.items()]
    every = [*named, *([("output norm", *output)] if output is not None else [])]
    bads = [~torch.isfinite(values) & keep.to(values.device)[:, None, None] for _, values, keep in every]
    if not bads or not bool(torch.stack([b.any() for b in bads]).any()):  # one synchronising check a batch
        return
    for (what, _, _), bad in zip(every, bads):
        if bool(bad.any()):
            b, layer, head = min(bad.nonzero().tolist(), key=lambda i: (i[1], i[2], i[0]))
            found.append((layer, head, b, what))
    if not found:
        return
    layer, head, b, what = min(found, key=lambda f: f[:2])
    stories = batch.stories
    story = f" on story {stories[b].index + 1}" if b < len(stories) else ""
    name = str(dtype).replace("torch.", "")
    raise StorylensError(
        f"{Head(layer, head).label}: its {what} is NaN or infinite{story} (its queries, keys or values overflow "
        f"{name}); refused, nothing written"
    )
