"""Where a head fires: for every head and every detector, the ``k`` queries with the highest
per-query value over every story recorded, kept as the recording streams (memory stays flat:
only ``k`` entries per head and detector ever exist).

:class:`TopExamples` is fed, block by block, the per-query values a detector already computed
(``values [batch, head, query]``, the counted queries ``[batch, query]``) together with the
block's attention map, so no detector is computed twice. For every kept query it records the
story (its index in source order), the query position (0 = the opening marker), the value, the
most-attended key (``argmax`` over keys, ties to the earliest key) and its weight, and the
token ids around the query and around that key, and the query's attention weights over both
windows up to itself (4 decimals: what a page shades the tokens by), so a view always holds the
most-attended key with its weight, however far before the query it lies. Ids only: text is decoded
when the examples are written (:meth:`TopExamples.to_json`).

**Order.** Value descending, then story index ascending, then query position ascending; a
``(story, query)`` pair appears at most once. It is a total order, so the top ``k`` of a set
does not depend on how the set was split: one process, a run resumed from a checkpointed
:meth:`~TopExamples.state`, and any number of workers :meth:`~TopExamples.merge`-d in any order
give identical lists, ties included (a 0/1 detector gives thousands of queries with value 1;
the earliest stories and positions win, never whatever ``torch.topk`` happens to return).

**Spread.** ``per_story`` (default None: no limit) keeps at most that many queries of any one story
per head and detector: the top ``k`` of the queries left after each story's best ``per_story``
(same order). It is mergeable too: a query in the capped top ``k`` of a union is in the capped top
``k`` of its own part, since the part's better queries are fewer story by story.
``storylens score`` and ``report`` keep :data:`~storylens.looking.example_store.PER_STORY` per story, so a head's examples come from
at least ``k / PER_STORY`` stories wherever it fires in that many.

**Lazily made.** While blocks are fed, each block's kept queries are tensors ("slots": the value,
story, query, key, weights and token ids), and the top ``k`` of the kept and the newly offered is
chosen by tensor ops in the order above (ties, ``(story, query)`` once, ``per_story`` as
:func:`~storylens.looking.example_store.best_examples` decides); the :class:`Example` objects are made once, when read (:meth:`~TopExamples.entries`,
:meth:`~TopExamples.state`, :meth:`~TopExamples.merge`, :meth:`~TopExamples.as_json`, pickling), not
for every block of every batch. A block's newly taken queries wait (their rows of the map read when
it is fed) and enter its slots at :meth:`~TopExamples.flush`, once per batch for every block (the
scores' accumulator flushes at the end of each batch; every read flushes first). On a CPU a block
does not even select when it is fed: it keeps the queries that beat their row's worst kept example
(few, once the kept are good ones) with their rows of the map, and the flush selects among every
block's at once (the same rules, so the same examples); a block with more than
:data:`OFFERED_BYTES` of such rows (the first batches) selects when fed. A story's later chunks of rows
must also beat the worst of that story's ``per_story`` kept, where a row keeps that many of it
(:func:`~storylens.looking.example_select.story_worst_kept`): a long story's rows never fill a row's ``k``.

**Values** are kept as Python floats equal to the tensor's values (half precision is widened
exactly first); a value that is not a finite number (NaN, infinity) never qualifies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from storylens.core.errors import StorylensError
from storylens.engine.encode import StoryBatch
from storylens.looking.example_select import (
    KEY_WIDTH,
    NARROW,
    SPLIT,
    BatchView,
    Offered,
    Taken,
    alike_groups,
    beating,
    first_k,
    ranks_of,
    rounded_now,
    select_top,
    sorted_by,
    story_capped,
    taken_rows,
    window_weights,
    worst_kept,
)
from storylens.looking.example_store import (
    KEY_BEFORE,
    QUERY_AFTER,
    STATE_KEYS,
    WEIGHT_DECIMALS,
    Example,
    ExampleStore,
    key_seen,
    not_a_state,
)

ROWS_FIRST = True  # on a CPU, select only in the rows where some query can enter (TopExamples.add_stacked)
# on a CPU, a block whose queries that can enter have map rows of at most this many bytes in all keeps those
# rows and selects at the flush, with every other such block (TopExamples.add_stacked); more: selected at once
OFFERED_BYTES = 2 * 2**20


class TopExamples(ExampleStore):
    """For every head (layer, head) and every detector name, the k queries with the highest
    per-query value over everything added: story index (source order), query position, the value,
    the most-attended key position, token ids around the query and around that key, and the
    query's rounded attention over its window.

    Feed it with :meth:`add` (one call per block and detector), combine with :meth:`merge`,
    checkpoint with :meth:`state` / :meth:`load_state`, read with :meth:`entries`, write with
    :meth:`to_json`. See the module docstring for the order."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        detectors: Sequence[str],
        k: int = 8,
        context: int = 8,
        per_story: int | None = None,
    ):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise StorylensError(f"examples: k must be a whole number of at least 1, got {k!r}")
        if per_story is not None and (isinstance(per_story, bool) or not isinstance(per_story, int) or per_story < 1):
            raise StorylensError(f"examples: per_story must be a whole number of at least 1 or None, got {per_story!r}")
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise StorylensError(f"examples: context must be a whole number of at least 0, got {context!r}")
        if n_layer < 1 or n_head < 1:
            raise StorylensError(f"examples: need at least one head, got {n_layer} layers of {n_head} heads")
        names = [str(d) for d in detectors]
        if len(set(names)) != len(names):
            raise StorylensError(f"examples: detector names must differ ({', '.join(names)})")
        self.n_layer, self.n_head, self.k, self.context, self.per_story = n_layer, n_head, k, context, per_story
        self.detectors = tuple(names)
        self._kept: dict[str, list[list[list[Example]]]] = {name: self._empty() for name in self.detectors}
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per block fed: its examples as tensors
        self._stale: set[int] = set()  # the blocks whose _kept lists are behind their slots
        self._view: BatchView | None = None  # the current batch's story order
        self._pending: list[Taken] = []  # queries taken from blocks fed since the last flush(), not yet selected
        self._offered: list[Offered] = []  # queries that can enter, of blocks fed since then (_offer)

    def __getstate__(self) -> dict:  # pickled or copied: the examples, not tensors of the last batch
        self._settle()
        return {**self.__dict__, "_view": None, "_slots": {}, "_stale": set(), "_pending": [], "_offered": []}

    # ---------------------------------------------------------------- feeding

    def _batch_view(self, batch: StoryBatch, Q: int, device: torch.device, start: int = 0) -> BatchView:
        """What every call on ``batch`` (its query rows ``start .. start + Q - 1``) shares, made once
        per batch and chunk of rows (the last one is kept)."""
        last = self._view
        if last is not None and last.batch is batch and (last.Q, last.start) == (Q, start) and last.device == device:
            return last
        stories = getattr(batch, "stories", ())
        B = batch.ids.shape[0]
        if len(stories) != B:
            raise ValueError(
                f"examples: the batch names {len(stories)} stories for {B} rows; "
                "make it with storylens.engine.encode.batch_of (the story indices are needed)"
            )
        story_index = [int(s.index) for s in stories]
        lengths = [int(n) for n in batch.lengths.tolist()]
        order = sorted(range(B), key=lambda b: story_index[b])
        perm = None if order == list(range(B)) else torch.tensor(order, dtype=torch.long, device=device)
        s_sorted = torch.tensor([story_index[b] for b in order], dtype=torch.long, device=device)
        n_sorted = torch.tensor([lengths[b] for b in order], dtype=torch.long, device=device)
        pos = torch.arange(start, start + Q, device=device)
        inside = pos[None, :] < n_sorted[:, None]  # [B, Q]: never a padding query
        story_of = s_sorted[:, None].expand(B, Q).reshape(1, B * Q)
        query_of = pos[None, :].expand(B, Q).reshape(1, B * Q)
        index = torch.tensor(story_index, dtype=torch.long, device=device)
        order_of = index[:, None] * SPLIT + pos[None, :]
        flat_order = story_of * SPLIT + query_of
        self._view = BatchView(batch, Q, start, device, perm, inside, story_of, query_of, order_of, flat_order)
        return self._view

    def add(
        self,
        layer: int,
        name: str,
        values: torch.Tensor,
        counted: torch.Tensor,
        pattern: torch.Tensor,
        batch: StoryBatch,
    ) -> None:
        """Offer one block's per-query values of detector ``name``: ``values [B, H, Q]``, ``counted
        [B, Q]`` (only counted queries qualify), ``pattern [B, H, Q, K]`` (for the most-attended
        key), ``batch`` a :class:`~storylens.engine.encode.StoryBatch` with its ``stories``."""
        self.add_block(layer, [(name, values, counted)], pattern, batch)

    def add_block(
        self,
        layer: int,
        offers: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
        pattern: torch.Tensor,
        batch: StoryBatch,
        start: int = 0,
    ) -> None:
        """:meth:`add` for several detectors of one block at once, ``offers = [(name, values, counted),
        ...]``: one selection over every (detector, head) row, so a block costs a few tensor calls
        whatever the number of detectors, and no Python object per example (they are made when
        read). ``start``: the values, counts and pattern hold query rows ``start ..`` of the block (a
        chunk of a map), not all of them; chunks may come in any order."""
        if not offers:
            return
        B, H, Q = self._check_offers(layer, offers, pattern)
        if B == 0 or Q == 0:
            return
        values = torch.stack([values.detach() for _, values, _ in offers], 2)  # [B, H, D, Q]
        counted = torch.stack([c.detach().to(device=values.device, dtype=torch.bool) for _, _, c in offers], 1)
        self.add_stacked(layer, [name for name, _, _ in offers], values, counted, pattern, batch, start)

    def add_stacked(
        self,
        layer: int,
        names: Sequence[str],
        values: torch.Tensor,
        counted: torch.Tensor,
        pattern: torch.Tensor,
        batch: StoryBatch,
        start: int = 0,
    ) -> None:
        """:meth:`add_block` with the detectors' values stacked, ``values [B, H, D, Q]`` and ``counted
        [B, D, Q]`` bool (detector ``names[d]`` at ``d``; shapes as :meth:`add_block` checks them).

        Most rows (detector, head) of a block take nothing once the kept examples are good ones: a
        query enters only if its value reaches the row's worst kept. So on a CPU one pass over the values
        finds the queries that reach it: they and their rows of the map are kept for :meth:`flush` to
        select among, with every other block's (:meth:`_offer`), or, where their rows are many, the rows
        they are in are selected among now (elsewhere every row, with no sync): the same examples as
        selecting in every row."""
        B, H, D, Q = values.shape
        if B == 0 or Q == 0:
            return
        if any(t.layer == layer for t in self._pending) or any(o.layer == layer for o in self._offered):
            self.flush()  # a block's second chunk: its first selected before
        if not values.is_floating_point() or values.dtype in (torch.float16, torch.bfloat16):
            values = values.to(torch.float32)  # exact: every half value is a float32
        view = self._batch_view(batch, Q, values.device, start)
        dev = view.device
        floats, ints = self._block_slots(layer, dev)
        det = torch.tensor([self.detectors.index(name) for name in names], dtype=torch.long, device=dev)
        if (
            dev.type == "cpu" and ROWS_FIRST
        ):  # the rows where some counted query beats the worst kept one (as _eligible)
            offered = (det[:, None] * H + torch.arange(H, device=dev)).reshape(-1)  # [D * H] rows, detector-major
            # a story's later rows (start > 0) must also beat the worst of that story's kept
            per = self.per_story if start > 0 else None
            beats, worst, later = beating(values, counted, floats, ints, offered, view.order_of, per)
            if self._offer(layer, names, det, beats, values, pattern, view):
                return
            hit = beats.view(torch.uint8).amax(-1).amax(0) > 0  # [H, D]: any (a max of bytes: several times faster)
            if not bool(hit.any()):
                return
            heads, at = hit.nonzero(as_tuple=True)  # [r] each: the row's head and offered detector
            rows = det[at] * H + heads  # [r]: the rows selected among
            kept = worst[heads, at], later[heads, at]
        else:
            beats = None
            heads = torch.arange(H, device=dev).repeat(D)
            at = torch.arange(D, device=dev).repeat_interleave(H)
            rows = det[at] * H + heads
            kept = worst_kept(floats, ints, rows, values.dtype)
        v, eligible = self._eligible(values, counted if beats is None else beats, heads, at, *kept, view)
        # at most per_story of each of the B stories is already at most k: nothing more to cut
        capped = self.per_story is not None and self.per_story * B <= self.k
        take = eligible if capped else first_k(eligible, v, self.k)
        if dev.type == "cpu" and not bool(take.any()):  # nothing enters (skipped where it would sync)
            return
        self._pending.append(self._taken_rows(layer, rows, take, v, pattern, view, heads))

    def _offer(
        self,
        layer: int,
        names: Sequence[str],
        det: torch.Tensor,
        beats: torch.Tensor,
        values: torch.Tensor,
        pattern: torch.Tensor,
        view: BatchView,
    ) -> bool:
        """Keep the queries that can enter (``beats [B, H, D, Q]``: counted and beating their row's worst
        kept) with their rows of ``pattern``, for :meth:`flush` to select among with every other block's;
        False (nothing kept) where their rows would take more than :data:`OFFERED_BYTES`."""
        B, H, D, Q = beats.shape
        K = pattern.shape[-1]
        at = beats.reshape(-1).nonzero()[:, 0]  # [n]
        n = at.numel()
        if n == 0:
            return True
        if n * K * pattern.element_size() > OFFERED_BYTES:
            return False
        if pattern.is_contiguous():  # (one index_select of flat rows: several times faster than indexing)
            rowmaps = pattern.detach().view(B * H * Q, K).index_select(0, at // (D * Q) * Q + at % Q)
        else:
            rowmaps = pattern.detach()[at // (H * D * Q), at // (D * Q) % H, at % Q]
        value = values.reshape(-1)[at]
        self._offered.append(Offered(layer, tuple(names), det, view, at, value, rowmaps))
        return True

    def _take_offered(self, group: list[Offered]) -> list[Taken]:
        """The queries each block of ``group`` takes into its top ``k`` rows, of those it offered
        (:meth:`_offer`), selected for every block at once: as :meth:`_eligible`, :func:`story_capped`,
        :func:`first_k` and :func:`taken_rows` select among a block's values (the same queries)."""
        view, det = group[0].view, group[0].det
        B, Q = view.inside.shape
        H, D, rows_per_block = self.n_head, det.numel(), len(self.detectors) * self.n_head
        at = torch.cat([o.at for o in group])
        layer = torch.repeat_interleave(
            torch.tensor([o.layer for o in group]), torch.tensor([o.at.numel() for o in group])
        )
        v = torch.cat([o.value for o in group])
        bi, h, d, q = at // (H * D * Q), at // (D * Q) % H, at // Q % D, at % Q
        bs = bi if view.perm is None else torch.empty_like(view.perm).index_put_((view.perm,), torch.arange(B))[bi]
        flat = bs * Q + q  # in story order, so in (story, query) order
        g = layer * rows_per_block + det[d] * H + h  # the row among every block's
        chosen = (v.isfinite() & view.inside.view(-1)[flat]).nonzero()[:, 0]  # eligible (they beat the worst kept)
        if self.per_story is not None:  # each row's best per_story of each story: by value, then query
            gb = g[chosen] * B + bs[chosen]
            order = sorted_by(gb, -v[chosen], q[chosen])
            chosen = chosen[order][ranks_of(gb[order]) < self.per_story]
        if self.per_story is None or self.per_story * B > self.k:  # each row's first k (else already at most k)
            order = sorted_by(g[chosen], -v[chosen], flat[chosen])
            chosen = chosen[order][ranks_of(g[chosen][order]) < self.k]
        chosen = chosen[(g[chosen] * (B * Q) + flat[chosen]).argsort()]  # by row, then (story, query)
        if chosen.numel() == 0:
            return []
        g, flat = g[chosen], flat[chosen]
        rows, row_of = torch.unique_consecutive(g, return_inverse=True)  # [U] rows, [N] each query's
        c = min(self.k, B * Q)
        place = ranks_of(g)  # [N]: its place in its row
        real = torch.zeros(rows.numel(), c, dtype=torch.bool)
        real[row_of, place] = True
        first_row = torch.searchsorted(rows, torch.arange(self.n_layer + 1) * rows_per_block).tolist()
        first = torch.searchsorted(g, torch.arange(self.n_layer + 1) * rows_per_block).tolist()
        rowmaps = torch.cat([o.rowmaps for o in group])[chosen]
        value, qi, bi = v[chosen].to(torch.float64), q[chosen], bi[chosen]
        taken = []
        for lay in range(self.n_layer):
            a, b, ra, rb = first[lay], first[lay + 1], first_row[lay], first_row[lay + 1]
            if a == b:
                continue
            here = slice(a, b)
            spot = (row_of[here] - ra) * c + place[here]
            local = rows[ra:rb] - lay * rows_per_block
            taken.append(
                Taken(lay, local, real[ra:rb], spot, view, rowmaps[here], value[here], flat[here], qi[here], bi[here])
            )
        return taken

    def flush(self) -> None:
        """Select the queries taken from the blocks fed since the last flush into their blocks' slots:
        each block's taken queries were read off its map when it was fed (the rows of the map they
        need), and the slots and top ``k`` of every such block are made here in one pass for all of
        them, not block by block (the same slots: a block's rows are its own; a block fed twice before
        a flush is flushed at its second chunk, so its worst kept is always up to date). The queries
        blocks offered (:meth:`_offer`) are selected among first, for every block at once."""
        offered, self._offered = self._offered, []
        for same in alike_groups(offered):  # offered from the same chunk of rows of the same batch
            self._pending += self._take_offered(same)
        pending, self._pending = self._pending, []
        for group in alike_groups(pending):  # taken from the same chunk of rows of the same batch
            self._select_taken(group)

    def _select_taken(self, group: list[Taken]) -> None:
        """:meth:`flush` for blocks whose taken queries share a batch view, key count and slot count."""
        view, c, dev = group[0].view, group[0].c, group[0].rows.device
        offsets = [0]
        for t in group:
            offsets.append(offsets[-1] + t.rows.shape[0])
        at = torch.cat([t.at + offsets[i] * c for i, t in enumerate(group)])  # [N]: flat slots of every block
        rowmaps, value, flat, qi, bi = (torch.cat([getattr(t, f) for t in group]) for f in Taken.READ)
        got_f, got_i = self._windows(rowmaps, value, flat, qi, bi, view)
        R = offsets[-1]
        floats = torch.full((R * c, got_f.shape[-1]), -math.inf, dtype=torch.float64, device=dev)
        ints = torch.full((R * c, got_i.shape[-1]), -1, dtype=torch.long, device=dev)
        floats[at], ints[at] = got_f, got_i
        floats[:, 0].masked_fill_(~torch.cat([t.real.reshape(-1) for t in group]), -math.inf)  # padding: empty
        slots = [self._block_slots(t.layer, dev) for t in group]
        row_f = torch.cat([f[t.rows] for t, (f, _) in zip(group, slots)])
        row_i = torch.cat([i[t.rows] for t, (_, i) in zip(group, slots)])
        kept_f, kept_i = select_top(
            torch.cat([row_f, floats.view(R, c, -1)], 1), torch.cat([row_i, ints.view(R, c, -1)], 1),
            self.k, self.per_story,
        )  # fmt: skip
        for t, (f, i), a, b in zip(group, slots, offsets, offsets[1:]):
            # new tensors, not written in place: slots made inside a recording's inference mode are fed outside it
            self._slots[t.layer] = f.index_copy(0, t.rows, kept_f[a:b]), i.index_copy(0, t.rows, kept_i[a:b])
            self._stale.add(t.layer)

    def _check_offers(
        self, layer: int, offers: Sequence[tuple[str, torch.Tensor, torch.Tensor]], pattern: torch.Tensor
    ) -> tuple[int, int, int]:
        """``(B, H, Q)`` of the offers, every shape checked against them and this instance."""
        if not 0 <= layer < self.n_layer:
            raise ValueError(f"examples: no layer {layer} (0 .. {self.n_layer - 1})")
        first = offers[0][1]
        if first.dim() != 3 or first.shape[1] != self.n_head:
            raise ValueError(f"examples: values of shape {tuple(first.shape)}; expected [batch, {self.n_head}, query]")
        B, H, Q = first.shape
        for name, values, counted in offers:
            if name not in self._kept:
                raise ValueError(f"examples: no detector {name!r} (this one keeps {', '.join(self.detectors)})")
            if tuple(values.shape) != (B, H, Q):
                raise ValueError(f"examples: values of shape {tuple(values.shape)}; expected {(B, H, Q)}")
            if tuple(counted.shape) != (B, Q):
                raise ValueError(f"examples: counted of shape {tuple(counted.shape)}; expected {(B, Q)}")
        if len({name for name, _, _ in offers}) != len(offers):
            raise ValueError(f"examples: a detector offered twice ({', '.join(name for name, _, _ in offers)})")
        if pattern.dim() != 4 or tuple(pattern.shape[:3]) != (B, H, Q):
            raise ValueError(f"examples: pattern of shape {tuple(pattern.shape)}; expected [{B}, {H}, {Q}, key]")
        return B, H, Q

    def _eligible(
        self,
        values: torch.Tensor,
        counted: torch.Tensor,
        heads: torch.Tensor,
        at: torch.Tensor,
        worst: torch.Tensor,
        later: torch.Tensor,
        view: BatchView,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected rows' values ``[r, B * Q]`` (row ``i``: head ``heads[i]`` of offered detector
        ``at[i]``, of ``values [B, H, D, Q]``; stories in story order, so a flat index ``b * Q + q``
        runs in (story, query) order) and which of them may enter its top ``k``: a row that keeps k
        examples takes only queries that beat its worst one (``worst``, ``later``: :func:`worst_kept` of
        the rows; an empty slot: any). ``counted``: ``[B, D, Q]``, or ``[B, H, D, Q]`` per head."""
        B, H, D, Q = values.shape
        r = heads.shape[0]
        v = values[:, heads, at].transpose(0, 1)  # [r, B, Q]
        c = (counted[:, heads, at] if counted.dim() == 4 else counted[:, at]).transpose(0, 1)  # [r, B, Q]
        if view.perm is not None:
            v, c = v.index_select(1, view.perm), c.index_select(1, view.perm)
        v = v.reshape(r, B * Q)
        c = (c & view.inside).reshape(r, B * Q)
        wv = worst[:, None]
        earlier = view.flat_order < later[:, None]  # [r, B * Q]: before the worst kept in (story, query) order
        eligible = c & v.isfinite() & ((v > wv) | ((v == wv) & earlier))
        if self.per_story is not None and self.per_story < Q:
            eligible = story_capped(eligible, v, B, self.per_story)
        return v, eligible

    def _taken_rows(
        self,
        layer: int,
        rows: torch.Tensor,
        take: torch.Tensor,
        v: torch.Tensor,
        pattern: torch.Tensor,
        view: BatchView,
        heads: torch.Tensor,
    ) -> Taken:
        """The taken queries of block ``layer`` (``take [R, B * Q]``, at most k a row; ``rows [R]`` the
        slots' rows, ``heads [R]`` each row's head) with what their slots need of the map, read now:
        each query's row of ``pattern [B, H, Q, K]`` (its most-attended key and the weights around)."""
        fi, real = taken_rows(take, self.k)  # [R, c]
        R, c = fi.shape
        dev = fi.device
        B, H, Q, K = pattern.shape
        # on the CPU only the taken queries' rows are read; elsewhere every slot's (no sync)
        at = real.reshape(-1).nonzero()[:, 0] if dev.type == "cpu" else torch.arange(R * c, device=dev)  # [N]
        row, flat = at // c, fi.reshape(-1)[at]
        hi = heads[row]
        bs, qi = flat // Q, flat % Q  # bs: the row in story order; qi: the row in the chunk
        bi = view.perm[bs] if view.perm is not None else bs  # the row in the batch
        if pattern.is_contiguous():
            rowmaps = pattern.detach().view(B * H * Q, K).index_select(0, ((bi * H + hi) * Q + qi).to(pattern.device))
        else:
            rowmaps = pattern.detach()[bi, hi, qi]
        value = v[row, flat].to(torch.float64)
        return Taken(layer, rows, real, at, view, rowmaps.to(dev), value, flat, qi, bi)

    def _windows(
        self,
        rowmaps: torch.Tensor,
        value: torch.Tensor,
        flat: torch.Tensor,
        qi: torch.Tensor,
        bi: torch.Tensor,
        view: BatchView,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's floats ``[N, F]`` and ints ``[N, I]`` for each query taken (its row of the map
        ``rowmaps [N, K]``, its value, flat index ``b * Q + q`` in story order, row in the chunk and
        row in the batch): the value, the most-attended key (the earliest key holding the row's
        maximum), its weight, the weights and token ids around the query and around that key."""
        dev, K = rowmaps.device, rowmaps.shape[-1]
        keys = torch.arange(K, device=dev)
        key = torch.where(rowmaps == rowmaps.amax(-1, keepdim=True), keys, K).amin(-1).clamp(max=K - 1)  # [N]
        query = qi + view.start  # the query's position
        near = torch.cat(
            [
                window_weights(rowmaps, query, self.context, self.context + 1),
                window_weights(rowmaps, key, KEY_BEFORE, KEY_WIDTH),
            ],
            -1,
        )
        floats = torch.cat([value[:, None], rowmaps.gather(-1, key[:, None]).to(torch.float64), rounded_now(near)], -1)
        ids, T = view.batch.ids.to(dev), view.batch.ids.shape[1]
        length = view.batch.lengths.to(dev)[bi][:, None]  # [N, 1]

        def ids_at(first: torch.Tensor, width: int) -> torch.Tensor:  # [N, width]: -1 outside the story
            pos = first[:, None] + torch.arange(width, device=dev)
            return torch.where((pos >= 0) & (pos < length), ids[bi[:, None], pos.clamp(0, T - 1)], -1)

        raw = torch.full_like(key, int(rowmaps.dtype not in NARROW))
        heads = torch.stack([view.story_of[0, flat], query, key, raw], -1)  # [N, 4]
        tokens = [ids_at(query - self.context, self.context + QUERY_AFTER), ids_at(key - KEY_BEFORE, KEY_WIDTH)]
        return floats, torch.cat([heads, *tokens], -1)

    # ---------------------------------------------------------------- slots and Examples

    def _widths(self) -> tuple[int, int]:
        """The floats' and ints' widths of a slot."""
        return 2 + self.context + 1 + KEY_WIDTH, 4 + self.context + QUERY_AFTER + KEY_WIDTH

    def _block_slots(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``layer``'s slots on ``device``, made from its Examples where it has none yet (a
        fresh instance, or after :meth:`load_state` or :meth:`merge`)."""
        if layer in self._slots:
            floats, ints = self._slots[layer]
            if floats.device != device:
                self._slots[layer] = floats, ints = floats.to(device), ints.to(device)
            return floats, ints
        n_float, n_int = self._widths()
        R, k = len(self.detectors) * self.n_head, self.k
        floats = torch.zeros(R, k, n_float, dtype=torch.float64)  # empty slots (no Python list per slot)
        floats[..., 0] = -math.inf
        ints = torch.full((R, k, n_int), -1, dtype=torch.long)
        for d, name in enumerate(self.detectors):
            for h, row in enumerate(self._kept[name][layer]):
                if row:
                    fl, il = zip(*(self._slot_of(e) for e in row))
                    floats[d * self.n_head + h, : len(row)] = torch.tensor(fl, dtype=torch.float64)
                    ints[d * self.n_head + h, : len(row)] = torch.tensor(il, dtype=torch.long)
        self._slots[layer] = floats.to(device), ints.to(device)
        return self._slots[layer]

    def _slot_of(self, e: Example) -> tuple[list[float], list[int]]:
        """One Example as a slot's floats and ints (its weights already rounded: raw 0)."""
        floats = [e.value, e.key_weight, *e.weights, *[0.0] * (self.context + 1 - len(e.weights)), *e.key_weights]
        tokens = [-1] * (self.context - e.query_at) + list(e.tokens)
        key_tokens = [-1] * (KEY_BEFORE - e.key_at) + list(e.key_tokens)
        tokens += [-1] * (self.context + QUERY_AFTER - len(tokens))
        ints = [e.story, e.query, e.key, 0, *tokens, *key_tokens, *[-1] * (KEY_WIDTH - len(key_tokens))]
        return floats + [0.0] * (self._widths()[0] - len(floats)), ints

    def _settle(self) -> None:
        """Make the Examples of every block fed since they were last made: one copy of its slots."""
        self.flush()
        C = self.context
        for layer in sorted(self._stale):
            floats, ints = self._slots[layer]
            count = floats[..., 0].isfinite().sum(-1).tolist()  # per row: its slots in use come first
            fl, il = floats.cpu().tolist(), ints.cpu().tolist()
            for r, n in enumerate(count):
                row = []
                for f, i in zip(fl[r][:n], il[r][:n]):
                    story, query, key, raw = i[:4]
                    query_at, key_at = query - max(0, query - C), key - max(0, key - KEY_BEFORE)
                    tokens = tuple(t for t in i[4 : 4 + C + QUERY_AFTER] if t >= 0)
                    key_tokens = tuple(t for t in i[4 + C + QUERY_AFTER :] if t >= 0)
                    weights, key_weights = (
                        f[2 : 3 + C][: query_at + 1],
                        f[3 + C :][: key_seen(query, key, key_at, key_tokens)],
                    )
                    if raw:
                        weights = [round(w, WEIGHT_DECIMALS) for w in weights]
                        key_weights = [round(w, WEIGHT_DECIMALS) for w in key_weights]
                    row.append(
                        Example(
                            story,
                            query,
                            f[0],
                            key,
                            f[1],
                            tokens,
                            query_at,
                            key_tokens,
                            key_at,
                            tuple(weights),
                            tuple(key_weights),
                        )
                    )
                self._kept[self.detectors[r // self.n_head]][layer][r % self.n_head] = row
        self._stale.clear()

    def _forget_fed(self) -> None:
        self._slots, self._stale, self._pending, self._offered = {}, set(), [], []

    @classmethod
    def from_state(cls, state: dict) -> TopExamples:
        """A new instance holding ``state`` (its sizes, detectors, k and context read from it)."""
        if not isinstance(state, dict) or set(state) != STATE_KEYS:
            raise ValueError(not_a_state(state))
        try:
            n_layer, n_head = state["shape"]
            made = cls(n_layer, n_head, state["detectors"], state["k"], state["context"], state["per_story"])
        except (TypeError, ValueError, StorylensError) as e:
            raise ValueError(f"examples state: bad shape, detectors, k or context ({e})") from None
        return made.load_state(state)
