"""The lesson's ablation: the heads that look most at the main character's name, switched off alone and
together, against every head alone, with the loss on the name's tokens (``storylens ablate``). It picks its
heads from the head table, so it sits above both wings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from storylens.core.errors import StorylensError
from storylens.core.heads import Head
from storylens.core.progress import ProgressLines
from storylens.core.text import checked_stories
from storylens.data.names import name_vocabulary
from storylens.effects.ablation import MODES, AblationTable, ablation_loss_table, head_output_means
from storylens.engine.encode import encode_stories
from storylens.engine.record import Counter
from storylens.lm import ModelLike, wrap
from storylens.table.scores import score_heads


def name_ablation_table(
    model: ModelLike,
    stories: Sequence[str],
    *,
    name_heads: Sequence[Head | str] | None = None,
    k: int = 3,
    heads: Iterable[Head | str] | None = None,
    only_main_character: bool = True,
    modes: Sequence[str] = MODES,
    means: torch.Tensor | Mapping | None = None,
    batch_size: int = 16,
    progress: bool = False,
    encoded=None,
) -> AblationTable:
    """:func:`ablation_loss_table` over story texts (e.g. the 200 quiz stories).

    The main character and its mentions come from :mod:`storylens.data.names`
    (name vocabulary of ``stories`` themselves, as the lesson defines it). ``heads``:
    the single heads to run (default all). With
    ``only_main_character`` (default) only stories whose window holds a mention of
    a main character are run (name and other positions then come from the same
    stories). The group row switches off ``name_heads`` together; by default the top
    ``k`` heads by name mass (:func:`storylens.table.scores.score_heads` on the
    same stories, an extra pass that records attention). Head means for ``"mean"``
    default to :func:`head_output_means` over all of ``stories`` (those without a main
    character included).
    """

    stories = checked_stories(stories)
    lm = wrap(model)
    stories = list(stories)
    if encoded is None:  # ``encoded``: the same stories already encoded (a report encodes them once)
        encoded = encode_stories(lm, stories, name_vocabulary(stories))
    all_ids = [e.ids for e in encoded]
    kept = [e for e in encoded if e.mention_starts or not only_main_character]
    ids, starts = [e.ids for e in kept], [e.mention_starts for e in kept]
    if not ids:
        raise StorylensError("stories: none has a main character mentioned inside the window")
    if name_heads is None and k > 0:
        scores = score_heads(
            lm,
            stories,
            batch_size=batch_size,
            faithful=False,  # only the name heads are wanted here
            progress=progress,
            measures=(Counter(ProgressLines("scoring", len(stories), enabled=progress).update),),
        )
        name_heads = [h.label for h in scores.top("name_mass", k)]
    groups = [list(name_heads)] if name_heads else []
    if "mean" in modes and means is None:
        means = head_output_means(lm, all_ids, batch_size=batch_size)
    return ablation_loss_table(
        lm, ids, starts, heads=heads, groups=groups, modes=modes, means=means, batch_size=batch_size, progress=progress
    )
