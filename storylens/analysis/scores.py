"""Score all 24 heads over many stories, streaming: one batch of attention maps at a time.

Every score is a **mean over stories of a per-story mean over that story's queries**:
each story counts once however long it is. Per-story means are summed and counted
batch by batch (:class:`~storylens.analysis.accumulate.MeanAccumulator`). Each block's
map is scored the moment the model makes it (through ``attn.hook_pattern``) and freed
with its block; stories are encoded once, :data:`CHUNK_STORIES` at a time, so memory
does not grow with the number of stories (only the texts the caller passes, and the name
vocabulary of a first pass over them, span the run).

Positions count the end-of-story marker the model sees first as position 0 (see
:func:`storylens.tokenizer.encode_story`); a query at position q sees keys 0..q.
Stories are cut to the model's window first.

Scores, per head (the definitions the lesson leaves open are fixed here):

``name_mass``
    Queries: every position q after the main character's first mention (q > first)
    that is not itself one of the main character's name tokens (other names' tokens
    are ordinary positions), inside the story and the window. Value: the attention q
    puts on the name's token positions (only those at or before q can get any, by the
    causal mask). Name tokens are found by :mod:`storylens.analysis.names`. Stories
    without a main character, or whose window holds no such query, are skipped
    (counted in :attr:`HeadScores.n_main_character` / :attr:`HeadScores.n_name_scored`).
``name_baseline``
    What an even spread over the positions so far would give, over the same queries:
    (name tokens at positions <= q) / (q + 1), the ``q + 1`` counting the marker and q
    itself. It depends on no head, so it is one number. ``name_ratio`` = name_mass /
    name_baseline: a ratio of the two means, not a mean of per-story ratios.
``prev_token``
    Attention on position q - 1, over queries q >= 1 (query 0 has no previous token).
``prev_argmax``
    Share of queries q >= 1 whose most-attended key is q - 1. ``torch.argmax`` breaks
    ties towards the earliest key, so a tie with an earlier key does not count.
``prev4``
    Attention on positions q-1 .. q-4 together, over queries q >= 1; for q < 4 only
    the positions that exist (down to the marker at 0) are summed.
``marker``
    Attention on end-of-story marker tokens (every position holding the marker id; in
    a story fed alone that is position 0), over queries q >= 1: query 0 *is* the marker
    and can only attend to itself, so it would add a constant 1.
``prev_token_first``, ``prev_argmax_first``, ``prev4_first``
    The same three previous-token scores over only the first ``max_stories_prev``
    stories in the order given (the lesson quotes some figures on the first 100 quiz
    stories); ``None`` when no limit was asked for.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

import torch
from torch.nn import functional as F

from ..errors import StorylensError
from ..model import head_label
from ..tokenizer import eot_id
from .accumulate import MeanAccumulator
from .names import MainCharacter, name_vocabulary

PREV_SPAN = 4  # prev4: the last four positions

SCORE_COLUMNS = (
    "name_mass", "name_baseline", "name_ratio",
    "prev_token", "prev_argmax", "prev4",
    "prev_token_first", "prev_argmax_first", "prev4_first",
    "marker",
)
_COUNT_FIELDS = ("n_stories", "n_cut", "n_main_character", "n_name_scored", "max_stories_prev",
                 "n_prev_first", "window")


# ---------------------------------------------------------------- one batch


@dataclass(frozen=True)
class StoryBatch:
    """A batch of encoded stories, padded at the end, with what the scores need."""

    ids: torch.Tensor  # [batch, tokens] long; padding after each story's end
    lengths: torch.Tensor  # [batch] long: real tokens per story (marker included)
    name_mask: torch.Tensor  # [batch, tokens] bool: the main character's name tokens
    first_mention: torch.Tensor  # [batch] long: first name position; -1 = none in the window
    marker_mask: torch.Tensor  # [batch, tokens] bool: end-of-story marker tokens
    in_first: torch.Tensor  # [batch] bool: story is among the first max_stories_prev


def make_batch(
    ids: Sequence[Sequence[int]],
    mains: Sequence[MainCharacter | None],
    in_first: Sequence[bool],
    marker_id: int,
    device: torch.device | str = "cpu",
) -> StoryBatch:
    """Pad ``ids`` at the end (with the marker id) and build the position masks."""
    B, T = len(ids), max(len(x) for x in ids)
    grid = torch.full((B, T), marker_id, dtype=torch.long)
    name_mask = torch.zeros(B, T, dtype=torch.bool)
    first = torch.full((B,), -1, dtype=torch.long)
    for b, (x, mc) in enumerate(zip(ids, mains)):
        grid[b, : len(x)] = torch.as_tensor(list(x), dtype=torch.long)
        if mc is not None and mc.positions:
            name_mask[b, list(mc.positions)] = True
            first[b] = mc.first_mention
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.long)
    valid = torch.arange(T)[None, :] < lengths[:, None]
    return StoryBatch(
        ids=grid.to(device),
        lengths=lengths.to(device),
        name_mask=name_mask.to(device),
        first_mention=first.to(device),
        marker_mask=((grid == marker_id) & valid).to(device),
        in_first=torch.tensor(list(in_first), dtype=torch.bool, device=device),
    )


@dataclass(frozen=True)
class StoryScores:
    """Per-story means for one batch: ``[batch, block, head]`` unless noted."""

    name_mass: torch.Tensor
    name_baseline: torch.Tensor  # [batch]
    has_name_queries: torch.Tensor  # [batch] bool: the story counts for the name scores
    prev_token: torch.Tensor
    prev_argmax: torch.Tensor
    prev4: torch.Tensor
    marker: torch.Tensor
    has_queries: torch.Tensor  # [batch] bool: at least one query q >= 1


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x [batch, head, query]`` over the queries in ``mask [batch, query]``."""
    m = mask.to(x.dtype)[:, None, :]
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1)


def _diagonal(att: torch.Tensor, k: int) -> torch.Tensor:
    """``out[..., q] = att[..., q, q - k]`` (0 for q < k)."""
    T = att.shape[-2]
    return F.pad(att.diagonal(offset=-k, dim1=-2, dim2=-1), (k, 0))[..., :T]


def query_masks(batch: StoryBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries q >= 1 inside the story, name-score queries), both ``[batch, tokens]``."""
    T = batch.ids.shape[1]
    pos = torch.arange(T, device=batch.ids.device)[None, :]
    inside = pos < batch.lengths[:, None]
    queries = inside & (pos >= 1)
    first = batch.first_mention[:, None]
    name_queries = inside & (first >= 0) & (pos > first) & ~batch.name_mask
    return queries, name_queries


def name_baseline(batch: StoryBatch, name_queries: torch.Tensor) -> torch.Tensor:
    """Per story: mean over the name queries of (name tokens at <= q) / (q + 1).

    Computed on the CPU in float64 (it needs no attention map): exact to rounding.
    """
    names = batch.name_mask.cpu().to(torch.float64)
    pos = torch.arange(names.shape[1], dtype=torch.float64)
    even = names.cumsum(-1) / (pos + 1)
    return _masked_mean(even[:, None, :], name_queries.cpu())[:, 0]


def prev_is_argmax(att: torch.Tensor) -> torch.Tensor:
    """``[..., query]`` float: 1 where key ``q - 1`` is the query's most-attended key, ties going
    to the earliest key (exactly ``att.argmax(-1) == q - 1``; 0 for query 0).

    Computed with one ``amax`` instead of ``argmax`` (which tracks indices and is four times slower
    here): key q - 1 wins when its weight is at least query q's own (a later key, which it beats
    on a tie) and above every key before it. Keys after q hold exactly 0 and never win (every
    weight the softmax gives is above 0). To take the maximum over keys 0 .. q-2 without a copy
    of the map, the two newest diagonals are set to 0 for the ``amax`` and written back after:
    ``att`` leaves this function bit for bit as it came in.
    """
    T = att.shape[-1]
    prev = att.diagonal(offset=-1, dim1=-2, dim2=-1)  # views: [..., T - 1]
    own = att.diagonal(dim1=-2, dim2=-1)
    saved_prev, saved_own = prev.clone(), own.clone()
    prev.zero_()
    own.zero_()
    try:
        earlier = att.amax(-1)  # [..., query]: the largest weight on keys 0 .. q-2
    finally:
        prev.copy_(saved_prev)
        own.copy_(saved_own)
    wins = (saved_prev >= saved_own[..., 1:]) & (saved_prev > earlier[..., 1:])
    return F.pad(wins.to(att.dtype), (1, 0))[..., :T]


class BatchMasks:
    """What every block's scores need from one batch, made once per batch."""

    def __init__(self, batch: StoryBatch, dtype: torch.dtype):
        self.batch = batch
        self.queries, self.name_queries = query_masks(batch)
        self.keys = torch.stack([batch.name_mask, batch.marker_mask], -1)[:, None].to(dtype)  # [B, 1, T, 2]


def block_scores(att: torch.Tensor, masks: BatchMasks) -> dict[str, torch.Tensor]:
    """Per-story, per-head means ``[batch, head]`` of one block's map ``[batch, head, q, k]``."""
    on = att @ masks.keys  # [B, H, q, 2]: attention on name tokens, on markers
    queries = masks.queries
    prev = _diagonal(att, 1)
    last = sum((_diagonal(att, k) for k in range(2, PREV_SPAN + 1)), prev)
    return {
        "name": _masked_mean(on[..., 0], masks.name_queries),
        "marker": _masked_mean(on[..., 1], queries),
        "prev": _masked_mean(prev, queries),
        "argmax": _masked_mean(prev_is_argmax(att), queries),
        "prev4": _masked_mean(last, queries),
    }


def _stack_scores(per_block: list[dict[str, torch.Tensor]], masks: BatchMasks) -> StoryScores:
    stacked = {k: torch.stack([b[k] for b in per_block], dim=1) for k in per_block[0]}  # [B, L, H]
    return StoryScores(
        name_mass=stacked["name"],
        name_baseline=name_baseline(masks.batch, masks.name_queries),
        has_name_queries=masks.name_queries.any(-1),
        prev_token=stacked["prev"],
        prev_argmax=stacked["argmax"],
        prev4=stacked["prev4"],
        marker=stacked["marker"],
        has_queries=masks.queries.any(-1),
    )


def story_scores(attentions: Sequence[torch.Tensor], batch: StoryBatch) -> StoryScores:
    """Per-story, per-head means from one batch's maps (one ``[batch, head, q, k]`` per block)."""
    masks = BatchMasks(batch, attentions[0].dtype)
    return _stack_scores([block_scores(att, masks) for att in attentions], masks)


# ---------------------------------------------------------------- many batches


class HeadScoreAccumulator:
    """Sums and counts of per-story means, fed batch by batch (see :func:`story_scores`).

    Either all of a batch's maps at once (:meth:`update`), or block by block as the model makes
    them (:meth:`begin`, then :meth:`update_block` for every block, then :meth:`end`): then no
    map outlives its block."""

    def __init__(self, n_layer: int, n_head: int):
        shape = (n_layer, n_head)
        self.n_layer, self.n_head = n_layer, n_head
        self.name_mass = MeanAccumulator(shape)
        self.name_baseline = MeanAccumulator(())
        self.marker = MeanAccumulator(shape)
        self.prev = {k: MeanAccumulator(shape) for k in ("prev_token", "prev_argmax", "prev4")}
        self.prev_first = {k: MeanAccumulator(shape) for k in self.prev}
        self._masks: BatchMasks | None = None
        self._blocks: list[dict[str, torch.Tensor] | None] = []

    def begin(self, batch: StoryBatch, dtype: torch.dtype = torch.float32) -> None:
        self._masks = BatchMasks(batch, dtype)
        self._blocks = [None] * self.n_layer

    def update_block(self, layer: int, att: torch.Tensor) -> None:
        if self._masks is None:
            raise RuntimeError("update_block() before begin(batch)")
        self._blocks[layer] = block_scores(att, self._masks)

    def end(self) -> StoryScores:
        missing = [i for i, b in enumerate(self._blocks) if b is None]
        if self._masks is None or missing:
            raise RuntimeError(f"end(): no map for blocks {missing}")
        s = _stack_scores(self._blocks, self._masks)
        batch = self._masks.batch
        self._masks, self._blocks = None, []
        self.name_mass.add(s.name_mass, s.has_name_queries)
        self.name_baseline.add(s.name_baseline, s.has_name_queries)
        self.marker.add(s.marker, s.has_queries)
        first = s.has_queries & batch.in_first
        for k in self.prev:
            self.prev[k].add(getattr(s, k), s.has_queries)
            self.prev_first[k].add(getattr(s, k), first)
        return s

    def update(self, attentions: Sequence[torch.Tensor], batch: StoryBatch) -> StoryScores:
        self.begin(batch, attentions[0].dtype)
        for layer, att in enumerate(attentions):
            self.update_block(layer, att)
        return self.end()

    def columns(self, with_first: bool) -> dict[str, torch.Tensor | None]:
        """Every score as a ``[block, head]`` float64 tensor (None: not computed)."""
        mass = self.name_mass.mean()
        base = self.name_baseline.mean()
        cols: dict[str, torch.Tensor | None] = {
            "name_mass": mass,
            "name_baseline": base.expand_as(mass),
            "name_ratio": mass / base,
            **{k: a.mean() for k, a in self.prev.items()},
            **{f"{k}_first": (a.mean() if with_first else None) for k, a in self.prev_first.items()},
            "marker": self.marker.mean(),
        }
        return {k: cols[k] for k in SCORE_COLUMNS}


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class HeadScore:
    """One head's row. ``block`` and ``head`` count from 1, like ``label``."""

    label: str
    block: int
    head: int
    name_mass: float
    name_baseline: float
    name_ratio: float
    prev_token: float
    prev_argmax: float
    prev4: float
    prev_token_first: float | None
    prev_argmax_first: float | None
    prev4_first: float | None
    marker: float


def _clean(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


@dataclass(frozen=True)
class HeadScores:
    """Scores of every head (one :class:`HeadScore` per head, block-major) plus counts."""

    heads: tuple[HeadScore, ...]
    n_stories: int  # stories scored
    n_cut: int  # stories cut to the window
    n_main_character: int  # stories with a main character
    n_name_scored: int  # ... of which the window holds at least one name query
    max_stories_prev: int | None  # the limit asked for the *_first columns
    n_prev_first: int | None  # stories behind the *_first columns
    window: int

    @property
    def name_baseline(self) -> float:
        return self.heads[0].name_baseline

    @property
    def n_skipped_no_name(self) -> int:
        """Stories left out of the name scores (no main character, or none in the window)."""
        return self.n_stories - self.n_name_scored

    def counts(self) -> dict:
        """The story counts (and the baseline), as a plain dict."""
        return {**{k: getattr(self, k) for k in _COUNT_FIELDS}, "name_baseline": _clean(self.name_baseline)}

    def to_rows(self) -> list[dict]:
        """One dict per head: label, block, head (1-based), then every score column."""
        return [{k: _clean(v) if isinstance(v, float) else v for k, v in asdict(h).items()} for h in self.heads]

    def column(self, name: str) -> list[float | None]:
        if name not in SCORE_COLUMNS:
            raise KeyError(f"{name!r} is not a score column (one of {', '.join(SCORE_COLUMNS)})")
        return [getattr(h, name) for h in self.heads]

    def grid(self, name: str) -> list[list[float | None]]:
        """``grid[block][head]`` (0-indexed) of one column, for heatmaps."""
        n_head = max(h.head for h in self.heads)
        col = self.column(name)
        return [col[i : i + n_head] for i in range(0, len(col), n_head)]

    def head(self, label: str) -> HeadScore:
        for h in self.heads:
            if h.label == label.strip().upper():
                return h
        raise KeyError(f"{label!r}: no such head (L1H1 .. {self.heads[-1].label})")

    def top(self, name: str = "name_mass", k: int = 6, *, largest: bool = True) -> list[HeadScore]:
        """The ``k`` heads with the largest (or smallest) ``name``; ties keep block-major order."""
        col = self.column(name)
        if any(v is None for v in col):
            raise ValueError(f"{name}: not computed (pass max_stories_prev to score_heads)")
        order = sorted(range(len(col)), key=lambda i: -col[i] if largest else col[i])
        return [self.heads[i] for i in order[:k]]

    def best(self, name: str = "name_mass", *, largest: bool = True) -> HeadScore:
        return self.top(name, 1, largest=largest)[0]

    def count(self, name: str, *, above: float | None = None, below: float | None = None) -> int:
        """How many heads have ``name`` > ``above`` and/or < ``below``."""
        return sum(
            1
            for v in self.column(name)
            if v is not None and (above is None or v > above) and (below is None or v < below)
        )

    def to_csv(self, path: str | os.PathLike) -> Path:
        rows = self.to_rows()
        path = Path(path)
        try:
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        except OSError as e:
            raise StorylensError(f"{path}: cannot write ({e.strerror})") from None
        return path

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        doc = {"counts": self.counts(), "heads": self.to_rows()}
        try:
            path.write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise StorylensError(f"{path}: cannot write ({e.strerror})") from None
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "HeadScores":
        """Read back what :meth:`to_json` wrote (NaN scores come back as None)."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
            keys = [f.name for f in fields(HeadScore)]
            heads = tuple(HeadScore(**{k: row[k] for k in keys}) for row in doc["heads"])
            c = doc["counts"]
            return cls(heads=heads, **{k: c[k] for k in _COUNT_FIELDS})
        except OSError as e:
            raise StorylensError(f"{path}: cannot read ({e.strerror})") from None
        except (ValueError, KeyError, TypeError) as e:
            raise StorylensError(f"{path}: not a head-scores JSON file ({type(e).__name__}: {e})") from None


def build_table(acc: HeadScoreAccumulator, with_first: bool) -> tuple[HeadScore, ...]:
    cols = acc.columns(with_first)
    rows = []
    for b in range(acc.n_layer):
        for h in range(acc.n_head):
            vals = {k: (None if v is None else float(v[b, h])) for k, v in cols.items()}
            rows.append(HeadScore(label=head_label(b, h), block=b + 1, head=h + 1, **vals))
    return tuple(rows)


# ---------------------------------------------------------------- the model run


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Story indices, longest first (stable), in chunks of ``batch_size``: little padding."""
    if batch_size < 1:
        raise StorylensError(f"batch_size: must be at least 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


CHUNK_STORIES = 512  # stories encoded (and sorted by length into batches) at a time


def encode_chunk(tok, texts: Sequence[str], names, window: int):
    """Each story encoded once: its ids (``[marker] + story``, cut to the window), whether it was
    cut, and its main character (from the same encoding's character offsets)."""
    from .names import main_character

    marker = eot_id(tok)
    out = []
    for text, enc in zip(texts, tok.encode_batch(list(texts))):
        ids = [marker] + enc.ids
        out.append((ids[:window], len(ids) > window, main_character(text, enc.offsets, names, window)))
    return out


def attention_feed(model, acc: HeadScoreAccumulator):
    """Hook every block's ``attn.hook_pattern`` so that each map goes into ``acc`` the moment it
    exists (and is freed with its block). Returns the hook handles (``.remove()`` each)."""
    handles = []
    for layer, attn in enumerate(model.attentions):
        def feed(module, inputs, output, layer=layer):
            acc.update_block(layer, output)
        handles.append(attn.hook_pattern.register_forward_hook(feed))
    return handles


def score_heads(
    model,
    stories: Sequence[str],
    *,
    batch_size: int = 16,
    max_stories_prev: int | None = None,
    names: frozenset[str] | set[str] | None = None,
    progress: bool = True,
    chunk_stories: int = CHUNK_STORIES,
) -> HeadScores:
    """Score every head of ``model`` over ``stories`` (e.g. the 200 quiz stories).

    ``names`` defaults to the name vocabulary of ``stories`` themselves (the whole set
    scored, as the lesson defines it): a first pass over the texts. ``max_stories_prev`` adds
    the ``*_first`` previous-token columns over the first that many stories, in the same single
    pass. Then stories are encoded ``chunk_stories`` at a time, each chunk's stories go through
    the model longest first, ``batch_size`` at a time, padded at the end (causal attention:
    padding never changes an earlier position), and each block's map is scored as soon as it
    exists (see :func:`attention_feed`): memory does not grow with the number of stories.
    """
    from tqdm.auto import tqdm

    if not isinstance(stories, Sequence) or isinstance(stories, str):
        stories = list(stories)
    if len(stories) == 0:
        raise StorylensError("stories: nothing to score (empty list)")
    if batch_size < 1:
        raise StorylensError(f"batch_size: must be at least 1, got {batch_size}")
    if max_stories_prev is not None and max_stories_prev < 1:
        raise StorylensError(f"max_stories_prev: must be at least 1, got {max_stories_prev}")
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise StorylensError("model: has no tokenizer (load it with storylens.hub.load_model)")
    window = model.config.block_size
    if names is None:
        names = name_vocabulary(stories)
    limit = len(stories) if max_stories_prev is None else max_stories_prev
    marker = eot_id(tok)
    param = next(model.parameters())
    n_cut = n_main = 0

    acc = HeadScoreAccumulator(model.config.n_layer, model.config.n_head)
    was_training = model.training
    model.eval()
    handles = attention_feed(model, acc)
    try:
        with torch.inference_mode(), tqdm(total=len(stories), unit="story", desc="scoring heads",
                                          disable=None if progress else True) as bar:  # None: terminals only
            for start in range(0, len(stories), chunk_stories):
                chunk = encode_chunk(tok, stories[start : start + chunk_stories], names, window)
                n_cut += sum(cut for _, cut, _ in chunk)
                n_main += sum(main is not None for _, _, main in chunk)
                for idx in length_batches([len(ids) for ids, _, _ in chunk], batch_size):
                    batch = make_batch([chunk[i][0] for i in idx], [chunk[i][2] for i in idx],
                                       [start + i < limit for i in idx], marker, param.device)
                    acc.begin(batch, param.dtype)
                    model(batch.ids, record_attention=True, keep_attention=False, compute_logits=False)
                    acc.end()
                    bar.update(len(idx))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    with_first = max_stories_prev is not None
    return HeadScores(
        heads=build_table(acc, with_first),
        n_stories=len(stories),
        n_cut=n_cut,
        n_main_character=n_main,
        n_name_scored=acc.name_mass.count,
        max_stories_prev=max_stories_prev,
        n_prev_first=acc.prev_first["prev_token"].count if with_first else None,
        window=window,
    )
