"""The receivers' gradients of edge attribution patching (:mod:`storylens.circuits.edges`): ``g_v``, the metric's
gradient with respect to receiver ``v``'s own copy of the residual stream, for every query, key and value head
and every MLP of a block, from the one backward pass: a head's through its own slice of the projection's weights
and the attention norm's Jacobian, an MLP's from a zero leaf added to its own copy of its input (at its norm);
autograd through that receiver alone where the model's structure is not read so."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from storylens.core.errors import StorylensError
from storylens.engine.gradients import norm_kind
from storylens.lm import AttentionLM

KINDS = ("q", "k", "v")  # a head's inputs


MLP_NORMS = ("ln_2", "post_attention_layernorm", "ffn_norm", "ln_mlp")  # where a block's MLP reads its input


@contextlib.contextmanager
def mlp_input_leaves(lm: AttentionLM, layers: range, seen: dict, leaves: dict) -> Iterator[None]:
    """A zero leaf added to the MLP's input of each block of ``layers`` where its normalisation reads it: the MLP's
    own copy of the residual stream, so that the one backward gives the MLP receiver's gradient (``leaves["mlp_in"]``)
    with the rest. Only where that norm is called once a pass, on the residual stream after attention (or on the
    block's input: a parallel block), equal to the last bit; elsewhere none, and :func:`receiver_grads` asks
    autograd."""
    blocks = lm.blocks() or []
    calls: dict[int, int] = {}

    def hook(layer: int) -> Callable:
        def add(module: torch.nn.Module, args: tuple) -> tuple | None:
            calls[layer] = calls.get(layer, 0) + 1
            x, pre, attn = (args[0] if args else None), seen["pre"].get(layer), seen["attn"].get(layer)
            if calls[layer] > 1:  # read more than once: not the MLP's own copy
                leaves["mlp_in"].pop(layer, None)
                return None
            if not isinstance(x, torch.Tensor) or pre is None or attn is None:
                return None
            if not (torch.equal(x, pre + attn) or torch.equal(x, pre)):
                return None
            leaf = torch.zeros_like(x, requires_grad=True)
            leaves["mlp_in"][layer] = leaf
            return (x + leaf, *args[1:])

        return add

    handles = []
    for layer in layers:
        block = blocks[layer] if layer < len(blocks) else None
        norm = next(
            (getattr(block, n) for n in MLP_NORMS if isinstance(getattr(block, n, None), torch.nn.Module)), None
        )
        if norm is not None and norm_kind(norm) is not None:
            handles.append(norm.register_forward_pre_hook(hook(layer)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _norm_vjp(kind: str, gain: torch.Tensor, eps: float, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """``[batch, pos, r, d_model]``: ``r`` vectors ``gy`` pulled back through a normalisation of ``x`` ``[batch, pos,
    d_model]`` (``"layer"``: LayerNorm, ``"rms"``: RMSNorm, gain ``gain``), each as autograd would: with ``u = (x -
    mean) / s`` (no mean for RMSNorm) and ``g = gy * gain``, ``(g - mean(g) - u * mean(g * u)) / s``. Worked in
    float32 at least."""
    work = torch.promote_types(x.dtype, torch.float32)
    x, g = x.to(work), gy.to(work) * gain.to(work)
    if kind == "layer":
        x = x - x.mean(-1, keepdim=True)
        g = g - g.mean(-1, keepdim=True)
    s = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [batch, pos, 1]
    u = (x / s)[:, :, None]  # [batch, pos, 1, d_model]
    return ((g - u * (g * u).mean(-1, keepdim=True)) / s[:, :, None]).to(gy.dtype)


def _projection_grads(lm: AttentionLM, seen: dict, layer: int) -> torch.Tensor | None:
    """``[batch, pos, q + k + v receivers, d_model]``: the query, key and value receivers' gradients of block
    ``layer`` from the projections' weights, each head's slice alone, and the attention norm's Jacobian (one
    projection's cost for all of them, where :func:`receiver_grads`'s autograd takes one per receiver); None
    where the block's norm or projections are not of a kind read here."""
    norm = lm.attention_norm(layer)
    known = norm_kind(norm) if norm is not None else None
    if known is None:
        return None
    try:
        weights = [lm.projection_weights(layer, kind)[0] for kind in KINDS]  # [n, d_model, d_head] each
    except StorylensError:
        return None
    parts = []
    for kind, w in zip(KINDS, weights):
        g = seen[kind][layer].grad  # [batch, pos, n, d_head]: the metric's gradient on that projection
        if g is None or g.shape[2] != w.shape[0]:
            return None
        parts.append(torch.einsum("bpnh,ndh->bpnd", g, w.detach().to(g.dtype)))
    return _norm_vjp(*known, seen["pre"][layer].detach(), torch.cat(parts, 2))


def receiver_grads(lm: AttentionLM, seen: dict, layer: int) -> torch.Tensor:
    """``[batch, pos, receiver, d_model]``: block ``layer``'s receivers' gradients ``g_v`` (the module docstring)."""
    leaves = seen["leaves"]
    out = []
    fast = _projection_grads(lm, seen, layer)
    if fast is not None:
        out = list(fast.unbind(2))
    for kind in KINDS if fast is None else ():
        t = seen[kind][layer]  # [batch, pos, head or kv head, d_head], its .grad the metric's
        for h in range(t.shape[2]):
            g = torch.zeros_like(t)
            g[:, :, h] = t.grad[:, :, h]
            (x,) = torch.autograd.grad(t, leaves["pre"][layer], grad_outputs=g, retain_graph=True)
            out.append(x)
    own = leaves["mlp_in"].get(layer)
    if own is not None and own.grad is not None:  # the MLP's own copy of its input (mlp_input_leaves)
        out.append(own.grad)
        return torch.stack(out, 2)
    mlp = seen["mlp"][layer]
    (x,) = torch.autograd.grad(mlp, leaves["attn"][layer], grad_outputs=mlp.grad, retain_graph=True, allow_unused=True)
    if x is None:  # a parallel block: the MLP reads the block's input
        (x,) = torch.autograd.grad(mlp, leaves["pre"][layer], grad_outputs=mlp.grad, retain_graph=True)
    out.append(x)
    return torch.stack(out, 2)
