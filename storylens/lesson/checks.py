"""The lesson's numerical promises, measured on this machine, with bounds derived from rounding.

The lesson shows a learner a handful of numbers: the fused kernel and the explicit softmax give
the same logits (within 2e-5), every attention row sums to 1, the upper triangle is exactly zero,
a prefix's keys and values equal the full run's, KV-cached generation equals recomputing
everything (within 3e-7), and the cache computes 200 keys and values where recomputing computes
1 + 2 + ... + 200 = 20,100. :func:`run_checks` measures each of them on the user's own CPU, in
float32 and in float64, and sets each beside a bound.

How the bounds are derived
--------------------------
Two computations of the same mathematical quantity (fused vs explicit attention, a 1-row vs a
many-row matrix multiply) differ only by rounding. In floating point with unit roundoff ``u``
(2^-24 for float32, 2^-53 for float64), a sum of ``n`` products carries an error that, for
rounding errors behaving as independent random variables, stays below ``lambda * sqrt(n) * u``
times the sum of the magnitudes with overwhelming probability (Higham & Mary, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019; the worst case is ``n * u``).
In one block the longest such sum has ``n = max(4 * d_model, window)`` terms (the MLP's second
projection, or the attention-weighted sum over the window); every block adds its own
perturbation to the residual stream, and to first order the ``n_layer`` perturbations add up.
So a quantity of magnitude ``scale`` (the largest absolute logit, key or value compared) computed
two ways may differ by about

    n_layer * sqrt(n) * u * scale

and :func:`rounding_bound` allows ``LAMBDA = 4`` times that (the constant of the probabilistic
bound, and the amplification that LayerNorm and the softmax can add). For the shipped model in
float32 (6 blocks, n = 1024, largest logit about 20) this is about 9e-4; in float64 about 2e-12.
A real error (a wrong mask, a stale cache entry, a shifted position) moves logits by far more
than that in either precision, so the float64 checks are where the mathematics is held exact.

Attention rows sum to 1 up to the rounding of a softmax over ``T`` keys: the sum of the
exponentials and the sum of the quotients each carry at most ``T * u`` (worst case, not
probabilistic), so ``|row sum - 1| <= (2T + 2) * u``. The upper triangle is not rounded at all:
``exp(-inf)`` is exactly 0, so it must be exactly 0.

Beside the lesson's figures
---------------------------
The lesson gives two figures (2e-5 and 3e-7), each one measurement on its own machine in float32
(far above float64's rounding). The float32 bounds here are larger: they are derived to hold for
this model's sums on any CPU's kernels, with the margin above, not measured once. The float64
bounds are far smaller: float64 rounds 2^29 times finer. :func:`lesson_note` says which, check by
check, wherever a lesson figure stands beside a bound.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch

from storylens.core.plain import Plain
from storylens.lesson.figures import LESSON_FIGURES
from storylens.model.gpt import GPT, KVCache
from storylens.model.tokenizer import eot_id

LAMBDA = 4.0  # safety constant of the probabilistic rounding bound (see the module docstring)

# What the lesson states (for display next to the learner's own numbers).
LESSON = {  # the lesson's figures for two of the checks (storylens.lesson.figures)
    "fused_vs_explicit": LESSON_FIGURES.fused_vs_explicit,
    "kv_cache_vs_recompute": LESSON_FIGURES.kv_cache_vs_recompute,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next float: 2^-24 in float32, 2^-53 in float64."""
    return float(torch.finfo(dtype).eps) / 2


def longest_sum(config) -> int:
    """The most terms any single dot product in one block adds up."""
    return max(4 * config.n_embd, config.block_size, config.head_size)


def rounding_bound(config, dtype: torch.dtype, scale: float) -> float:
    """How far a quantity of magnitude ``scale``, computed two mathematically equal ways through
    the whole model, may drift by rounding alone (module docstring)."""
    return LAMBDA * config.n_layer * math.sqrt(longest_sum(config)) * unit_roundoff(dtype) * scale


def probability_bound(config, dtype: torch.dtype) -> float:
    """How far an attention probability (or a mean of them: every head score) computed two equal
    ways may drift: scale 1 (a probability is at most 1), times 2 for the softmax, whose output
    moves by at most twice the largest change of its inputs."""
    return 2 * rounding_bound(config, dtype, 1.0)


def row_sum_bound(dtype: torch.dtype, keys: int) -> float:
    """``|sum of an attention row - 1|`` allowed by the rounding of a softmax over ``keys`` keys."""
    return (2 * keys + 2) * unit_roundoff(dtype)


@dataclass
class Check(Plain):
    """One numerical check; ``to_dict`` adds whether it passed and :func:`lesson_note` (a report's
    ``numerics`` rows), ``from_dict`` reads such a row back."""

    name: str  # what is compared
    dtype: str  # "float32" or "float64"
    measured: float  # the largest difference seen
    bound: float  # what rounding allows (0 for exact identities)
    lesson: float | None = None  # the lesson's figure, where it gives one
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.measured <= self.bound

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed, "lesson_note": lesson_note(self)}

    @classmethod
    def from_dict(cls, d: dict) -> Check:
        return cls(d["name"], d["dtype"], d["measured"], d["bound"], d.get("lesson"), d.get("detail", ""))


def lesson_note(c: Check) -> str:
    """Why ``c``'s bound is larger or smaller than the lesson's figure beside it, and where the
    measurement falls against that figure; "" where the lesson gives no figure."""
    if c.lesson is None:
        return ""
    here = f"measured here {c.measured:.1e}: " + (
        "within the lesson's figure too"
        if c.measured <= c.lesson
        else "above the lesson's figure (another CPU's kernels round differently), within the bound"
        if c.passed
        else "past the bound"
    )
    if c.bound > c.lesson:
        return (
            f"bound above the lesson's {c.lesson:.0e}: derived for {c.dtype} rounding of this model's sums "
            f"on any CPU's kernels, with a {LAMBDA:g}x margin; the lesson's is one measurement on its machine; {here}"
        )
    finer = unit_roundoff(torch.float32) / unit_roundoff(getattr(torch, c.dtype))
    return (
        f"bound below the lesson's {c.lesson:.0e}, a float32 measurement: {c.dtype} rounds "
        f"2^{round(math.log2(finer))} times finer; {here}"
    )


def as_dtype(model: GPT, dtype: torch.dtype) -> GPT:
    """The model itself in its own dtype, else a copy in ``dtype`` (the original is untouched)."""
    if next(model.parameters()).dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype)


@torch.no_grad()
def fused_vs_explicit(model: GPT, stories_ids: list[list[int]], dtype: torch.dtype) -> list[Check]:
    """Logits of the fused kernel vs the explicit softmax, rows summing to 1, and the upper triangle."""
    m = as_dtype(model, dtype)
    name = str(dtype).replace("torch.", "")
    worst_logit = scale = worst_row = upper = 0.0
    longest = 1
    for ids in stories_ids:
        idx = torch.tensor([ids])
        fused = m(idx)
        explicit = m(idx, record_attention=True)
        worst_logit = max(worst_logit, (fused.logits - explicit.logits).abs().max().item())
        scale = max(scale, fused.logits.abs().max().item())
        T = len(ids)
        longest = max(longest, T)
        above = torch.ones(T, T, dtype=torch.bool).triu(1)
        for pattern in explicit.patterns:
            worst_row = max(worst_row, (pattern.sum(-1) - 1).abs().max().item())
            if T > 1:
                upper = max(upper, pattern[..., above].abs().max().item())
    n = len(stories_ids)
    return [
        Check(
            "fused vs explicit logits",
            name,
            worst_logit,
            rounding_bound(m.config, dtype, scale),
            LESSON["fused_vs_explicit"],
            f"{n} stories, largest logit magnitude {scale:.1f}",
        ),
        Check(
            "attention rows sum to 1",
            name,
            worst_row,
            row_sum_bound(dtype, longest),
            None,
            f"{n} stories x {m.config.n_layer * m.config.n_head} heads, up to {longest} keys",
        ),
        Check("upper triangle is exactly 0", name, upper, 0.0, None, "the causal mask: exp(-inf) = 0"),
    ]


@torch.no_grad()
def prefix_keys_values(model: GPT, ids: list[int], dtype: torch.dtype) -> Check:
    """The keys and values of a prefix, computed alone, against the same positions in the full run."""

    m = as_dtype(model, dtype)
    idx = torch.tensor([ids])
    full, prefix = KVCache.empty(m.config.n_layer), KVCache.empty(m.config.n_layer)
    m(idx, kv_cache=full, compute_logits=False)
    n = max(1, len(ids) // 2)
    m(idx[:, :n], kv_cache=prefix, compute_logits=False)
    worst = scale = 0.0
    for b in range(m.config.n_layer):
        for a, f in ((prefix.key[b], full.key[b]), (prefix.value[b], full.value[b])):
            assert a is not None and f is not None  # every block ran
            worst = max(worst, (a - f[:, :, :n]).abs().max().item())
            scale = max(scale, f.abs().max().item())
    return Check(
        "prefix keys/values = full run's",
        str(dtype).replace("torch.", ""),
        worst,
        rounding_bound(m.config, dtype, scale),
        None,
        f"first {n} of {len(ids)} tokens, largest key or value magnitude {scale:.1f}",
    )


@torch.no_grad()
def cached_vs_recomputed(model: GPT, dtype: torch.dtype, n_tokens: int = 200, seed: int = 7) -> list[Check]:
    """Generate ``n_tokens`` from the end-of-story marker twice (KV cache, recompute), same seed."""
    m = as_dtype(model, dtype)
    name = str(dtype).replace("torch.", "")
    n_tokens = min(n_tokens, m.config.block_size - 1)
    prompt = torch.tensor([[_marker_id(m)]])
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    cached = list(m.generate_stream(prompt, n_tokens, temperature=1.0, generator=g1))
    full = list(m.generate_stream(prompt, n_tokens, temperature=1.0, generator=g2, use_kv_cache=False))
    worst = max((a.logits - b.logits).abs().max().item() for a, b in zip(cached, full))
    scale = max(b.logits.abs().max().item() for b in full)
    same = sum(a.token == b.token for a, b in zip(cached, full))
    n = len(cached)
    expected_recompute = n * (n + 1) // 2
    return [
        Check(
            "KV cache vs recompute logits",
            name,
            worst,
            rounding_bound(m.config, dtype, scale),
            LESSON["kv_cache_vs_recompute"],
            f"{n} tokens, {same} of {n} the same, largest logit magnitude {scale:.1f}",
        ),
        Check("same tokens generated", name, float(n - same), 0.0, None, f"{n - same} of {n} differ"),
        Check(
            "key/value computations",
            name,
            float(abs(cached[-1].kv_computed - n) + abs(full[-1].kv_computed - expected_recompute)),
            0.0,
            None,
            f"cache {cached[-1].kv_computed:,} vs recompute {full[-1].kv_computed:,} "
            f"(expected {n:,} and 1 + 2 + ... + {n} = {expected_recompute:,})",
        ),
    ]


def _marker_id(model: GPT) -> int:

    return eot_id(model.tokenizer) if model.tokenizer is not None else 0


def run_checks(
    model: GPT,
    stories_ids: list[list[int]],
    *,
    dtypes=(torch.float32, torch.float64),
    gen_tokens: int = 200,
    on_step=None,
) -> list[Check]:
    """Every check, in every dtype: the learner's own numbers, each with its bound."""
    checks: list[Check] = []
    for dtype in dtypes:
        checks += fused_vs_explicit(model, stories_ids, dtype)
        if on_step:
            on_step()
        longest = max(stories_ids, key=len)
        checks.append(prefix_keys_values(model, longest, dtype))
        checks += cached_vs_recomputed(model, dtype, n_tokens=gen_tokens)
        if on_step:
            on_step()
    return checks
