"""Why a head looks where it looks: its attention score split exactly into (query-side writer, key-side writer)
terms (query-key attribution), over stories, with standard errors.

Head ``h`` of block ``l`` scores key ``k`` from query ``q`` with ``s(q, k) = c (R_q q_q) . (R_k k_k)``: ``q_t`` and
``k_t`` the head's query and key at position ``t`` (its key/value group's key for a grouped model), ``R_t`` the
rotary rotation where the model has one, ``c`` the model's scale. Both are projections of the block's normalised
input ``norm(x_t)``, and the residual stream ``x_t`` is a sum of what every earlier part wrote there:

* ``tok`` and ``pos``: the token and (learned) position embeddings (``embed`` where they are not told apart);
* ``L{j}H{i}``: each head ``i`` of each earlier block ``j``, its output ``z_i W_O^i`` at ``t``;
* ``L{j}MLP``: each earlier block's MLP output;
* ``biases``: every earlier attention output bias.

The normalisation is frozen at its value in the run, as attribution graphs freeze it: ``norm(x) = g * P x / s +
b`` with the position's own scale ``s`` (``P`` removes the mean for a LayerNorm, nothing for an RMSNorm), so each
writer ``w`` enters as ``g * P w / s``, and ``b`` with the projection's own bias is one more term, ``bias``, on
either side. Each writer's projection is rotated by ``R_t`` as the model rotates the whole. So

    s(q, k) = sum over writers i (query side) and j (key side) of  c (R_q Q_i(q)) . (R_k K_j(k))

exactly, the terms a ``(writers + 1) x (writers + 1)`` matrix. Every run checks it: the writers add up to the
block's input, and the scores rebuilt from the terms, through the model's softmax, give the model's own attention
row for row (within bounds from the dtype's rounding, stated in ``why.json``); a model whose scores cannot be
rebuilt so (an attention this does not know) is refused in one line.

**What makes a key win.** For a set of (query, key) pairs a detector names (``name``: queries after the first
mention and the name tokens before them; ``prev``: key ``q - 1``; ``first``: key 0; ``induction``: the token after
an earlier copy of the query's token), each story gives the mean of every term over its pairs less the mean of the
same term over every key its pairs' queries see: a matrix whose sum is the story's mean logit contrast (how much
higher the chosen keys score than the average key). Over stories: its mean and standard error, term by term.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from storylens.core.errors import StorylensError, UsageError
from storylens.core.figures import csv_cell
from storylens.core.heads import Head, head_label
from storylens.core.schema import check_schema, schema, versioned
from storylens.engine.encode import EncodedStory, batch_of
from storylens.engine.masks import Masks
from storylens.engine.readout import norm_kind
from storylens.lm import AttentionLM, NativeLM
from storylens.viz.why import why_html

F64 = torch.float64
POSITIONS = ("name", "prev", "first", "induction", "custom")  # custom: the pairs a file names (read_pairs_at)


@dataclass(frozen=True)
class Writers:
    """What every earlier part wrote into the residual stream of one story: ``vectors [writers, T, d_model]``."""

    names: tuple[str, ...]
    vectors: torch.Tensor


def _capture(lm: AttentionLM, ids: torch.Tensor, layer: int) -> dict:
    """One forward of ``ids [1, T]`` that keeps what the writers and the reader are made of."""
    got: dict = {"z": {}, "mlp": {}, "attn": {}, "resid": {}, "pattern": {}}

    def keep(kind: str):
        def fn(t: torch.Tensor, hook) -> None:
            got[kind][hook.layer] = t.detach()[0]

        return fn

    hooks = [(f"blocks.{j}.hook_resid_pre", keep("resid")) for j in sorted({0, layer})]
    for j in range(layer):
        hooks += [
            (f"blocks.{j}.attn.hook_z", keep("z")),
            (f"blocks.{j}.hook_attn_out", keep("attn")),
            (f"blocks.{j}.hook_mlp_out", keep("mlp")),
        ]
    hooks.append((f"blocks.{layer}.attn.hook_pattern", keep("pattern")))
    norm = lm.attention_norm(layer)
    handles = []
    if norm is not None:
        handles.append(norm.register_forward_hook(lambda m, a, out: got.__setitem__("normed", out.detach()[0])))
    attn = _attention_module(lm, layer)
    if attn is not None:  # rotary models hand the attention its (cos, sin)
        handles.append(
            attn.register_forward_pre_hook(
                lambda m, a, k: got.__setitem__("rotary", k.get("position_embeddings")), with_kwargs=True
            )
        )
    try:
        with torch.no_grad(), lm.hooks(hooks):
            lm.forward(ids, record_attention=True, logits=False)
    finally:
        for h in handles:
            h.remove()
    return got


def _attention_module(lm: AttentionLM, layer: int):
    attn = getattr(lm, "_attn", None)
    return None if attn is None else attn[layer]


def writers(lm: AttentionLM, ids: torch.Tensor, layer: int, got: dict) -> Writers:
    """The writers of block ``layer``'s input for one story (see the module docstring), float64."""
    T = ids.shape[1]
    resid0 = got["resid"][0].to(F64)
    tok = lm.token_embedding().detach()[ids[0]].to(F64)
    pos_table = lm.position_embedding()
    names: list[str] = []
    vecs: list[torch.Tensor] = []
    pos = None if pos_table is None else pos_table.detach()[:T].to(F64)
    eps = torch.finfo(lm.dtype).eps
    if _adds_up(
        torch.stack([tok, tok if pos is None else pos])
        * torch.tensor([1.0, 0.0 if pos is None else 1.0], dtype=F64)[:, None, None],
        resid0,
        eps,
    ):
        names.append("tok")
        vecs.append(tok)
        if pos is not None:
            names.append("pos")
            vecs.append(pos)
    else:  # a scaled or otherwise changed embedding: one writer
        names.append("embed")
        vecs.append(resid0)
    biases = torch.zeros_like(resid0)
    for j in range(layer):
        W_O = lm.head_output_weights(j).detach().to(F64)  # [H, dh, d]
        heads = torch.einsum("thk,hkd->htd", got["z"][j].to(F64), W_O)  # [H, T, d]
        for i in range(heads.shape[0]):
            names.append(head_label(j, i))
            vecs.append(heads[i])
        biases = biases + got["attn"][j].to(F64) - heads.sum(0)
        names.append(f"L{j + 1}MLP")
        vecs.append(got["mlp"][j].to(F64))
    if layer:
        names.append("biases")
        vecs.append(biases)
    return Writers(tuple(names), torch.stack(vecs))


def _adds_up(parts: torch.Tensor, total: torch.Tensor, eps: float) -> bool:
    """Whether ``parts [n, T, d]`` add up to ``total [T, d]`` as the model's rounding allows: each of its entries
    went through at most ``n`` additions and products of length ``d`` (an output projection), so it is off by at
    most ``(n + d) eps`` of the sum of the parts' sizes; a margin of 8."""
    n, d = parts.shape[0], parts.shape[-1]
    return bool(((parts.sum(0) - total).abs() <= 8 * (n + d) * eps * parts.abs().sum(0) + 1e-300).all())


@dataclass(frozen=True)
class Reader:
    """The head's query and key side of every writer: ``[writers + 1, T, head_size]`` each (the last the bias term),
    rotated as the model rotates them; ``scale`` the model's, found by reproducing its attention."""

    query: torch.Tensor
    key: torch.Tensor
    scale: float
    gap: float  # the largest difference of the rebuilt attention from the model's
    bound: float  # what rounding allows it (see _scale)
    seen: torch.Tensor  # [T, T] bool: the keys each query sees (seen_keys)


def reader(lm: AttentionLM, head: Head, w: Writers, got: dict) -> Reader:
    """Head ``head``'s query and key sides of every writer (the normalisation frozen: the module docstring)."""
    layer = head.layer
    x = w.vectors.sum(0)  # [T, d]: the block's input, rebuilt
    eps = torch.finfo(lm.dtype).eps
    if not _adds_up(w.vectors, got["resid"][layer].to(F64), eps):
        raise StorylensError(
            f"why: the writers of block {layer + 1}'s input do not add up to it (a block structure storylens does not know)"
        )
    norm = lm.attention_norm(layer)
    known = None if norm is None else norm_kind(norm)
    if known is None:
        raise StorylensError(
            f"why: block {layer + 1}'s attention reads through a normalisation storylens does not know"
        )
    kind, gain, eps = known
    g = gain.detach().to(F64)
    if kind == "layer":
        centred = w.vectors - w.vectors.mean(-1, keepdim=True)
        size = ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1).add(eps).sqrt()  # [T]: the position's own scale
    else:
        centred = w.vectors
        size = (x**2).mean(-1).add(eps).sqrt()
    normed = g * centred / size[None, :, None]  # [W, T, d]
    beta = getattr(norm, "bias", None)
    bias = torch.zeros_like(x) if beta is None else beta.detach().to(F64).expand_as(x)
    if "normed" in got and not _adds_up(torch.cat([normed, bias[None]]), got["normed"].to(F64), eps):
        raise StorylensError(f"why: block {layer + 1}'s normalisation is not the one storylens froze")
    sides = []
    for part, index in (("q", head.head), ("k", head.head // (lm.n_head // lm.n_kv_head))):
        W, b = lm.projection_weights(layer, part)
        Wh = W[index].detach().to(F64)  # [d, dh]
        own = bias @ Wh + (0 if b is None else b[index].detach().to(F64))  # [T, dh]
        side = torch.cat([normed @ Wh, own[None]])  # [W + 1, T, dh]
        sides.append(_rotated(side, got.get("rotary")))
    scale, gap, bound = _scale(lm, head, sides[0], sides[1], got["pattern"][layer])
    return Reader(sides[0], sides[1], scale, gap, bound, seen_keys(got["pattern"][layer][head.head]))


def seen_keys(pattern: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` bool: the keys each query sees, read off the head's own attention (``[T, T]``): the earlier ones
    it gives any weight (a sliding window's, GPT-Neo's local blocks', are left out where the model masks them)."""
    T = pattern.shape[-1]
    return torch.ones(T, T, dtype=torch.bool).tril() & (pattern > 0)


def _rotated(side: torch.Tensor, rotary) -> torch.Tensor:
    """Each writer's projection rotated at its position as the model rotates the whole (Llama's ``rotate_half``
    form over the first ``rotary`` dimensions); unchanged for a model without rotary positions."""
    if rotary is None:
        return side
    cos, sin = (t.detach().to(F64)[0] for t in rotary)  # [T, r]
    r = cos.shape[-1]
    head, tail = side[..., :r], side[..., r:]
    half = torch.cat([-head[..., r // 2 :], head[..., : r // 2]], -1)
    return torch.cat([head * cos + half * sin, tail], -1)


def _scale(
    lm: AttentionLM, head: Head, q: torch.Tensor, k: torch.Tensor, pattern: torch.Tensor
) -> tuple[float, float, float]:
    """The scale that makes the rebuilt scores give the head's own attention row for row (``pattern [H, T, T]``,
    the model's dtype): the model's ``scaling``, ``1 / sqrt(head_size)`` or 1 (GPT-Neo), whichever comes within
    the bound; with the largest gap and the bound. The model's scores are its float rounding of these: each a dot
    product of ``head_size`` terms of projections of length ``d_model`` of a sum of the writers, off by at most
    ``(d_model + head_size + writers) eps |q| |k|`` (``eps`` the dtype's; float32's at least for a transformers
    model, whose attention takes its softmax in float32, and GPT-Neo's its scores too), and a softmax moves a probability by
    at most twice its largest score's move; a margin of 8 over that. Refused where no scale comes within it."""
    qs, ks = q.sum(0), k.sum(0)  # [T, dh]
    raw = qs @ ks.T  # [T, T]
    future = ~seen_keys(pattern[head.head])
    eps = torch.finfo(pattern.dtype).eps
    if not isinstance(lm, NativeLM):  # transformers' attention takes its softmax in float32 whatever the weights'
        eps = max(eps, torch.finfo(torch.float32).eps)  # dtype (storylens's for them matches it; GPT-Neo's scores too)
    size = qs.norm(dim=-1)[:, None] * ks.norm(dim=-1)[None, :]
    terms = q.shape[-1] + lm.head_output_weights(head.layer).shape[-1] + q.shape[0]
    attn = _attention_module(lm, head.layer)
    best: tuple[float, float, float] | None = None
    for c in (getattr(attn, "scaling", None), 1 / math.sqrt(q.shape[-1]), 1.0):
        if not isinstance(c, (int, float)) or isinstance(c, bool):
            continue
        rebuilt = (raw * c).masked_fill(future, -math.inf).softmax(-1)
        gap = float((rebuilt - pattern[head.head].to(F64)).abs().max())
        bound = 16 * terms * eps * float(c) * float(size.max())
        if gap <= bound and (best is None or gap < best[1]):
            best = (float(c), gap, bound)
    if best is None:
        raise StorylensError(
            f"why: the rebuilt scores do not give {head.label}'s attention (an attention storylens does not know)"
        )
    return best


def chosen_pairs(story: EncodedStory, lm: AttentionLM, positions: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (query, key) pairs ``positions`` names in one story: ``[P]`` queries and ``[P]`` keys, queries >= 1."""
    if positions not in POSITIONS or positions == "custom":
        raise StorylensError(f"why: --positions {positions!r}: one of {', '.join(POSITIONS[:-1])} (custom: a file)")
    batch = batch_of([story], lm.marker_id, "cpu")
    T = batch.ids.shape[1]
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    if positions == "name":
        masks = Masks(batch, F64)
        chosen = masks.name_queries[0][:, None] & batch.name_mask[0][None, :] & (k < q)
    elif positions == "prev":
        chosen = (k == q - 1) & (q >= 1)
    elif positions == "first":
        chosen = (k == 0) & (q >= 1)
    else:
        chosen = Masks(batch, F64).induction_keys[0] & (q >= 1)
    at = chosen.nonzero()
    return at[:, 0], at[:, 1]


def _custom(pairs: list[tuple[int, int]], length: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One story's custom pairs as :func:`chosen_pairs` gives its own, checked against the story's length."""
    for q, _ in pairs:
        if q >= length:
            raise StorylensError(f"why: story {index + 1} has {length} tokens (the marker first); no query {q}")
    got = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
    return got[:, 0], got[:, 1]


def read_pairs_at(path: Path) -> dict[int, list[tuple[int, int]]]:
    """``--at FILE``: one JSON object a line, ``{"story": N, "query": Q, "key": K}``: the quiz story ``N``
    (counting from 1, as the report numbers them), token positions counting from 0 at the opening marker, ``1 <=
    Q``, ``0 <= K <= Q`` (a head sees no later key). Returns the pairs by the story's index from 0; a bad line
    refused naming it."""
    out: dict[int, list[tuple[int, int]]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot be read as text ({type(e).__name__})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            story, q, k = (row[key] for key in ("story", "query", "key"))
        except (json.JSONDecodeError, TypeError, KeyError):
            raise UsageError(f'{path}:{n}: not a {{"story": N, "query": Q, "key": K}} object') from None
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (story, q, k)):
            raise UsageError(f"{path}:{n}: story, query and key must be whole numbers")
        if story < 1 or q < 1 or not 0 <= k <= q:
            raise UsageError(f"{path}:{n}: needs story >= 1, query >= 1 and 0 <= key <= query (got {story}, {q}, {k})")
        out.setdefault(story - 1, []).append((q, k))
    if not out:
        raise UsageError(f"{path}: no pairs")
    return out


def contrast(r: Reader, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[W + 1, W + 1]``: each term's mean over the pairs less its mean over every key their queries see."""
    P = queries.shape[0]
    Q = r.query[:, queries]  # [W, P, dh]
    chosen = torch.einsum("wpd,vpd->wv", Q, r.key[:, keys]) / P
    seen = r.seen[queries].to(F64)  # [P, T]
    average = torch.einsum("pt,wtd->wpd", seen / seen.sum(-1, keepdim=True), r.key)  # [W, P, dh]: each query's keys
    every = torch.einsum("wpd,vpd->wv", Q, average) / P
    return r.scale * (chosen - every)


@dataclass(frozen=True)
class WhyResult:
    """One head's query-key attribution over stories (the module docstring): ``mean`` and ``se``
    ``[writers, writers]`` (query side first, the last writer ``bias``), their sum's ``total`` and ``total_se``."""

    head: Head
    positions: str
    writers: tuple[str, ...]
    mean: torch.Tensor
    se: torch.Tensor
    total: float
    total_se: float
    stories: int
    pairs: int
    scale: float
    gap: float  # the largest difference of the rebuilt attention from the model's, over every story
    bound: float  # the smallest bound rounding allowed it (see _scale)

    def top(self, n: int = 10) -> list[tuple[str, str, float, float]]:
        """The ``n`` largest terms by size: (query writer, key writer, mean, standard error)."""
        W = len(self.writers)
        order = self.mean.abs().flatten().argsort(descending=True)[:n]
        return [
            (self.writers[i // W], self.writers[i % W], float(self.mean.flatten()[i]), float(self.se.flatten()[i]))
            for i in order.tolist()
        ]


def explain(
    lm: AttentionLM, head: Head, stories: Sequence[EncodedStory], positions: str = "name", progress=None,
    at: dict[int, list[tuple[int, int]]] | None = None,
) -> WhyResult:  # fmt: skip
    """Head ``head``'s query-key attribution for ``positions`` over ``stories`` (encoded; those without such a
    pair are passed over), one forward each; ``progress``: called with each story done; ``at``: with
    ``positions`` "custom", the (query, key) pairs of each story by its index in ``stories``
    (:func:`read_pairs_at`)."""
    if positions == "custom" and at is None:
        raise StorylensError("why: --positions custom needs the pairs (--at FILE)")
    if not (0 <= head.layer < lm.n_layer and 0 <= head.head < lm.n_head):
        raise StorylensError(f"why: {head.label}: the model has {lm.n_layer} blocks of {lm.n_head} heads")
    sums: tuple[torch.Tensor, ...] | None = None
    names: tuple[str, ...] = ()
    n = pairs = 0
    gap, bound, scale = 0.0, math.inf, math.nan
    for i, story in enumerate(stories):
        if positions == "custom":
            assert at is not None
            queries, keys = _custom(at.get(i, []), len(story.ids), i)
        else:
            queries, keys = chosen_pairs(story, lm, positions)
        if progress is not None:
            progress(story)
        if not len(queries):
            continue
        ids = torch.tensor([story.ids], device=lm.device)
        got = _capture(lm, ids, head.layer)
        w = writers(lm, ids, head.layer, got)
        r = reader(lm, head, w, got)
        inside = r.seen[queries, keys]  # a pair past a sliding window is not one the head can attend
        queries, keys = queries[inside], keys[inside]
        if not len(queries):
            continue
        c = contrast(r, queries, keys)
        names = (*w.names, "bias")
        total = c.sum()
        add = (c, c * c, total, total * total)
        sums = add if sums is None else tuple(a + b for a, b in zip(sums, add))
        n, pairs = n + 1, pairs + len(queries)
        if r.gap / r.bound >= gap / bound:  # the story closest to its bound: its gap and bound
            gap, bound = r.gap, r.bound
        scale = r.scale
    if sums is None:
        raise StorylensError(f"why: no story has a {positions} pair to explain")
    mean, square, total, total2 = (s / n for s in sums)
    spread = math.sqrt(n / (n - 1)) if n > 1 else math.nan
    se = (
        ((square - mean * mean).clamp(min=0).sqrt() * spread / math.sqrt(n))
        if n > 1
        else torch.full_like(mean, math.nan)
    )
    total_se = float((total2 - total * total).clamp(min=0).sqrt()) * spread / math.sqrt(n) if n > 1 else math.nan
    return WhyResult(head, positions, names, mean, se, float(total), total_se, n, pairs, scale, gap, bound)


TOP_TERMS = 10  # the terms why.json and why.html name, largest first


def why_document(result: WhyResult, model: str) -> dict:
    """why.json's document (``storylens/schemas/why.schema.json``): NaN errors as null."""

    def clean(x: float) -> float | None:
        return None if not math.isfinite(x) else x

    total = result.total
    return versioned(
        {
            "model": model,
            "head": result.head.label,
            "layer": result.head.layer,
            "index": result.head.head,
            "positions": result.positions,
            "stories": result.stories,
            "pairs": result.pairs,
            "writers": list(result.writers),
            "mean": result.mean.tolist(),
            "se": [[clean(x) for x in row] for row in result.se.tolist()],
            "total": total,
            "total_se": clean(result.total_se),
            "scale": result.scale,
            "check": {"gap": result.gap, "bound": result.bound},
            "top": [
                {"query": q, "key": k, "mean": m, "se": clean(s), "share": m / total if total else 0.0}
                for q, k, m, s in result.top(TOP_TERMS)
            ],
        }
    )


WHY_CSV = ("query_writer", "key_writer", "mean", "se", "share")


def write_why(result: WhyResult, model: str, folder: Path, explorer: str | None = None) -> dict:
    """why.json, why.csv (one row per term, largest first) and why.html into ``folder``; the document. ``explorer``:
    an explore.html's address from ``folder``, whose head pages the writer heads link to."""
    doc = why_document(result, model)
    check_schema(doc, schema("why"), "why.json")
    (folder / "why.json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    W = len(result.writers)
    with open(folder / "why.csv", "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(WHY_CSV)
        for q, k, m, s in result.top(W * W):
            out.writerow((q, k, f"{m:.6g}", csv_cell(s), f"{m / result.total:.6g}" if result.total else ""))
    title = f"storylens why: {result.head.label} of {model}"
    (folder / "why.html").write_text(why_html(doc, title=title, explorer=explorer), encoding="utf-8")
    return doc
