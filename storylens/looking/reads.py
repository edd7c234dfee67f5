"""Each map row's weights on the few keys the previous-token detectors read (keys q .. q - PREV_SPAN and 0),
read once per chunk and, scaled by the keys' output norms, held back and summed once per batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from storylens.engine.masks import PREV_SPAN, READ_KEYS, Masks, norms_for_keys
from storylens.looking.patterns import scaled_wins, span_sum


class Reads:
    """What the built-in detectors read of one chunk of a block's map ``pattern [B, H, n, keys]``
    (:attr:`~storylens.looking.detectors.Detector.read`), taken once for all of them: each row's weights on its newest keys
    ``q .. q - PREV_SPAN`` and on key 0 in one gather, every duplicate-token and induction pair's weight
    (:meth:`~storylens.engine.masks.Masks.key_pairs`) in another, summed per query in one scatter. :meth:`scaled` gives the same
    reads of the norm-scaled map (:func:`~storylens.looking.patterns.scaled`): each read weight times its key's norm, the map not
    formed. Each value equals the detector's ``values`` (``scaled``) bit for bit: the same entries, the
    same products, the same sums in the same order (a key before position 0 reads 0, as
    :func:`~storylens.looking.patterns.diagonal` pads)."""

    def __init__(
        self,
        pattern: torch.Tensor,
        masks: Masks,
        norms: torch.Tensor | None = None,
        raw: Reads | None = None,
        held: HeldReads | None = None,
    ):
        self.pattern, self.masks, self.norms, self._raw = pattern, masks, norms, raw
        self._held = held  # the raw reads of a map now gone (:meth:`HeldReads.scaled`): served from it

    def held(self, norms: torch.Tensor) -> HeldReads:
        """What the reads of the map scaled by ``norms [B, H, keys]`` need of the map, taken now: the
        raw entries and pairs gathered, and the scaled previous-token argmax decided (it needs the map
        where its bounds leave a row unsure)."""
        B, H, n, _ = self.pattern.shape
        start = self.masks.start
        w = norms_for_keys(self.pattern, norms)
        key = self.masks.read_index()[1]
        # the scaled reads, bit for bit (the same products): keys q, q - 1, .., q - PREV_SPAN, then 0
        scaled = (self._entries.view(B, H, -1) * w.gather(-1, key.expand(B, H, key.shape[0]))).view(B, H, n, -1)
        # a lower bound of the largest on keys 0 .. q - 2: those read there (0 where a key is missing). For
        # q < 2 key 0 is q - 1 or q itself, but no row there is unsure (the upper bound is 0: prev > 0 wins)
        known = scaled[..., 2:].amax(-1)
        prev, own = scaled[..., 1], scaled[..., 0]
        wins = scaled_wins(self.pattern, w, start, self.masks.earlier_max(self.pattern), prev, own, known)
        return HeldReads(self._entries, self._picked, self.pattern.shape[-1], norms, wins)

    def scaled(self, norms: torch.Tensor, masks: Masks | None = None) -> Reads:
        """The same reads of ``pattern * norms[key]`` (``norms [B, H, keys]``), from these; ``masks``:
        views of the same rows with the scaled name and marker masses formed (:meth:`~storylens.engine.masks.Masks.with_mass`)."""
        return Reads(self.pattern, self.masks if masks is None else masks, norms, self)

    @cached_property
    def _w(self) -> torch.Tensor:  # [B, H, keys]: the key norms in the map's dtype
        assert self.norms is not None
        return norms_for_keys(self.pattern, self.norms)

    @cached_property
    def _entries(self) -> torch.Tensor:
        """``[B, H, n, READ_KEYS]``: each row's weights on keys ``q, q - 1, .., q - PREV_SPAN`` and 0."""
        if self._held is not None:
            return self._held.entries
        flat, key, valid = self.masks.read_index()
        B, H, n, K = self.pattern.shape
        if self._raw is None:  # (a gather, several times faster on a CPU than index_select on the last axis)
            got = self.pattern.reshape(B, H, n * K).gather(-1, flat.expand(B, H, flat.shape[0]))
        else:
            got = self._raw._entries.view(B, H, -1) * self._w.gather(-1, key.expand(B, H, key.shape[0]))
        return torch.where(valid, got.view(B, H, n, READ_KEYS), torch.zeros((), dtype=got.dtype))

    def diagonal(self, k: int) -> torch.Tensor:
        """:func:`~storylens.looking.patterns.diagonal` ``k`` (0 .. PREV_SPAN) of the map, ``[B, H, n]``."""
        return self._entries[..., k]

    def first(self) -> torch.Tensor:
        """Each row's weight on key 0, ``[B, H, n]``."""
        return self._entries[..., READ_KEYS - 1]

    def prev_span(self, span: int = PREV_SPAN) -> torch.Tensor:
        """:func:`prev_span`: the weights on keys ``q - 1 .. q - span`` summed in the same order."""
        return span_sum(self.diagonal, span)

    def column_mass(self) -> torch.Tensor:
        """:meth:`~storylens.engine.masks.Masks.column_mass` (or its scaled twin), ``[B, H, n, 2]``: name and marker."""
        if self._raw is None:
            return self.masks.column_mass(self.pattern)
        assert self.norms is not None
        return self.masks.scaled_column_mass(self.pattern, self.norms)

    def prev_is_argmax(self) -> torch.Tensor:
        """:func:`~storylens.looking.patterns.prev_is_argmax` (or :func:`~storylens.looking.patterns.scaled_prev_is_argmax`) from the read diagonals."""
        if self._raw is not None and self._raw._held is not None:  # decided when the map was fed
            return self._raw._held.wins
        earlier = self.masks.earlier_max(self.pattern)
        prev, own = self.diagonal(1), self.diagonal(0)
        if self._raw is not None:
            return scaled_wins(self.pattern, self._w, self.masks.start, earlier, prev, own)
        valid = self.masks.read_index()[2][:, 1]  # [n]: query q >= 1
        return ((prev >= own) & (prev > earlier) & valid).to(self.pattern.dtype)

    @cached_property
    def _picked(self) -> torch.Tensor:
        """``[B, H, P]``: the weight of every pair of both key sets (:meth:`~storylens.engine.masks.Masks.read_pairs`)."""
        if self._held is not None:
            return self._held.picked
        rows, flat, keys = self.masks.read_pairs()
        B, H, n, K = self.pattern.shape
        if self._raw is None:
            return self.pattern.reshape(B, H, n * K).gather(-1, flat.expand(B, H, flat.shape[-1]))
        return self._raw._picked * self._w.gather(-1, keys.expand(B, H, keys.shape[-1]))

    @cached_property
    def _pair_sums(self) -> torch.Tensor:
        rows, _, _ = self.masks.read_pairs()
        B, H, n, _ = self.pattern.shape
        out = torch.zeros(B, H, 2 * (n + 1), dtype=self.pattern.dtype, device=self.pattern.device)
        return out.scatter_add_(-1, rows.expand(B, H, rows.shape[-1]), self._picked)

    def pairs(self, name: str) -> torch.Tensor:
        """:func:`pairs_mass` of the key set ``name`` ("duplicate_keys" or "induction_keys"), ``[B, H, n]``."""
        n = self.pattern.shape[-2]
        at = ("duplicate_keys", "induction_keys").index(name) * (n + 1)
        return self._pair_sums[..., at : at + n]


@dataclass(frozen=True)
class HeldReads:
    """What :class:`Reads` of the norm-scaled map read of one chunk (:meth:`Reads.held`), kept once the
    map is gone: the raw entries ``[B, H, n, READ_KEYS]`` and pairs ``[B, H, P]``, the key norms
    ``[B, H, keys]`` and the scaled previous-token argmax ``[B, H, n]``. Chunks of the same rows of
    several blocks :meth:`join` along the head axis, so their scaled reads are made once for all of
    them: each entry the same product as the chunk's own, so the same bits."""

    entries: torch.Tensor
    picked: torch.Tensor
    keys: int  # the map's
    norms: torch.Tensor
    wins: torch.Tensor

    @staticmethod
    def join(parts: Sequence[HeldReads]) -> HeldReads:
        """Chunks of the same rows and keys, block after block along the head axis."""
        if len(parts) == 1:
            return parts[0]
        entries, picked, norms, wins = (
            torch.cat(x, 1) for x in zip(*((p.entries, p.picked, p.norms, p.wins) for p in parts))
        )
        return HeldReads(entries, picked, parts[0].keys, norms, wins)

    def scaled(self, masks: Masks) -> Reads:
        """The scaled reads (:meth:`Reads.scaled`) of these rows, ``masks`` theirs with the scaled name
        and marker masses formed (:meth:`~storylens.engine.masks.Masks.with_mass`). The map they stand for is gone: their
        ``pattern`` is a stand-in of its shape, dtype and device, holding no entries."""
        B, H, n, _ = self.entries.shape
        standin = torch.zeros((), dtype=self.entries.dtype, device=self.entries.device).expand(B, H, n, self.keys)
        return Reads(standin, masks, held=self).scaled(self.norms, masks)
