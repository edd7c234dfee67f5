"""The residual stream with every edge ablated, which every edge-patched run of a batch reads
(:mod:`storylens.circuits.edge_patch`): made by a pass of its own (:func:`ablated_bases`: the run less every writer's
ablated difference, for a mean or zero ablation), or taken from a counterfactual's corrupt run, which is that stream
(:func:`corrupt_stream`); and where the one-copy pass can read a model's structure (:func:`norms_of`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from storylens.circuits.edges import WRITTEN, Metric, graph_of, logits_of, run_pass
from storylens.circuits.receivers import KINDS, MLP_NORMS
from storylens.core.errors import StorylensError
from storylens.lm import AttentionLM, Hook


@dataclass
class Away:
    """Each writer's output in a run less its ablated value. ``away(i, a)``: the embedding's or an MLP's
    (writer ``i``, its output ``a`` ``[batch, pos, d_model]``) less :meth:`ablated`; :meth:`heads`: block
    ``layer``'s heads' mixed values ``z`` ``[batch, pos, head, d_head]`` less ``ablated_z(layer)``. A head writes
    ``z_h @ W_O[h]``, linear in ``z_h``, so its output's difference is its ``z``'s through its own slice of ``W_O``:
    made in one product from the block's ``z``, with no head's ablated output held. ``per``: the writers of a block
    (its heads and its MLP); ``opening``: the first position carries no difference (a story's opening token, never
    ablated)."""

    per: int
    embedding: torch.Tensor  # the embedding's ablated value, broadcast against [batch, pos, d_model]
    ablated_mlp: Callable[[int], torch.Tensor]  # block layer's MLP's, alike
    ablated_z: Callable[[int], torch.Tensor]  # block layer's heads' z, broadcast against [batch, pos, head, d_head]
    opening: bool = False

    def ablated(self, i: int) -> torch.Tensor:
        """The ablated output of writer ``i``, the embedding (0) or an MLP (``1 + layer * per + per - 1``)."""
        return self.embedding if i == 0 else self.ablated_mlp((i - 1) // self.per)

    def __call__(self, i: int, a: torch.Tensor) -> torch.Tensor:
        return self._less(a, self.ablated(i))

    def heads(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        return self._less(z, self.ablated_z(layer))

    def _less(self, a: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        d = a - value.to(device=a.device, dtype=a.dtype)
        if self.opening:
            d[:, 0] = 0
        return d


PROJ_BYTES = 256 << 20  # the heads' projections of the ablated stream a batch may keep (else made again per run)


def block_hooks(owner: Any, n_layer: int, kinds: tuple[str, ...]) -> list[tuple[str, object]]:
    """``owner``'s methods named ``kinds`` on every block's hook point of that kind (``q``, ``k``, ``v`` and ``z``
    the attention's), and its ``resid_post`` on the last block's output."""
    out: list[tuple[str, object]] = []
    for i in range(n_layer):
        out += [(f"blocks.{i}.{'attn.' if len(k) == 1 else ''}hook_{k}", getattr(owner, k)) for k in kinds]
    return out + [(f"blocks.{n_layer - 1}.hook_resid_post", owner.resid_post)]


@dataclass
class Bases:
    """The residual stream with every edge ablated (the module docstring's ``base_v``), at the three places
    receivers read it: each block's input ``pre`` and its middle ``mid`` (the MLP's), and the last block's output
    ``post`` (the logits'), each ``[batch, pos, d_model]``; ``proj`` per block the heads' ``q``, ``k`` and ``v`` made
    from ``pre`` ``[batch, pos, n, d_head]`` (empty where not kept: the model's structure not read, or over
    :data:`PROJ_BYTES`); ``metric`` the run's own (no edge ablated) ``[batch]``, where the pass that made them ran
    it (:func:`ablated_bases`; not :func:`corrupt_stream`); ``spare`` the diffs' buffer the runs on these bases pass
    on to the next (a fresh one each run is a page fault per 4 kB written); ``outputs(i)`` the embedding's or an MLP's
    output (writer ``i``) on this stream where known (a counterfactual's: the corrupt run's; no mean's or zero's)."""

    pre: list[torch.Tensor]
    mid: list[torch.Tensor]
    post: torch.Tensor
    proj: list[dict[str, torch.Tensor]]
    metric: torch.Tensor | None
    spare: torch.Tensor | None = None
    outputs: Callable[[int], torch.Tensor] | None = None


class _BaseHooks:
    """The hooks of the pass that makes :class:`Bases`: the run, each place's residual less every writer's diff
    so far (``away``)."""

    def __init__(self, lm: AttentionLM, away: Away, norms: list[torch.nn.Module] | None):
        self.lm, self.away, self.norms = lm, away, norms
        self.written = 0
        self.total: torch.Tensor | None = None  # the sum of every diff so far
        self.x0: torch.Tensor | None = None
        self.pre: list[torch.Tensor] = []
        self.mid: list[torch.Tensor] = []
        self.post: torch.Tensor | None = None
        self.proj: list[dict[str, torch.Tensor]] = []

    def _add(self, d: torch.Tensor, writers: int = 1) -> None:
        """``d``: the next ``writers``' diffs, summed."""
        self.total = d.clone() if self.total is None else self.total.add_(d)
        self.written += writers

    def _less(self, x: torch.Tensor) -> torch.Tensor:
        assert self.total is not None
        return x - self.total.to(x.dtype)

    def resid_pre(self, x: torch.Tensor, hook: Hook) -> None:
        if hook.layer == 0:
            self._add(self.away(0, x))
        self.x0 = x
        self.pre.append(self._less(x))
        if self.norms is not None:
            normed = self.norms[hook.layer](self.pre[-1])
            made = {}
            for part in "qkv":
                w, bias = self.lm.projection_weights(hook.layer, part)  # [n, d_model, d_head], [n, d_head]
                y = torch.einsum("bpm,nmd->bpnd", normed, w.to(normed.dtype))
                made[part] = y if bias is None else y + bias.to(y.dtype)
            self.proj.append(made)

    def z(self, z: torch.Tensor, hook: Hook) -> None:
        w_o = self.lm.head_output_weights(hook.layer).to(z.dtype)
        self._add(torch.einsum("bphd,hdm->bpm", self.away.heads(hook.layer, z), w_o), z.shape[2])

    def attn_out(self, x: torch.Tensor, hook: Hook) -> None:
        assert self.x0 is not None
        self.mid.append(self._less(self.x0 + x))

    def mlp_out(self, x: torch.Tensor, hook: Hook) -> None:
        self._add(self.away(self.written, x))

    def resid_post(self, x: torch.Tensor, hook: Hook) -> None:
        self.post = self._less(x)

    def hooks(self) -> list[tuple[str, object]]:
        return block_hooks(self, self.lm.n_layer, ("resid_pre", "z", "attn_out", "mlp_out"))


def _proj_bytes(lm: AttentionLM, ids: torch.Tensor) -> int:
    """The bytes of :attr:`Bases.proj` on ``ids``: every block's query, key and value heads at every position."""
    g = graph_of(lm)
    d_head = lm.head_output_weights(0).shape[1]
    return lm.n_layer * ids.numel() * (g.n_head + 2 * g.n_kv) * d_head * torch.finfo(lm.dtype).bits // 8


@torch.no_grad()
def ablated_bases(lm: AttentionLM, ids: torch.Tensor, metric: Metric, away: Away) -> Bases:
    """:class:`Bases` of a batch ``ids``: one run of the model with nothing ablated, each place's residual stream
    less the sum of every writer's ``away`` before it (a bias, the same in either run, stays in)."""
    norms = norms_of(lm)
    keep = norms is not None and _proj_bytes(lm, ids) <= PROJ_BYTES
    hooks = _BaseHooks(lm, away, norms[0] if keep and norms is not None else None)
    with lm.hooks(hooks.hooks()):  # type: ignore[arg-type]
        logits = logits_of(lm, ids, metric)
    assert hooks.post is not None
    return Bases(hooks.pre, hooks.mid, hooks.post, hooks.proj, metric(logits).double())


@torch.no_grad()
def corrupt_stream(lm: AttentionLM, ids: torch.Tensor, metric: Metric) -> tuple[torch.Tensor, Away, Bases]:
    """A counterfactual's corrupt run on ``ids``: its metric ``[batch]``, each writer's output less its output on
    it (:class:`Away`, from the run's hook tensors: the embedding, every block's heads' ``z`` and MLP's output),
    and :class:`Bases` taken from it. With every edge ablated each receiver reads the run's stream less every
    writer's run-minus-corrupt output before it, which is the corrupt run's own stream (the stream is the writers'
    sum, biases alike in both), so the bases are that run's hook tensors: its block inputs, middles, last output and
    heads' projections (where :func:`ablated_bases` would keep them), with no pass of their own; their
    :attr:`~Bases.metric`, the clean run's, is left to whoever needs it."""
    keep = norms_of(lm) is not None and _proj_bytes(lm, ids) <= PROJ_BYTES
    value, seen = run_pass(lm, ids, metric, grad=False, kinds=(*WRITTEN, "attn", "post", *(KINDS if keep else ())))
    pre = [seen["pre"][i] for i in range(lm.n_layer)]
    mid = [x + seen["attn"][i] for i, x in enumerate(pre)]
    proj = [{k: seen[k][i] for k in KINDS} for i in range(lm.n_layer)] if keep else []
    away = Away(lm.n_head + 1, seen["pre"][0], seen["mlp"].__getitem__, seen["z"].__getitem__)
    return value, away, Bases(pre, mid, seen["post"][0], proj, None, outputs=away.ablated)


COPIES: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose structure the one-copy pass misread


def norms_of(lm: AttentionLM) -> tuple[list[torch.nn.Module], list[torch.nn.Module]] | None:
    """Every block's attention norm and MLP norm (:data:`~storylens.circuits.edges.MLP_NORMS`), where the
    projections' weights can be read; None where not."""
    blocks = lm.blocks()
    if blocks is None or len(blocks) != lm.n_layer or lm.module in COPIES:
        return None
    attn = [lm.attention_norm(layer) for layer in range(lm.n_layer)]
    mlp = [
        next((getattr(b, n) for n in MLP_NORMS if isinstance(getattr(b, n, None), torch.nn.Module)), None)
        for b in blocks
    ]
    try:
        lm.projection_weights(0, "q")
    except StorylensError:
        return None
    if any(n is None for n in attn) or any(n is None for n in mlp):
        return None
    return attn, mlp  # type: ignore[return-value]


def mark_misread(lm: AttentionLM) -> None:
    """The one-copy pass misread ``lm``'s structure: its edge-patched passes carry copies from now on."""
    COPIES.add(lm.module)
