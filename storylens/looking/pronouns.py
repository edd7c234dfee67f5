"""Attention from pronouns to the main character's name.

The lesson saw L5H3 light up on "He" as well as on the name. Here, per head: how much
attention do pronoun tokens put on the main character's earlier name tokens, next to
the other queries of the lesson's name mass?

Definitions (positions count the end-of-story marker as 0; token ``i`` of the story is
position ``i + 1``):

* **Pronoun words**: ``he``, ``she``, ``him``, ``her``, ``his``, ``they``, case-insensitive,
  whole words. Words are maximal runs of letters, as in :mod:`storylens.data.names`,
  so ``He's`` holds the word ``He`` and ``here``, ``they're``'s ``re`` or ``Sheila`` hold none.
* **Pronoun query**: for each pronoun word, the *last* token whose character span
  (tokenizer offsets) overlaps the word: the first position where the whole word has
  been read. Usually the word is one token (``ĠHe``); only positions inside the window.
* A pronoun query ``q`` counts when at least one name token lies before it
  (``k < q``). Its **name mass**: the attention ``q`` puts on all name tokens ``k < q``.
* **Other queries**: the lesson's name-mass queries that are not pronoun queries:
  ``first_mention < q < T``, ``q`` neither a name token nor a pronoun query.
* Per story, per head: mean over its counted pronoun queries, and mean over its other
  queries. A story counts when it has both; across stories, the mean of the per-story
  means (every story once). ``even spread``: the same means of ``n_q / (q + 1)``
  (``n_q`` name tokens before ``q``), what attention spread evenly would give.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from storylens.core.heads import head_label
from storylens.engine.encode import StoryBatch
from storylens.engine.record import Chunk, Needs, record
from storylens.lm import ModelLike, wrap
from storylens.looking.position import _as_blocks


@dataclass(frozen=True)
class StoryPronouns:
    """One story's per-head means, ``[block, head]``, and what they were taken over."""

    pronoun_mass: torch.Tensor
    other_mass: torch.Tensor
    pronoun_even: float
    other_even: float
    n_pronoun_queries: int
    n_other_queries: int


def story_pronoun_mass(
    pattern: torch.Tensor,
    name_positions: Iterable[int],
    pronoun_positions: Iterable[int],
    first_mention: int | None = None,
    *,
    length: int | None = None,
) -> StoryPronouns | None:
    """One story: mean name mass of its pronoun queries and of its other queries, per head.

    None when the story has no counted pronoun query or no other query.
    """
    a = _as_blocks(pattern)
    T = a.shape[-1] if length is None else int(length)
    a = a[..., :T, :T]
    names = sorted({int(p) for p in name_positions if 0 <= int(p) < T})
    if not names:
        return None
    first = names[0] if first_mention is None else int(first_mention)
    name_set = set(names)
    pron = sorted(
        {
            int(q)
            for q in pronoun_positions
            if 0 <= int(q) < T and int(q) not in name_set and any(k < int(q) for k in names)
        }
    )
    pron_set = set(pron)
    other = [q for q in range(first + 1, T) if q not in name_set and q not in pron_set]
    if not pron or not other:
        return None
    is_name = torch.zeros(T, dtype=torch.float64)
    is_name[names] = 1.0
    keys = torch.tril(torch.ones(T, T, dtype=torch.float64), -1) * is_name[None, :]  # [q, k]: name, k < q
    mass = (a * keys).sum(-1)  # [block, head, q]
    n_before = keys.sum(-1)
    even = n_before / torch.arange(1, T + 1, dtype=torch.float64)
    return StoryPronouns(
        pronoun_mass=mass[..., pron].mean(-1),
        other_mass=mass[..., other].mean(-1),
        pronoun_even=float(even[pron].mean()),
        other_even=float(even[other].mean()),
        n_pronoun_queries=len(pron),
        n_other_queries=len(other),
    )


@dataclass(frozen=True)
class PronounAttention:
    """Per head, ``[block, head]`` float64, means over the stories counted."""

    pronoun_mass: torch.Tensor
    other_mass: torch.Tensor
    pronoun_even: float
    other_even: float
    n_stories: int
    n_pronoun_queries: int

    @property
    def ratio(self) -> torch.Tensor:
        """Pronoun queries' name mass over other queries' name mass."""
        return self.pronoun_mass / self.other_mass

    def to_rows(self) -> list[dict]:
        L, H = self.pronoun_mass.shape
        return [
            {
                "label": head_label(b, h),
                "pronoun_mass": float(self.pronoun_mass[b, h]),
                "other_mass": float(self.other_mass[b, h]),
                "ratio": float(self.ratio[b, h]),
                "pronoun_even": self.pronoun_even,
                "other_even": self.other_even,
            }
            for b in range(L)
            for h in range(H)
        ]

    def format(self, sort_by: str = "pronoun_mass") -> str:
        rows = sorted(self.to_rows(), key=lambda r: -r[sort_by])
        lines = [
            f"{self.n_stories} stories, {self.n_pronoun_queries} pronoun queries; even spread: "
            f"pronouns {self.pronoun_even:.4f}, other {self.other_even:.4f}",
            f"{'head':<6} {'pronoun':>8} {'other':>8} {'ratio':>7}",
        ]
        for r in rows:
            lines.append(f"{r['label']:<6} {r['pronoun_mass']:>8.4f} {r['other_mass']:>8.4f} {r['ratio']:>7.2f}")
        return "\n".join(lines)


class PronounAccumulator:
    """Sums of per-story means (float64) and a story count; add stories or batches."""

    def __init__(self, n_layer: int, n_head: int):
        self.pronoun_total = torch.zeros(n_layer, n_head, dtype=torch.float64)
        self.other_total = torch.zeros(n_layer, n_head, dtype=torch.float64)
        self.pronoun_even = 0.0
        self.other_even = 0.0
        self.n_stories = 0
        self.n_pronoun_queries = 0

    def add(
        self,
        pattern: torch.Tensor,
        name_positions: Iterable[int],
        pronoun_positions: Iterable[int],
        first_mention: int | None = None,
        *,
        length: int | None = None,
    ) -> bool:
        """Add one story; False (nothing added) when it does not count."""
        s = story_pronoun_mass(pattern, name_positions, pronoun_positions, first_mention, length=length)
        if s is None:
            return False
        if s.pronoun_mass.shape != self.pronoun_total.shape:
            raise ValueError(
                f"attention has {tuple(s.pronoun_mass.shape)} blocks x heads, "
                f"the accumulator {tuple(self.pronoun_total.shape)}"
            )
        self.pronoun_total += s.pronoun_mass
        self.other_total += s.other_mass
        self.pronoun_even += s.pronoun_even
        self.other_even += s.other_even
        self.n_stories += 1
        self.n_pronoun_queries += s.n_pronoun_queries
        return True

    def add_batch(
        self,
        patterns: Sequence[torch.Tensor],
        lengths: Sequence[int],
        name_positions: Sequence[Iterable[int] | None],
        pronoun_positions: Sequence[Iterable[int]],
        first_mentions: Sequence[int | None] | None = None,
    ) -> int:
        """Add a batch: one ``[batch, head, T, T]`` per block. Returns how many stories counted."""
        stacked = torch.stack([a.detach() for a in patterns], dim=1)
        n = 0
        for i, L in enumerate(lengths):
            names = name_positions[i]
            if not names:
                continue
            first = None if first_mentions is None else first_mentions[i]
            n += self.add(stacked[i, :, :, :L, :L], names, pronoun_positions[i], first)
        return n

    # --- a measure for storylens.engine.record: fed whole maps, block by block, from the one recording
    needs = Needs(streams=False)  # a story's distances and spans read its whole map
    _batch: StoryBatch | None = None

    def begin(self, batch: StoryBatch) -> None:
        self._batch = batch

    def feed(self, chunk: Chunk) -> None:
        if self._batch is None:
            raise RuntimeError("feed() before begin(batch)")
        layer, pattern = chunk.layer, chunk.probs
        for i, story in enumerate(self._batch.stories):
            if not story.name_positions or story.main is None:
                continue
            T = len(story.ids)
            s = story_pronoun_mass(
                pattern[i, :, :T, :T], story.name_positions, story.pronouns, story.main.first_mention
            )
            if s is None:
                continue
            self.pronoun_total[layer] += s.pronoun_mass[0]
            self.other_total[layer] += s.other_mass[0]
            if layer == 0:  # what depends on no head is added once per story
                self.pronoun_even += s.pronoun_even
                self.other_even += s.other_even
                self.n_stories += 1
                self.n_pronoun_queries += s.n_pronoun_queries

    def end(self) -> None:
        self._batch = None

    def result(self) -> PronounAttention:
        n = self.n_stories
        if n == 0:
            raise ValueError("no story with both pronoun and other queries has been added")
        return PronounAttention(
            pronoun_mass=self.pronoun_total / n,
            other_mass=self.other_total / n,
            pronoun_even=self.pronoun_even / n,
            other_even=self.other_even / n,
            n_stories=n,
            n_pronoun_queries=self.n_pronoun_queries,
        )


def pronoun_attention(model: ModelLike, stories: Sequence[str], *, batch_size: int = 16) -> PronounAttention:
    """Pronoun-to-name attention of every head over story texts (one recording pass; to share it,
    pass a :class:`PronounAccumulator` to :func:`storylens.engine.record.record`).

    Main characters come from :mod:`storylens.data.names` (name vocabulary of
    ``stories`` themselves).
    """

    lm = wrap(model)
    acc = PronounAccumulator(lm.n_layer, lm.n_head)
    record(lm, stories, [acc], batch_size=batch_size, progress=False)
    return acc.result()
