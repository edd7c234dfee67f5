"""What each head does to the loss: attribution patching (AtP) and direct logit attribution (DLA),
for every head at once, streamed over a corpus with a standard error.

**AtP** (Nanda 2023; Syed et al. 2023; Kramar et al. 2024, "AtP*"). Head ``h`` of block ``l``
writes ``z_t [d_head]`` at position ``t`` (``blocks.{l}.attn.hook_z``, the input of the output
projection). Replacing it by ``z'_t`` changes a story's summed next-token loss ``L_s`` by, to
first order, ``sum_t (z'_t - z_t) . g_t`` with ``g_t = dL_s/dz_t``: one forward and one backward
pass give it for every head. Over the positions after the opening token (``1 <= t < len``):

    zero ablation  (z' = 0):   c_s = -A_s                  A_s = sum_t z_t . g_t
    mean ablation  (z' = mu):  c_s = mu . G_s - A_s        G_s = sum_t g_t   [d_head]

and the column is ``sum_s c_s / sum_s n_s`` (``n_s = len - 1`` predicted tokens: the change in the
corpus's mean next-token loss, pooled as perplexity is), with the ratio estimator's standard error
(:func:`storylens.engine.accumulate.pooled_ratio`). ``mu`` is the corpus mean of ``z`` over the
same positions, unknown until the last story: AtP is linear in it, so the pass keeps sums and
evaluates at the end. Per head: ``sum G``, ``sum z`` and the position count (for ``mu``); for the
error ``sum G G^T [d, d]``, ``sum A G``, ``sum n G`` beside ``sum A``, ``sum A^2``, ``sum n A`` (the
zero-ablation sums), so that

    sum c   = mu . sum G - sum A
    sum c^2 = mu^T (sum G G^T) mu - 2 mu . sum A G + sum A^2
    sum c n = mu . sum n G - sum n A.

Every sum is float64 and a plain sum over stories: streamed, resumable and mergeable in any order.
The error treats ``mu`` as fixed (its own sampling error is second order over a corpus).

**DLA** (TransformerLens's ``logit_attrs``): the head's output through its slice of the output
projection, ``z_t W_O^h``, through the final norm with its scale frozen at the run's value (centred
first for a LayerNorm, as the norm centres), on ``W_U[next] - mean_v W_U[v]``; mean over predicted
tokens (the opening token's prediction included), sign-aware, with the same pooled error.

The gradients come from :func:`storylens.engine.record.record`: a measure whose
:class:`~storylens.engine.record.Needs` says ``gradients=True`` is handed one :class:`Gradients`
per block and batch (:func:`storylens.engine.gradients.gradient_pass`: a forward pass with the
model's fused attention and one backward pass, block by block, no weight gradients, no attention
maps); a batch's sums are added once its last block is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from storylens.core.errors import StorylensError
from storylens.engine.accumulate import RatioAccumulator, cauchy_slack, pooled_ratio
from storylens.engine.encode import StoryBatch
from storylens.engine.gradients import GRAPH_BYTES, Gradients
from storylens.engine.readout import Readout
from storylens.engine.record import Needs

CAUSAL_COLUMNS = ("atp_mean", "atp_mean_se", "atp_zero", "atp_zero_se", "dla", "dla_se")


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to("cpu" if x.device.type == "mps" else x.device, torch.float64)


class CausalAccumulator:
    """Streamed AtP and DLA sums for every head (see the module docstring); a measure for
    :func:`~storylens.engine.record.record` (or composed into
    :class:`~storylens.table.accumulator.HeadScoreAccumulator`). ``state``/``load_state``/``merge``
    as every accumulator; :meth:`columns` the six columns, :meth:`z_means` the ``mu`` of ``atp_mean``."""

    def __init__(self, n_layer: int, n_head: int, graph_bytes: int = GRAPH_BYTES):
        self.n_layer, self.n_head = n_layer, n_head
        self.needs = Needs(gradients=True, attention=False, graph_bytes=graph_bytes)
        self.d_head: int | None = None  # known from the first batch
        self.zero = RatioAccumulator((n_layer, n_head))  # c = -A
        self.dla = RatioAccumulator((n_layer, n_head))
        self.dla_seen = False
        self.sums: dict[str, torch.Tensor] = {}  # G, Z, GG, AG, nG: per head, float64
        self.positions = 0.0  # positions after the opening token (mu's count)
        self._batch: StoryBatch | None = None  # the batch whose blocks are coming in
        self._parts: dict[int, dict[str, torch.Tensor]] = {}  # its blocks so far
        self._read: _Readout | None = None  # its DLA readout

    def _init(self, d: int) -> None:
        L, H = self.n_layer, self.n_head
        self.d_head = d
        z = torch.zeros(L, H, d, dtype=torch.float64)
        self.sums = {"G": z.clone(), "Z": z.clone(), "AG": z.clone(), "nG": z.clone()}
        self.sums["GG"] = torch.zeros(L, H, d, d, dtype=torch.float64)

    def begin(self, batch: StoryBatch) -> None:
        pass

    def feed(self, chunk: object) -> None:
        pass

    def end(self) -> None:
        pass

    def gradients(self, g: Gradients) -> None:
        """Add one block of one batch: per story and head ``A``, ``G``, ``sum z`` and the DLA sum.
        A batch's blocks come together (the last first); its sums are added once all are in."""
        after, predicted = g.masks()
        if self.d_head is None:
            self._init(g.z.shape[-1])
        if self._batch is not g.batch:  # a new batch: its DLA readout, and no block yet
            self._batch, self._parts, self._read = g.batch, {}, _readout(g, predicted)
        w_after = after[:, :, None, None]  # [B, T, 1, 1]
        z64, g64 = _f64(g.z) * w_after, _f64(g.grad) * w_after  # [B, T, H, d], zero outside 1 .. len - 1
        part = {
            "A": (z64 * g64).sum((1, 3)).cpu(),  # [B, H]
            "G": g64.sum(1).cpu(),  # [B, H, d]
            "Z": z64.sum((0, 1)).cpu(),  # [H, d]
        }
        if self._read is not None and g.output_weights is not None:
            part["D"] = _dla_sums(g.z, self._read, g.output_weights).cpu()  # [B, H]
        self._parts[g.layer] = part
        if len(self._parts) == self.n_layer:
            self._add_batch(g.batch, float(after.sum()))

    def _add_batch(self, batch: StoryBatch, positions: float) -> None:
        """The batch's blocks, all in: to the sums (as one ``[B, layer, head]`` table per quantity)."""
        parts = [self._parts[layer] for layer in range(self.n_layer)]
        self._batch, self._parts, self._read = None, {}, None
        n = (batch.lengths - 1).to(torch.float64).cpu()  # [B] predicted tokens
        a, gs = (
            torch.stack([p["A"] for p in parts], 1),
            torch.stack([p["G"] for p in parts], 1),
        )  # [B, L, H], [B, L, H, d]
        self.zero.add(-a, n)
        s = self.sums
        s["G"] += gs.sum(0)
        s["Z"] += torch.stack([p["Z"] for p in parts])
        s["AG"] += (a[..., None] * gs).sum(0)
        s["nG"] += (n[:, None, None, None] * gs).sum(0)
        s["GG"] += torch.einsum("blhd,blhe->lhde", gs, gs)
        self.positions += positions
        if all("D" in p for p in parts):
            self.dla.add(torch.stack([p["D"] for p in parts], 1), n)
            self.dla_seen = True

    def z_means(self) -> torch.Tensor:
        """``[layer, head, d_head]`` float64: the corpus mean of ``z`` over every position after the
        opening token (the ``mu`` of ``atp_mean``)."""
        if self.d_head is None or self.positions == 0:
            raise StorylensError("causal: no story seen yet (no head output means)")
        return self.sums["Z"] / self.positions

    def columns(self) -> dict[str, torch.Tensor | None]:
        """The six columns, ``[layer, head]`` float64 (NaN/None: nothing seen, or DLA unreadable)."""
        if self.d_head is None:
            return dict.fromkeys(CAUSAL_COLUMNS)
        zero, zero_se = self.zero.result()
        mu, s, z = self.z_means(), self.sums, self.zero
        c = (mu * s["G"]).sum(-1) + z.c  # z.c = -sum A
        c2 = torch.einsum("lhd,lhde,lhe->lh", mu, s["GG"], mu) - 2 * (mu * s["AG"]).sum(-1) + z.c2
        cn = (mu * s["nG"]).sum(-1) + z.cn
        mean, mean_se = pooled_ratio(c, z.n, c2, cn, z.n2, z.count)
        dla, dla_se = self.dla.result() if self.dla_seen else (None, None)
        return dict(zip(CAUSAL_COLUMNS, (mean, mean_se, zero, zero_se, dla, dla_se)))

    def merge(self, other: CausalAccumulator) -> CausalAccumulator:
        if (other.n_layer, other.n_head) != (self.n_layer, self.n_head):
            raise ValueError("merge: the causal sums are for other heads")
        if other.d_head is None:
            return self
        if self.d_head is None:
            self._init(other.d_head)
        elif other.d_head != self.d_head:
            raise ValueError("merge: the causal sums are for another head size")
        for k, v in other.sums.items():
            self.sums[k] += v
        self.zero.merge(other.zero)
        self.dla.merge(other.dla)
        self.positions += other.positions
        self.dla_seen = self.dla_seen or other.dla_seen
        return self

    def state(self) -> dict:
        """Every sum as plain data (float64, exact in JSON)."""
        return {
            "d_head": self.d_head,
            "sums": {k: v.tolist() for k, v in self.sums.items()},
            "positions": self.positions,
            "zero": self.zero.state(),
            "dla": self.dla.state() if self.dla_seen else None,
        }

    def load_state(self, state: dict) -> CausalAccumulator:
        """Take :meth:`state`'s sums; ValueError naming what is wrong."""
        if not isinstance(state, dict) or set(state) != {"d_head", "sums", "positions", "zero", "dla"}:
            raise ValueError("not a causal accumulator's state")
        d = state["d_head"]
        if d is None:
            self.__init__(self.n_layer, self.n_head)  # type: ignore[misc]
            return self
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"d_head {d!r} is not a whole number of 1 or more")
        self._init(d)
        shape = (self.n_layer, self.n_head)
        sums = state["sums"]
        if not isinstance(sums, dict) or set(sums) != set(self.sums):
            raise ValueError("sums: not G, Z, AG, nG, GG")
        for k in self.sums:
            try:
                v = torch.tensor(sums[k], dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"sums.{k}: not numbers") from None
            if v.shape != self.sums[k].shape or not torch.isfinite(v).all():
                raise ValueError(f"sums.{k}: shape {tuple(v.shape)} or a value not finite")
            self.sums[k] = v
        positions = state["positions"]
        if not isinstance(positions, (int, float)) or not positions >= 0:
            raise ValueError(f"positions {positions!r} is not a count")
        self.positions = float(positions)
        self.zero = RatioAccumulator.from_state(state["zero"], shape)
        self.dla_seen = state["dla"] is not None
        self.dla = RatioAccumulator.from_state(state["dla"], shape) if self.dla_seen else RatioAccumulator(shape)
        self._check_together()
        return self

    def _check_together(self) -> None:
        """ValueError unless the sums are what the same stories give together: the positions are the predicted
        tokens (``zero.n``; DLA's the same where kept), and per head and coordinate ``G^2 <= S GG``,
        ``nG^2 <= n2 GG``, ``AG^2 <= (sum a^2) GG`` with ``GG``'s diagonal and its Gram bound (Cauchy-Schwarz over
        the ``S`` stories; rounding's slack as :func:`~storylens.engine.accumulate.cauchy_slack` derives it)."""
        z, s = self.zero, self.sums
        if abs(self.positions - z.n) > 0.5 or (self.dla_seen and (self.dla.n, self.dla.count) != (z.n, z.count)):
            raise ValueError(f"positions {self.positions:g}: not the {z.n:g} predicted tokens its stories hold")
        diag = s["GG"].diagonal(dim1=-2, dim2=-1)  # [L, H, d]
        rel = cauchy_slack(z.count, diag.shape[-1])
        if (diag < 0).any():
            raise ValueError("sums.GG: a negative sum of squares")
        bounds = {"G": z.count * diag, "nG": z.n2 * diag, "AG": z.c2[..., None] * diag}
        for k, bound in bounds.items():
            if (s[k] * s[k] > bound * (1 + rel) + 1e-300).any():
                raise ValueError(f"sums.{k}: cannot come from {z.count} stories with these sums of squares")
        gram = s["GG"] * s["GG"] > diag[..., :, None] * diag[..., None, :] * (1 + rel) + 1e-300
        if gram.any():
            raise ValueError("sums.GG: not a sum of outer products (a cross term exceeds its diagonal)")


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; anything else is widened to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class _Readout:
    """A batch's DLA readout: the direction at position ``t`` is ``rows[index[t]] * factor[t]``: the
    rows ``[U, d_model]`` one per distinct next token (its unembedding minus the vocabulary's mean,
    times the norm's gain, centred for a LayerNorm), ``index [B, T]`` which row, ``factor [B, T]``
    one over the norm's frozen scale at predicted positions and 0 elsewhere. Each row is taken back
    through a block's ``W_O`` once (:func:`_dla_sums`), not once per position."""

    rows: torch.Tensor
    index: torch.Tensor
    factor: torch.Tensor


def _dla_sums(z: torch.Tensor, read: _Readout, weights: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` float64: per story and head, ``sum_t z_t W_O^h . direction_t`` (``z [B, T, H, d]``,
    ``weights`` ``W_O [H, d, d_model]``). Each distinct next token's row is taken back through ``W_O``
    in one product (``[U, d_model] x [d_model, H * d]``: a story's tokens repeat, so far fewer rows
    than positions), in the readout's dtype (:func:`_wide` of the model's: float64 for a float64
    model, else float32); each position's term is then a sum of ``d_model + d_head`` products times
    its factor, so its rounding is at most that many float32 epsilons of the sum of their sizes (4e-5
    relative for 576 + 64, far below any DLA's standard error), and the positions are summed in float64."""
    B, T, H, d = z.shape
    dt = read.rows.dtype
    back = read.rows @ weights.to(dt).reshape(H * d, -1).T  # [U, H * d]
    w = back[read.index.reshape(-1)].view(B, T, H, d) * read.factor[:, :, None, None]  # [B, T, H, d]
    return (z.to(dt) * w).sum(-1).to(torch.float64).sum(1)


VOCAB_ROWS = 4096  # unembedding rows widened to float64 at once for the vocabulary's mean


def _vocab_mean(W: torch.Tensor) -> torch.Tensor:
    """``[d_model]`` float64: the mean of ``W [V, d_model]``'s rows, summed in float64
    :data:`VOCAB_ROWS` rows at a time (no float64 copy of a 50k-row unembedding)."""
    first = _f64(W[:VOCAB_ROWS]).sum(0)
    return (
        sum((_f64(W[i : i + VOCAB_ROWS]).sum(0) for i in range(VOCAB_ROWS, W.shape[0], VOCAB_ROWS)), first) / W.shape[0]
    )


def readout_rows(r: Readout, tokens: torch.Tensor) -> torch.Tensor:
    """``[len(tokens), d_model]`` float64: each token's direction before the final norm's frozen scale, its
    unembedding less the vocabulary's mean, times the norm's gain, centred for a LayerNorm (as the norm centres
    what it is given). A vector ``x`` written into the last residual stream at a position whose norm divides by
    ``s`` moves the token's logit, against the vocabulary's mean, by ``x . row / s``."""
    W = r.unembed  # [V, d_model]
    rows = (_f64(W[tokens.to(W.device)]) - _vocab_mean(W)) * _f64(r.gain)
    return rows - rows.mean(-1, keepdim=True) if r.kind == "layer" else rows


def _readout(g: Gradients, predicted: torch.Tensor) -> _Readout | None:
    """The batch's :class:`_Readout` (None: DLA unreadable), in :func:`_wide` of the model's dtype on
    the head outputs' device; the rows formed in float64."""
    r = g.readout
    if r is None or g.scale is None:
        return None
    ids = g.batch.ids
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)  # [B, T]: the next token
    tokens, index = torch.unique(nxt.cpu(), return_inverse=True)  # [U], [B, T]
    rows = readout_rows(r, tokens)  # [U, d_model]
    factor = predicted.to(rows.device) / _f64(g.scale)  # [B, T]
    dt, dev = _wide(g.z.dtype), g.z.device
    return _Readout(rows.to(dt).to(dev), index.to(dev), factor.to(dt).to(dev))
