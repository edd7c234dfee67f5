"""The report's why cards (``storylens report --why N``): the strongest name, previous-token and induction heads
each explained by their query-key terms (:mod:`storylens.looking.why`) over the first ``N`` quiz stories, a page
each (``why/<positions>/why.html``, its writer heads linked to their pages in the report's explore.html) and a
card on report.html with the largest terms as sentences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from storylens.core.errors import StorylensError
from storylens.core.plain import Plain
from storylens.engine.encode import EncodedStory
from storylens.lm import AttentionLM
from storylens.looking.why import explain, write_why
from storylens.table.scores import HeadScores
from storylens.viz.why import sentence

# (the head table's column whose strongest head is explained, the pairs it is explained on)
CARDS = (("name_mass", "name"), ("prev_token", "prev"), ("induction", "induction"))
SENTENCES = 3  # the largest terms a card states


@dataclass
class WhyCard(Plain):
    """One head explained: the column it is strongest on, its label, the pairs, the logit contrast with its error
    over ``stories`` stories, the largest terms as sentences and the page's address in the report folder; or, where
    the stories hold none of its pairs, ``note`` saying so (and no figures)."""

    column: str
    head: str
    positions: str
    total: float | None = None
    total_se: float | None = None
    stories: int = 0
    pairs: int = 0
    sentences: list[str] = field(default_factory=list)
    page: str | None = None
    note: str | None = None


def why_cards(
    lm: AttentionLM, scores: HeadScores, encoded: Sequence[EncodedStory], folder: Path, *, progress: bool = False
) -> list[WhyCard]:
    """The cards for the columns of :data:`CARDS` this run has, their pages written under ``folder / "why"``."""
    cards = []
    for column, positions in CARDS:
        if column not in {c.name for c in scores.columns} or not scores.top(column, 1):
            continue
        head = scores.top(column, 1)[0].at
        with tqdm(
            total=len(encoded), unit="story", desc=f"why {head.label}", disable=None if progress else True
        ) as bar:
            try:
                result = explain(lm, head, list(encoded), positions, progress=lambda s: bar.update(1))
            except StorylensError as e:  # none of its pairs in these stories (a few short ones): said, not fatal
                cards.append(WhyCard(column, head.label, positions, note=str(e).removeprefix("why: ")))
                continue
        page = folder / "why" / positions
        page.mkdir(parents=True, exist_ok=True)
        doc = write_why(result, lm.name, page, explorer="../../explore.html")
        cards.append(
            WhyCard(
                column=column,
                head=head.label,
                positions=positions,
                total=doc["total"],
                total_se=doc["total_se"],
                stories=doc["stories"],
                pairs=doc["pairs"],
                sentences=[sentence(doc, t) for t in doc["top"][:SENTENCES]],
                page=f"why/{positions}/why.html",
            )
        )
    return cards
