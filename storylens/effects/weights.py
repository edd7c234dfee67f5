"""What a head's weights say, with no forward pass: the OV circuit's copying score and the QK circuit's
token and position preferences, per head (columns of the head table), read from any model's weights.

Every figure is computed in float64 from :class:`HeadWeights`, TransformerLens's ``W_Q``, ``W_K``, ``W_V``,
``W_O``, ``W_E``, ``W_U`` (and ``W_pos`` where positions are learned), with the normalisations folded in as
TransformerLens's ``fold_ln`` folds them: a head reads ``norm(x) @ W``, and ``norm(x) = g * P x / s(x) + b``
(``P`` removes the mean for a LayerNorm and is the identity for an RMSNorm, ``g`` the gain, ``s(x) > 0`` a
scale of the position's own), so its reading weights are ``P diag(g) W`` up to that positive scale, which no
score here depends on; the unembedding reads through the final norm the same way. ``fold=False`` keeps the
weights as the model stores them (how TransformerLens's unprocessed ``TransformerBridge`` sees them).

``ov_copying``
    The copying score of Elhage et al. (2021), as TransformerLens's users compute it: the eigenvalues
    ``l`` of the full OV circuit ``W_E W_V^h W_O^h W_U`` (``[vocab, vocab]``, never formed: its nonzero
    eigenvalues are those of ``W_O^h W_U W_E W_V^h``, ``[head_size, head_size]``), scored
    ``Re(sum l) / sum |l|``: 1 for a head whose every eigenvalue is positive (it raises the logit of the
    token it reads: copying), -1 for one that suppresses it.
``qk_same_token``
    How much the full QK circuit ``W_E W_Q^h (W_E W_K^g)^T`` (the tokens alone, at the same position: a rotary
    rotation cancels there) prefers a token attending to its own kind: its diagonal's mean less the mean of
    every entry, in standard deviations of the entries; through factors (``[vocab, head_size]`` each).
``qk_previous``
    The positions alone (learned absolute positions ``W_pos``; None for rotary models, whose positions act on
    the content): the share of queries ``1 .. window - 1`` whose highest score in the positional QK circuit
    ``W_pos W_Q^h (W_pos W_K^g)^T``, over the keys they see, is on the previous position. A share of argmaxes,
    not of softmax weights: the norm's scale, left out of the folded weights, would set a softmax's sharpness.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from storylens.engine.readout import norm_kind, readout
from storylens.lm import AttentionLM

F64 = torch.float64


@dataclass(frozen=True)
class HeadWeights:
    """Every block's attention weights, float64 on the CPU (TransformerLens's names and shapes; key/value heads
    grouped as the model groups them: query head ``h`` reads key/value head ``h // group``)."""

    W_Q: torch.Tensor  # [layer, head, d_model, head_size]: the readers, the norm folded in
    W_K: torch.Tensor  # [layer, kv_head, d_model, head_size]
    W_V: torch.Tensor  # [layer, kv_head, d_model, head_size]
    W_O: torch.Tensor  # [layer, head, head_size, d_model]
    W_E: torch.Tensor  # [vocab, d_model]: the token embedding
    W_U: torch.Tensor  # [d_model, vocab]: the unembedding, the final norm folded in
    W_pos: torch.Tensor | None  # [window, d_model]: learned absolute positions (None: rotary or none)
    group: int  # query heads per key/value head
    gram: torch.Tensor  # [d_model, d_model]: W_E^T W_E, the vocabulary's only product here (made once)
    unembed_embed: torch.Tensor  # [d_model, d_model]: W_U W_E (from the Gram matrix where the two are tied)

    @property
    def shape(self) -> tuple[int, int]:
        return self.W_Q.shape[0], self.W_Q.shape[1]

    def kv(self, W: torch.Tensor) -> torch.Tensor:
        """``W_K`` or ``W_V`` as one entry per query head (``[layer, head, ...]``: a group's heads share one)."""
        return W.repeat_interleave(self.group, dim=1)


def _folding(norm) -> tuple[str, torch.Tensor] | None:
    """A normalisation's kind and gain ``[d_model]`` (float64), what ``P diag(g)`` is made of (the module
    docstring); None: not known."""
    known = None if norm is None else norm_kind(norm)
    if known is None:
        return None
    kind, gain, _ = known
    return kind, gain.detach().to("cpu", F64)


def _fold(folding: tuple[str, torch.Tensor] | None, W: torch.Tensor) -> torch.Tensor:
    """``P diag(g) W`` for ``W [..., d_model, k]`` (``W`` itself where ``folding`` is None): the gain scales
    the rows and, for a LayerNorm, each column's mean over them is taken away (``P = I - 1 1^T / d``). No
    ``[d_model, d_model]`` product: the unembedding's fold would be one of ``d_model^2 vocab``."""
    if folding is None:
        return W
    kind, g = folding
    W = g[:, None] * W
    return W - W.mean(-2, keepdim=True) if kind == "layer" else W


def _left(A: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``A @ W[...]`` for one ``A [m, d]`` and every ``W [..., d, k]``, as one product (no copy of ``A`` per
    matrix, as a broadcast product would make)."""
    return (W.transpose(-1, -2) @ A.T).transpose(-1, -2)


def head_weights(lm: AttentionLM, *, fold: bool = True) -> HeadWeights:
    """``lm``'s :class:`HeadWeights` (``fold``: the normalisations folded into the weights that read through
    them; a norm of a kind not known, e.g. Gemma's, is left out and the weights read as stored)."""
    Q, K, V, out = [], [], [], []
    for layer in range(lm.n_layer):
        fold_in = _folding(lm.attention_norm(layer)) if fold else None
        parts = []
        for part in "qkv":
            w = lm.projection_weights(layer, part)[0].detach().to("cpu", F64)  # [n, d, head_size]
            parts.append(_fold(fold_in, w))
        Q.append(parts[0])
        K.append(parts[1])
        V.append(parts[2])
        out.append(lm.head_output_weights(layer).detach().to("cpu", F64))
    read = readout(lm)
    if read is None:
        raise ValueError(f"{lm.name}: its final norm and unembedding cannot be told apart")
    final = _folding(read.norm) if fold else None
    embedding = lm.token_embedding()
    W_E = embedding.detach().to("cpu", F64)
    W_U = read.unembed.detach().to("cpu", F64).T  # [d_model, vocab]
    W_U = _fold(final, W_U)
    gram = W_E.T @ W_E
    tied = read.unembed.shape == embedding.shape and read.unembed.data_ptr() == embedding.data_ptr()
    if tied:  # W_U W_E = F W_E^T W_E
        unembed_embed = _fold(final, gram)
    else:
        unembed_embed = W_U @ W_E
    pos = lm.position_embedding()
    W_K = torch.stack(K)
    return HeadWeights(
        W_Q=torch.stack(Q),
        W_K=W_K,
        W_V=torch.stack(V),
        W_O=torch.stack(out),
        W_E=W_E,
        W_U=W_U,
        W_pos=None if pos is None else pos.detach().to("cpu", F64),
        group=lm.n_head // W_K.shape[1],
        gram=gram,
        unembed_embed=unembed_embed,
    )


def _by_group(w: HeadWeights, per_query: torch.Tensor) -> torch.Tensor:
    """``[layer, head, ...]`` as ``[layer, kv_head, group, ...]``: query head ``h`` is member ``h % group`` of
    key/value head ``h // group``'s group, so a key/value head's matrix broadcasts over its own query heads."""
    L, H = per_query.shape[:2]
    return per_query.view(L, H // w.group, w.group, *per_query.shape[2:])


def ov_copying(w: HeadWeights) -> torch.Tensor:
    """``[layer, head]``: each head's OV copying score (the module docstring)."""
    read = _left(w.unembed_embed, w.W_V)[:, :, None]  # [L, KV, 1, d, dh]: W_U W_E W_V, once per key/value head
    # [L, H, dh, dh]: W_O W_U W_E W_V, with the full circuit's nonzero eigenvalues
    small = (_by_group(w, w.W_O) @ read).flatten(1, 2)
    eig = eigvals_split(small.flatten(0, 1)).view(small.shape[:-1])
    return eig.sum(-1).real / eig.abs().sum(-1)


def eigvals_split(matrices: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.eigvals`` of ``[n, d, d]``, the batch split over torch's threads: LAPACK takes one
    matrix at a time on one thread (a 30 x 9-head model's 270 matrices of 64 x 64: a tenth of a second), and
    each matrix's eigenvalues are its own whatever the split, so the same bits."""
    parts = min(torch.get_num_threads(), matrices.shape[0])
    if parts < 2:
        return torch.linalg.eigvals(matrices)
    with ThreadPoolExecutor(parts) as pool:
        return torch.cat(list(pool.map(torch.linalg.eigvals, matrices.tensor_split(parts))))


def qk_same_token(w: HeadWeights) -> torch.Tensor:
    """``[layer, head]``: each head's same-token preference (the module docstring), in standard deviations.
    With ``A = W_E W_Q`` and ``B = W_E W_K`` (``[vocab, dh]``, never formed) and ``G = W_E^T W_E``: the diagonal's
    sum is ``tr(W_Q^T G W_K)``, every entry's ``(1^T A)(B^T 1)``, their squares' ``<A^T A, B^T B>``. Each
    ``G W`` is made once per matrix: the keys' once per key/value head, shared by its group."""
    n = w.W_E.shape[0]
    s = w.W_E.sum(0)  # [d]
    Q = _by_group(w, w.W_Q)  # [L, KV, group, d, dh]
    K = w.W_K[:, :, None]  # [L, KV, 1, d, dh]
    GQ, GK = _left(w.gram, Q), _left(w.gram, K)
    diagonal = (GQ * K).sum((-1, -2)) / n  # tr(W_Q^T G W_K), G symmetric
    every = ((s @ Q) * (s @ K)).sum(-1) / n**2
    square = ((Q.transpose(-1, -2) @ GQ) * (K.transpose(-1, -2) @ GK)).sum((-1, -2)) / n**2
    spread = (square - every**2).clamp(min=0).sqrt()
    return torch.where(spread > 0, (diagonal - every) / spread, torch.nan).flatten(1, 2)


PREVIOUS_ROWS = 128  # queries a band of the positional QK circuit takes at once (:func:`qk_previous`)


def qk_previous(w: HeadWeights) -> torch.Tensor | None:
    """``[layer, head]``: the positional QK circuit's attention on the previous position (the module
    docstring); None where positions are not learned. Queries are taken :data:`PREVIOUS_ROWS` at a time, each
    band against the keys its last query sees (the keys after it, hidden from the whole band, are never made)."""
    if w.W_pos is None:
        return None
    T = w.W_pos.shape[0]
    queries = _by_group(w, _left(w.W_pos, w.W_Q))  # [L, KV, group, T, dh]
    keys = _left(w.W_pos, w.W_K)[:, :, None]  # [L, KV, 1, T, dh]
    hits = torch.zeros(queries.shape[:3], dtype=F64)  # [L, KV, group]
    for a in range(1, T, PREVIOUS_ROWS):  # query q's previous position is q - 1 (query 0 has none)
        b = min(T, a + PREVIOUS_ROWS)
        rows = torch.arange(b - a)
        scores = queries[..., a:b, :] @ keys[..., :b, :].transpose(-1, -2)  # [L, KV, group, b - a, b]: query a + i
        previous, own = scores[..., rows, a - 1 + rows], scores[..., rows, a + rows]
        # the argmax (ties: the earliest key) is q - 1 where q - 1 scores above every earlier key and no lower
        # than q itself (the keys after q are hidden): a maximum taken, not an argmax (several times slower)
        earlier = scores.masked_fill_(torch.arange(b)[None, :] >= torch.arange(a - 1, b - 1)[:, None], float("-inf"))
        hits += ((previous > earlier.amax(-1)) & (previous >= own)).sum(-1)
    return (hits / (T - 1)).flatten(1, 2)


def weight_columns(w: HeadWeights) -> dict[str, torch.Tensor | None]:
    """The head table's weight columns (``[layer, head]`` float64; None: not defined for the model)."""
    return {"ov_copying": ov_copying(w), "qk_same_token": qk_same_token(w), "qk_previous": qk_previous(w)}
