"""Attention sinks and dormant heads: what a head moves, from the part of its output that depends on
the story. Streamed in the recording pass (:class:`SinkAccumulator`, owned by
:class:`~storylens.table.accumulator.HeadScoreAccumulator`), mergeable like every other column.

A head that puts all its attention on the opening token writes the same vector at every position
(that token's value through the head's slice of the output projection): a constant bias, which
carries nothing about the story, however large it is. So the measures here look at the head's
output ``o_i = z_i W_O^h`` (before the output projection's bias) at every query ``i >= 1`` of every
story, and split it into its corpus mean and the rest:

``first_mass`` (a detector: :mod:`storylens.looking.detectors`)
    the attention on position 0, over queries ``q >= 1``, mean over stories.
``sink_rate``
    Gu et al. (2024)'s Sink^0.3 at position 0: the share of stories whose ``first_mass`` exceeds
    :data:`SINK_THRESHOLD`.
``first_value_ratio``
    Guo et al. (2024)'s value-state drain: ``|f_0|`` over the mean ``|f_j|`` of the story's other keys
    (``f_j = v_j W_O^h``), mean over stories.
``context_share``
    ``E||o_i - mean(o)||^2 / E||o_i||^2`` over every query ``i >= 1`` of every story, ``mean(o)`` the
    corpus mean: the share of what the head writes that depends on the story; ``context_norm`` is
    ``sqrt(E||o_i - mean(o)||^2)``, its size. Mean ablation (the head's output replaced by
    ``mean(o)``) removes exactly this part.
``active_rate``
    the share of stories in which the head's own context share, about the story's own mean, exceeds
    :data:`ACTIVE_SHARE` (a head dormant on some stories and active on others, Guo et al.).
``dormant`` (the flag, :func:`dormant`)
    the head's context-dependent output is under :data:`DORMANT_SHARE` of an even share of its
    block's (``context_norm^2`` against the mean of its block's heads' ``context_norm^2``), or its
    ``context_share`` at most :data:`DORMANT_FLOOR` (a constant or nothing: an absolute floor, so a block
    whose every head writes a constant flags them all), and, where
    the causal columns were computed, its estimated mean-ablation effect ``|atp_mean| + 2 se`` is
    under :data:`DORMANT_NATS`: switching it to its mean moves nothing.

**How one pass carries it.** The chunks hand each head's output vectors in an orthonormal frame of
its output space (:func:`storylens.engine.images.head_images`: lengths, distances and means are
the residual stream's, in ``k <= head size`` numbers). Per head the pass keeps, in float64, the sums
of ``y_i - a`` and of ``|y_i - a|^2`` and of ``|y_i|^2`` and the count, for a fixed shift ``a`` (the
first output the accumulator saw): then ``E||y - mean||^2 = E|y - a|^2 - |E(y - a)|^2`` exactly, with
rounding relative to the spread about ``a`` rather than to ``|y|^2``: a head that writes one vector
everywhere has ``y_i - a = 0`` and a context share of exactly 0. Two accumulators with different
shifts merge by moving one's sums to the other's shift
(``sum|y - b|^2 = sum|y - a|^2 + 2 (a - b) . sum(y - a) + n |a - b|^2``). Per story the same sums give
the story's own context share (``active_rate``); ``sink_rate`` and ``first_value_ratio`` are per-story
values averaged over stories.
"""

from __future__ import annotations

import math

import torch

from storylens.engine.accumulate import MeanAccumulator, cauchy_slack
from storylens.engine.encode import StoryBatch

SINK_THRESHOLD = 0.3  # Gu et al. 2024's Sink^0.3: a story's first_mass above this
ACTIVE_SHARE = 0.1  # active on a story: its own context share there above this
DORMANT_SHARE = 0.05  # dormant: context_norm^2 under this share of an even share of its block's
DORMANT_FLOOR = 1e-10  # ... or, whatever its block does, a context share at most this: a constant (or nothing) up to
# float32 rounding (a constant computed in float32 varies by about 2**-24 of its size per coordinate: a share of
# about k * 2**-48 < 1e-12 for k <= 256 coordinates; 1e-10 leaves a margin of 100 over it)
DORMANT_NATS = 0.001  # ... and |atp_mean| + 2 se under this, where the causal columns were computed
F64 = torch.float64


def _moved(total: torch.Tensor, square: torch.Tensor, n: float, old: torch.Tensor, new: torch.Tensor):
    """Sums of ``y - old`` (``[..., k]``) and ``|y - old|^2`` over ``n`` vectors, moved to the shift ``new``."""
    delta = old - new
    return total + n * delta, square + 2 * (delta * total).sum(-1) + n * (delta * delta).sum(-1)


class SinkAccumulator:
    """The sink and context columns of every head (see the module docstring), streamed."""

    def __init__(self, n_layer: int, n_head: int, *, threshold: float = SINK_THRESHOLD, active: float = ACTIVE_SHARE):
        shape = (n_layer, n_head)
        self.n_layer, self.n_head, self.threshold, self.active_share = n_layer, n_head, threshold, active
        self.sink, self.first_value, self.active = (
            MeanAccumulator(shape),
            MeanAccumulator(shape),
            MeanAccumulator(shape),
        )
        self.shift: torch.Tensor | None = None  # [L, H, k]: a, the first output seen
        self.total: torch.Tensor | None = None  # [L, H, k]: sum of y - a
        self.square = torch.zeros(shape, dtype=F64)  # sum of |y - a|^2
        self.energy = torch.zeros(shape, dtype=F64)  # sum of |y|^2
        self.positions: int | torch.Tensor = (
            0  # the queries summed (the same in every block; a count on the device until read)
        )
        self._begun = False

    def begin(self, batch: StoryBatch) -> None:
        self._shift: dict[int, torch.Tensor] = {}  # per block, the batch's shift [H, k]
        self._sums: dict[int, tuple[torch.Tensor, ...]] = {}  # per block, per story: sum y - a, |y - a|^2, |y|^2
        self._ratio: dict[int, torch.Tensor] = {}  # per block, per story |f_0| / mean |f_j| [B, H]
        self._begun = True

    def feed(
        self,
        layer: int,
        vectors: torch.Tensor | None,
        outputs: torch.Tensor | None,
        counted: torch.Tensor,
        key_norms,
        full,
    ) -> None:
        """One chunk's output vectors ``[B, H, n, k]`` and their lengths ``outputs [B, H, n]`` (None: none
        read) at its rows, ``counted [B, n]`` the rows that count (``q >= 1`` inside the story); on the
        block's last chunk ``key_norms [B, H, keys]`` over every key and ``full`` the batch's whole masks.
        The chunk's sums over its rows are taken in the run's dtype (float32 at least: a few hundred
        terms) and added in float64."""
        if vectors is None or outputs is None:
            return
        y = vectors.detach()
        shift = self._shift.setdefault(layer, y[0, :, 0, :].clone())  # story 0's first row: any fixed vector
        w = counted.to(y.dtype)
        d = y - shift[None, :, None, :]  # [B, H, n, k]: 0 to the bit for a head that writes one vector
        sums = (
            torch.matmul(w[:, None, None, :], d)[:, :, 0],  # sum of y - a over the counted rows, [B, H, k]
            (torch.linalg.vector_norm(d, dim=-1) ** 2 * w[:, None, :]).sum(-1),  # sum of |y - a|^2
            (outputs.detach().to(y.dtype) ** 2 * w[:, None, :]).sum(-1),  # sum of |y|^2
        )
        parts = tuple(p.to(F64) for p in sums)
        held = self._sums.get(layer)
        self._sums[layer] = parts if held is None else tuple(a + b for a, b in zip(held, parts))
        if key_norms is not None and key_norms.shape[-1] == full.inside.shape[1]:
            self._ratio[layer] = _first_value_ratio(key_norms, full.inside)

    def end(self, full, first_mass: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The batch is done: ``full`` its whole masks, ``first_mass`` its per-story ``[B, L, H]`` values
        and the stories that count (None: the detector was not scored)."""
        if not self._begun:
            raise RuntimeError("end(): no batch begun")
        self._begun = False
        if first_mass is not None:
            values, counts = first_mass
            self.sink.add((values > self.threshold).to(F64), counts)
        L = self.n_layer
        if len(self._sums) < L:
            return  # no output vectors read (or not in every block): the context columns stay empty
        n = full.queries.sum(-1).to(F64)  # [B] queries summed per story
        total, square, energy = (torch.stack([self._sums[i][j] for i in range(L)], 1) for j in range(3))
        shift = torch.stack([self._shift[i] for i in range(L)], 0).to(F64)  # [L, H, k]
        spread = (square - (total * total).sum(-1) / n.clamp(min=1)[:, None, None]).clamp(min=0)  # [B, L, H]
        share = torch.where(energy > 0, spread / torch.where(energy > 0, energy, 1.0), 0.0)
        self.active.add((share > self.active_share).to(F64), n > 0)
        if len(self._ratio) == L:
            ratio = torch.stack([self._ratio[i] for i in range(L)], 1)  # [B, L, H]
            self.first_value.add(ratio.nan_to_num(0.0), torch.isfinite(ratio).all(-1).all(-1) & (n > 0))
        shapes = full.batch.shapes  # the queries counted on the host, or (a batch made without them) on the device
        count = shapes.queries if shapes is not None else n.sum()
        # the run's sums stay where the batch is until they are read (:meth:`_settle`): nothing waits for them here
        self._add(total.sum(0), square.sum(0), energy.sum(0), count, shift)

    def _add(self, total: torch.Tensor, square: torch.Tensor, energy: torch.Tensor, n, shift: torch.Tensor):
        """Sums about ``shift`` over ``n`` queries (a number, or a count on the sums' device), added to these
        (moved to this accumulator's shift) where the added sums are."""
        if self.shift is None or self.total is None:
            self.shift, self.total = shift.clone(), torch.zeros_like(shift)
        self._to(total.device)
        total, square = _moved(total, square, n, shift, self.shift)
        # new tensors, not in place: sums made inside a recording's inference mode are merged outside it
        self.total, self.square, self.energy = self.total + total, self.square + square, self.energy + energy
        self.positions = self.positions + n

    def _to(self, device: torch.device) -> None:
        """These sums moved to ``device`` (from the CPU onto a batch's device, no wait)."""
        if self.energy.device != device:
            self.square, self.energy = self.square.to(device), self.energy.to(device)
            if self.shift is not None and self.total is not None:
                self.shift, self.total = self.shift.to(device), self.total.to(device)

    def _settle(self) -> None:
        """The sums read back to the CPU and the count made a number: once, when they are read."""
        self._to(torch.device("cpu"))
        if isinstance(self.positions, torch.Tensor):
            self.positions = int(self.positions)

    def columns(self) -> dict[str, torch.Tensor | None]:
        """``[layer, head]`` float64 columns (None: not computed)."""
        self._settle()
        cols: dict[str, torch.Tensor | None] = {
            "sink_rate": self.sink.mean() if self.sink.count else None,
            "first_value_ratio": self.first_value.mean() if self.first_value.count else None,
            "active_rate": self.active.mean() if self.active.count else None,
            "context_share": None,
            "context_norm": None,
        }
        if self.total is not None and self.positions:
            N = self.positions
            mean = self.total / N
            var = (self.square / N - (mean * mean).sum(-1)).clamp(min=0)  # E|y - mean|^2
            power = self.energy / N  # E|y|^2
            cols["context_share"] = torch.where(power > 0, var / torch.where(power > 0, power, 1.0), 0.0)
            cols["context_norm"] = var.sqrt()
        return cols

    def merge(self, other: SinkAccumulator) -> SinkAccumulator:
        if (other.n_layer, other.n_head, other.threshold, other.active_share) != (
            self.n_layer,
            self.n_head,
            self.threshold,
            self.active_share,
        ):
            raise ValueError("merge: the sink accumulators score different heads or thresholds")
        self._settle()
        other._settle()
        for mine, theirs in (
            (self.sink, other.sink),
            (self.first_value, other.first_value),
            (self.active, other.active),
        ):
            mine.merge(theirs)
        if other.shift is not None and other.total is not None:
            self._add(other.total, other.square, other.energy, other.positions, other.shift)
        return self

    def state(self) -> dict:
        """Every sum and count as plain data (float64 written exactly by JSON's shortest repr)."""
        self._settle()
        return {
            "thresholds": [self.threshold, self.active_share],
            "sink": self.sink.state(),
            "first_value": self.first_value.state(),
            "active": self.active.state(),
            "shift": None if self.shift is None else self.shift.tolist(),
            "total": None if self.total is None else self.total.tolist(),
            "square": self.square.tolist(),
            "energy": self.energy.tolist(),
            "positions": self.positions,
        }

    def load_state(self, state: dict, max_stories: int | None = None) -> SinkAccumulator:
        """Take :meth:`state`'s sums (the same heads and thresholds); ValueError saying what is wrong."""
        keys = {"thresholds", "sink", "first_value", "active", "shift", "total", "square", "energy", "positions"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError("not a sink accumulator's state")
        if state["thresholds"] != [self.threshold, self.active_share]:
            raise ValueError(f"thresholds {state['thresholds']!r}, expected {[self.threshold, self.active_share]}")
        shape = (self.n_layer, self.n_head)
        sink = MeanAccumulator.from_state(state["sink"], shape, max_count=max_stories)
        active = MeanAccumulator.from_state(state["active"], shape, max_count=max_stories)
        first = MeanAccumulator.from_state(state["first_value"], shape, max_count=max_stories, bounded=False)
        positions = state["positions"]
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 0:
            raise ValueError(f"positions {positions!r} is not a whole number of 0 or more")
        try:
            square, energy = (torch.tensor(state[k], dtype=F64) for k in ("square", "energy"))
            vecs = [None if state[k] is None else torch.tensor(state[k], dtype=F64) for k in ("shift", "total")]
        except (TypeError, ValueError, RuntimeError):
            raise ValueError("sums are not numbers") from None
        if square.shape != shape or energy.shape != shape or (vecs[0] is None) != (vecs[1] is None):
            raise ValueError("sums of another shape")
        sums = [square, energy, *(v for v in vecs if v is not None)]
        if any(not torch.isfinite(t).all() for t in sums) or (square < 0).any() or (energy < 0).any():
            raise ValueError("a sum is negative or not finite")
        shift, total = vecs
        if shift is not None and total is not None and (shift.shape[:2] != shape or total.shape != shift.shape):
            raise ValueError("output sums of another shape")
        _check_output_sums(shift, total, square, energy, positions)
        self.sink, self.active, self.first_value = sink, active, first
        self.shift, self.total, self.square, self.energy, self.positions = shift, total, square, energy, positions
        return self


def _check_output_sums(shift, total, square: torch.Tensor, energy: torch.Tensor, positions: int) -> None:
    """ValueError unless the output sums are what ``positions`` queries can give: nothing over none; per head
    ``|total|^2 <= N square`` and ``square <= (sqrt(energy) + sqrt(N) |shift|)^2`` (Cauchy-Schwarz and the
    triangle inequality over the ``N`` queries, with rounding's slack)."""
    if positions == 0:
        if total is not None and bool(total.abs().sum()) or bool(square.sum() + energy.sum()):
            raise ValueError("output sums over 0 positions are not 0")
        return
    if total is None or shift is None:
        raise ValueError(f"no output sums over {positions} positions")
    rel = cauchy_slack(positions, total.shape[-1])
    if ((total * total).sum(-1) > positions * square * (1 + rel) + 1e-300).any():
        raise ValueError(f"output sums: cannot come from {positions} positions (|sum|^2 exceeds N x the squares)")
    reach = (energy.sqrt() + math.sqrt(positions) * shift.norm(dim=-1)) ** 2
    if (square > reach * (1 + rel) + 1e-300).any():
        raise ValueError("output sums: the squares about the first output exceed what the outputs' energy allows")


def _first_value_ratio(norms: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """``[B, H]``: ``|f_0|`` over the mean ``|f_j|`` of keys ``1 .. length - 1`` (NaN: a story of one
    token, or other keys that all carry nothing)."""
    others = inside.clone()
    others[:, 0] = False
    w = others.to(F64)[:, None, :]
    mean = (norms.to(F64) * w).sum(-1) / w.sum(-1)
    return norms[..., 0].to(F64) / mean


def dormant(
    context_norm: torch.Tensor,
    atp: tuple[torch.Tensor, torch.Tensor] | None = None,
    context_share: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[layer, head]`` bool: the heads whose mean ablation moves nothing (see the module docstring):
    ``context_norm^2`` under :data:`DORMANT_SHARE` of its block's mean ``context_norm^2``, or (the absolute
    floor, which holds whatever the rest of the block does) ``context_share`` at most :data:`DORMANT_FLOOR`: a
    head that writes one vector everywhere, or nothing; and, where ``atp = (atp_mean, atp_mean_se)`` is given,
    ``|atp_mean| + 2 se`` under :data:`DORMANT_NATS` (a head with no estimate, NaN, is not flagged on it)."""
    energy = context_norm.to(F64) ** 2
    even = energy.mean(-1, keepdim=True)
    quiet = energy < DORMANT_SHARE * even
    quiet |= energy == 0  # nothing that depends on the story, even where the whole block writes none
    if context_share is not None:
        quiet |= context_share.to(F64) <= DORMANT_FLOOR
    if atp is not None:
        mean, se = (x.to(F64) for x in atp)
        quiet &= (mean.abs() + 2 * se) < DORMANT_NATS  # NaN compares False
    return quiet
