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
from storylens.engine.readout import norm_kind
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


def _pullback(lm: AttentionLM, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, bool, float] | None:
    """Block ``layer``'s query, key and value projections' weights, every head's slice, ``[q + k + v receivers,
    d_head, d_model]``, with the attention norm's gain folded in (and, for a LayerNorm, centred along the width:
    ``g - mean(g)`` of the pulled-back gradient is then made by the product), whether the norm centres, its
    ``eps``; None where the norm or the projections are not of a kind read here."""
    norm = lm.attention_norm(layer)
    known = norm_kind(norm) if norm is not None else None
    if known is None:
        return None
    kind, gain, eps = known
    try:
        w = torch.cat([lm.projection_weights(layer, k)[0] for k in KINDS]).detach()  # [r, d_model, d_head]
    except StorylensError:
        return None
    w = (w.to(dtype) * gain.to(dtype)[None, :, None]).transpose(1, 2)  # [r, d_head, d_model]
    centred = kind == "layer"
    return (w - w.mean(-1, keepdim=True) if centred else w).contiguous(), centred, eps


def _projection_grads(
    lm: AttentionLM, seen: dict, layer: int, at: slice = slice(None), out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``[q + k + v receivers, batch, pos, d_model]`` (into ``out`` where given): the query, key and value
    receivers' gradients of block ``layer`` at positions ``at``, each head's projection's gradient pulled back
    through its own slice of the weights and the attention norm as autograd would: with ``u = (x - mean) / s`` (no
    mean for RMSNorm) and ``g`` the gradient through the weights times the gain (centred for a LayerNorm), ``(g - u *
    mean(g * u)) / s`` (one projection's cost for all of them, where :func:`receiver_grads`'s autograd takes one per
    receiver). Worked in float32 at least; ``1 / s`` taken on the projections' gradients, before the product. None
    where the block's norm or projections are not of a kind read here."""
    grads = [seen[kind][layer].grad for kind in KINDS]  # [batch, pos, n, d_head]: the metric's on each projection
    if any(g is None for g in grads):
        return None
    x = seen["pre"][layer][:, at].detach()
    work = torch.promote_types(x.dtype, torch.float32)
    kept = seen.setdefault("pullback", {})  # made once a run, not once a slice of positions
    folded = kept[layer] if layer in kept else kept.setdefault(layer, _pullback(lm, layer, work))
    if folded is None or folded[0].shape[0] != sum(g.shape[2] for g in grads):
        return None
    w, centred, eps = folded  # [r, d_head, d_model]
    b, p, d = x.shape
    x = x.to(work).reshape(b * p, d)
    if centred:
        x = x - x.mean(-1, keepdim=True)
    s = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [batch * pos, 1]
    u = x / s
    gq = torch.cat([g[:, at] for g in grads], 2).to(work).reshape(b * p, -1, w.shape[1]) / s[..., None]
    gq = gq.transpose(0, 1)  # [r, batch * pos, d_head]
    direct = out is not None and out.dtype == work and out.is_contiguous()
    g = torch.bmm(gq, w, out=out.view(len(w), b * p, d)) if direct else torch.bmm(gq, w)  # type: ignore[union-attr]
    g.addcmul_(u, (g * u).sum(-1, keepdim=True), value=-1 / d)  # less u * mean(g * u), all over s
    g = g.view(len(w), b, p, d)
    if out is not None and not direct:
        out.copy_(g)
    return g.to(grads[0].dtype) if out is None else out


def receiver_grads_at(lm: AttentionLM, seen: dict, layer: int, at: slice, out: torch.Tensor) -> bool:
    """:func:`receiver_grads` at positions ``at`` alone, into ``out`` ``[receiver, batch, pos, d_model]``, from
    what the one backward left (the projections' gradients, the MLP's own leaf); False where a receiver would
    need autograd."""
    own = seen["leaves"]["mlp_in"].get(layer)
    if own is None or own.grad is None or "q" not in seen:
        return False
    if _projection_grads(lm, seen, layer, at, out[:-1]) is None:
        return False
    out[-1] = own.grad[:, at]
    return True


def receiver_grads(lm: AttentionLM, seen: dict, layer: int) -> torch.Tensor:
    """``[batch, pos, receiver, d_model]``: block ``layer``'s receivers' gradients ``g_v`` (the module docstring)."""
    leaves = seen["leaves"]
    out = []
    fast = _projection_grads(lm, seen, layer)
    if fast is not None:
        out = list(fast.unbind(0))
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
