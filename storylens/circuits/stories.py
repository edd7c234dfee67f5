"""Edges against the corpus loss: every edge scored, and circuits run exactly, on stories instead of pairs, under
mean or zero ablation (MIB's "mean" and "zero" interventions; EAP-IG's code supports them with its activations
variant, the inputs variant needing a corrupt prompt).

**The metric** of a story is its summed next-token loss over its predicted tokens (what ``score`` sums); figures
are pooled per token, ``sum over stories / sum of tokens``, with the ratio estimator's standard error over
stories, like every column of the head table.

**The ablated run.** A writer ablated carries, at every position after the opening token, its mean output over
the corpus (every real position after the opening token of every story, as ``score --exact mean`` takes the
heads' means) or zero; at the opening token its own output (nothing is ablated there, as in ``score``). The
input's mean is the mean residual entering block 1; a head's is its mean ``hook_z`` through its slice of the
output projection; an MLP's its mean ``hook_mlp_out``.

**Streamed and mergeable.** Each quantity is a sum over stories kept in float64 (:class:`MeanSums`,
:class:`EdgeSums`, :class:`RowSums`), so chunks of stories scored anywhere (one process, a resumed run, Ray
actors) add up, in story order, to the same figures. The stability's bootstrap resamples are Poisson
resamples (each story weighted by a Poisson(1) draw seeded by its index and the seed, Hanley & MacGibbon 2006):
the same weights wherever a story is scored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from storylens.circuits.bases import Away
from storylens.circuits.edge_patch import circuit_metrics
from storylens.circuits.edges import Metric, batch_scores, run_pass
from storylens.core.batching import length_batches, pad_batch, valid_mask
from storylens.core.errors import StorylensError
from storylens.engine.accumulate import pooled_ratio
from storylens.lm import AttentionLM

ABLATIONS = ("mean", "zero")
STORY_METHODS = ("eap", "eap-ig-activations")  # eap-ig-inputs moves the input from a corrupt prompt: none here
BATCH_TOKENS = 2048  # padded tokens per batch of stories at most (a longer story goes alone)


def story_metric(ids: torch.Tensor, valid: torch.Tensor) -> Metric:
    """Each story's summed next-token loss over its predicted tokens ``[batch]`` (float32 or wider), from the logits."""

    def loss(logits: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        ce = F.cross_entropy(logits[:, :-1].to(dtype).transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T - 1]
        return (ce * valid[:, 1:]).sum(-1)

    return loss


def story_batches(lm: AttentionLM, stories: Sequence[Sequence[int]], batch_size: int):
    """``(rows, ids [batch, pos], valid [batch, pos])`` over the stories of two tokens or more, longest first."""
    keep = [i for i, s in enumerate(stories) if len(s) >= 2]
    for idx in length_batches([len(stories[i]) for i in keep], batch_size, BATCH_TOKENS):
        rows = [keep[i] for i in idx]
        ids, lengths = pad_batch([stories[i] for i in rows], lm.marker_id, lm.device)
        yield rows, ids, valid_mask(lengths, ids.shape[1]).to(ids.device)


# ---------------------------------------------------------------- the writers' means


class MeanSums:
    """Streamed float64 sums of what the input, every head (``hook_z``) and every MLP wrote, over every real
    position after the opening token: ``pre [d_model]``, ``z [layer, head, d_head]``, ``mlp [layer, d_model]``."""

    KEYS = ("pre", "z", "mlp", "count")

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None):
        self.t = dict(tensors) if tensors is not None else {}

    def add(self, lm: AttentionLM, ids: torch.Tensor, valid: torch.Tensor) -> None:
        w = valid.clone()
        w[:, 0] = False
        w64 = w.to(torch.float64)
        got: dict[str, Any] = {"z": [None] * lm.n_layer, "mlp": [None] * lm.n_layer}

        def total(x: torch.Tensor) -> torch.Tensor:  # [batch, pos, ...] -> [...]
            return torch.einsum("bp...,bp->...", x.detach().to(torch.float64), w64).cpu()

        def pre(x, hook):
            got["pre"] = total(x)

        def z(x, hook):
            got["z"][hook.layer] = total(x)

        def mlp(x, hook):
            got["mlp"][hook.layer] = total(x)

        hooks = [("blocks.0.hook_resid_pre", pre)]
        hooks += [(f"blocks.{i}.attn.hook_z", z) for i in range(lm.n_layer)]
        hooks += [(f"blocks.{i}.hook_mlp_out", mlp) for i in range(lm.n_layer)]
        with torch.no_grad(), lm.hooks(hooks):
            lm.forward(ids)  # the whole way: without the logits a model may stop before its last MLP
        part: dict[str, torch.Tensor] = {"pre": got["pre"], "z": torch.stack(got["z"]), "mlp": torch.stack(got["mlp"])}
        part["count"] = torch.tensor(float(w.sum()), dtype=torch.float64)
        self.merge(MeanSums(part))

    def merge(self, other: MeanSums) -> MeanSums:
        self.t = dict(other.t) if not self.t else {k: self.t[k] + other.t[k] for k in self.KEYS}
        return self

    def values(self, lm: AttentionLM) -> dict[str, torch.Tensor]:
        """The means in the model's dtype (``count`` the positions they are over)."""
        n = float(self.t["count"]) if self.t else 0.0
        if n == 0:
            raise StorylensError("--ablation mean: no story of two tokens or more to take the writers' means over")
        return {k: (self.t[k] / n).to(lm.dtype) for k in ("pre", "z", "mlp")} | {"count": self.t["count"]}


def zero_values(lm: AttentionLM) -> dict[str, torch.Tensor]:
    """Zero ablation's values, shaped as :meth:`MeanSums.values`."""
    d_head, d_model = lm.head_output_weights(0).shape[1:]
    z = torch.zeros((), dtype=lm.dtype)
    return {
        "pre": z.expand(d_model).clone(),
        "z": z.expand(lm.n_layer, lm.n_head, d_head).clone(),
        "mlp": z.expand(lm.n_layer, d_model).clone(),
        "count": torch.tensor(0.0, dtype=torch.float64),
    }


def _ablator(values: dict[str, torch.Tensor]) -> Callable[[dict], dict]:
    """The ablated run's hook tensors given a run's: each writer's ``values`` after the opening token."""

    def ablate(run: dict) -> dict:
        out: dict[str, dict[int, torch.Tensor]] = {"pre": {}, "z": {}, "mlp": {}}
        for kind in out:
            for layer, x in run[kind].items():
                v = values[kind] if kind == "pre" else values[kind][layer]
                y = x.detach().clone()
                y[:, 1:] = v.to(device=y.device, dtype=y.dtype)
                out[kind][layer] = y
        return out

    return ablate


def _away(lm: AttentionLM, values: dict[str, torch.Tensor], device) -> Away:
    """Each writer's output less its ablated value (its mean in the residual stream, or zero; a head's from its
    mean ``z``), 0 at the opening token."""
    mlp, z = values["mlp"].to(device), values["z"].to(device)  # [layer, d_model], [layer, head, d_head]
    return Away(lm.n_head + 1, values["pre"].to(device), mlp.__getitem__, z.__getitem__, opening=True)


def edge_batch(
    lm: AttentionLM, ids: torch.Tensor, valid: torch.Tensor, values: dict[str, torch.Tensor], method: str, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of stories: each story's edge scores ``[batch, writer, receiver]`` (the change in its summed
    loss, to first order, when the edge alone is ablated) and its predicted tokens ``[batch]``."""
    if method not in STORY_METHODS:
        raise StorylensError(
            f"--method {method}: on stories, one of {', '.join(STORY_METHODS)} (eap-ig-inputs moves the input "
            "from a corrupt prompt, and a corpus has none)"
        )
    c, _ = batch_scores(lm, ids, story_metric(ids, valid), _ablator(values), method, steps)
    return c, valid[:, 1:].sum(1).to(torch.float64).cpu()


def loss_batch(
    lm: AttentionLM, ids: torch.Tensor, valid: torch.Tensor, values: dict[str, torch.Tensor], circuits: torch.Tensor
) -> torch.Tensor:
    """``[circuit, batch]``: each story's summed loss with every edge outside each circuit (``[circuit, writer,
    receiver]`` bool) ablated."""
    metric = story_metric(ids, valid)
    away = _away(lm, values, ids.device)
    return circuit_metrics(lm, ids, metric, list(circuits), away)


def clean_losses(lm: AttentionLM, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[batch]`` float64: each story's summed loss, nothing ablated."""
    return run_pass(lm, ids, story_metric(ids, valid), grad=False)[0].double().cpu()


# ---------------------------------------------------------------- streamed sums


def poisson_weights(seed: int, index: int, n: int) -> torch.Tensor:
    """``[n]`` float64: story ``index``'s weights in ``n`` Poisson bootstrap resamples (the same wherever it is scored)."""
    key = int.from_bytes(hashlib.sha256(f"storylens-circuit:{seed}:{index}".encode()).digest()[:7], "big")
    return torch.poisson(torch.ones(n, dtype=torch.float64), generator=torch.Generator().manual_seed(key))


class EdgeSums:
    """Every edge's per-story scores ``c`` over ``n`` tokens, streamed: the five sums of
    :func:`~storylens.engine.accumulate.pooled_ratio` and, per Poisson resample, ``sum w c`` and ``sum w n``."""

    def __init__(self, shape: tuple[int, int], resamples: int, seed: int, tensors: dict | None = None):
        self.resamples, self.seed = resamples, seed
        if tensors is not None:
            self.t = dict(tensors)
            return
        z = torch.zeros(shape, dtype=torch.float64)
        self.t = {"c": z, "c2": z.clone(), "cn": z.clone(), "n": torch.zeros(3, dtype=torch.float64)}
        self.t["rep_c"] = torch.zeros(resamples, *shape, dtype=torch.float64)
        self.t["rep_n"] = torch.zeros(resamples, dtype=torch.float64)

    def add(self, c: torch.Tensor, n: torch.Tensor, index: Sequence[int]) -> None:
        """``c`` ``[story, writer, receiver]``, ``n`` ``[story]`` tokens, ``index`` the stories' indices in the run."""
        c, n = c.to(torch.float64), n.to(torch.float64)
        t = self.t
        t["c"] += c.sum(0)
        t["c2"] += (c * c).sum(0)
        t["cn"] += torch.einsum("swr,s->wr", c, n)
        t["n"] += torch.stack([n.sum(), (n * n).sum(), torch.tensor(float(len(n)), dtype=torch.float64)])
        w = torch.stack([poisson_weights(self.seed, int(i), self.resamples) for i in index])  # [story, resample]
        t["rep_c"] += torch.einsum("sk,swr->kwr", w, c)
        t["rep_n"] += w.T @ n

    def merge(self, other: EdgeSums) -> EdgeSums:
        if other.t["c"].shape != self.t["c"].shape or other.resamples != self.resamples:
            raise ValueError("merge: edge sums of another graph or another number of resamples")
        self.t = {k: self.t[k] + other.t[k] for k in self.t}
        return self

    @property
    def stories(self) -> int:
        return int(self.t["n"][2])

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, se)`` per token, ``[writer, receiver]``."""
        t = self.t
        if self.stories == 0:
            raise StorylensError("circuit: no story of two tokens or more to score edges on")
        return pooled_ratio(t["c"], t["n"][0], t["c2"], t["cn"], t["n"][1], self.stories)

    def resampled(self) -> torch.Tensor:
        """``[resample, writer, receiver]``: each Poisson resample's pooled scores."""
        return self.t["rep_c"] / self.t["rep_n"].clamp(min=1e-300)[:, None, None]


class RowSums:
    """Per story, in story order: its summed loss under each of some runs (``losses`` ``[story, run]``) and its
    tokens (``n``), as each chunk's :func:`~storylens.corpus.circuit.chunk_job` gives them; merged by joining."""

    def __init__(self, tensors: dict | None = None):
        self.t = dict(tensors) if tensors is not None else {}

    def merge(self, other: RowSums) -> RowSums:
        if other.t:
            self.t = dict(other.t) if not self.t else {k: torch.cat([self.t[k], other.t[k]]) for k in ("losses", "n")}
        return self


PAGE_STORIES, PAGE_TOKENS = 4, 48  # the page shows a head's attention on the first stories' first tokens


def story_patterns(lm: AttentionLM, source, limit: int = PAGE_STORIES, tokens: int = PAGE_TOKENS) -> list[dict]:
    """For the page: the first ``limit`` stories' first ``tokens`` tokens and every head's attention on them,
    ``[layer][head][query][key]`` rounded to 4 decimals (as :func:`~storylens.effects.patching.pair_patterns`, one
    side: ``clean``)."""
    out = []
    for i, text in zip(range(limit), source):
        ids = [lm.marker_id] + lm.encode_batch([str(text)])[0].ids[: tokens - 1]
        with torch.no_grad():
            maps = lm.patterns(torch.tensor([ids], device=lm.device))  # per layer [1, head, q, k]
        attention = [[[[round(float(x), 4) for x in row] for row in h] for h in m[0]] for m in maps]
        out.append({"line": i + 1, "clean": {"tokens": [lm.decode([t]) for t in ids], "attention": attention}})
    return out
