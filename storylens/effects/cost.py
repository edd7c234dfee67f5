"""What switching heads off costs, counted before it runs: floating-point operations of a block and of the
output head per token, an ablation run's passes against one scoring pass, and the budget past which a run is
refused unless asked for."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from storylens.core.errors import UsageError
from storylens.core.heads import Head
from storylens.lm import AttentionLM

# The ablations' budget when no story count is given (:func:`storylens.table.truth.truth_budget_stories`): switching heads
# off costs at most a fifth of the scoring pass's work, or 1 TFLOP (10^12 floating-point operations,
# seconds on a laptop's CPU) where that is more. An ablated story costs two forward passes (the heads'
# mean outputs, the unablated losses) plus, per head and mode, the blocks from the head's own on, with
# logits: with 12 heads on a 30-block model about 16 forward passes a story, so 50 stories cost 4 to 5
# scoring passes of 200 (benchmarks/bench_record.py's Llama); the shipped model fits 34 in the teraflop.
TRUTH_BUDGET = 0.2
TRUTH_FLOOR_FLOPS = 1e12


def effect_text(nats: float | None, se: float | None) -> str:
    """An effect in a table cell or a sentence, never with a sign its error does not support:
    ``+0.0123 ± 0.0040`` beyond two standard errors of zero, else ``no clear effect (+0.0012 ± 0.0040)``;
    empty for none."""
    if nats is None or nats != nats:
        return ""
    if se is None or se != se:
        return f"{nats:+.4f} (no error: one story)"
    if abs(nats) <= 2 * se:
        return f"no clear effect ({nats:+.4f} ± {se:.4f})"
    return f"{nats:+.4f} ± {se:.4f}"


def block_flops(lm: AttentionLM) -> float:
    """Floating-point operations one block spends on one token in its weights: two per parameter
    (a multiply and an add; norms and biases included, a slight overcount). Attention's own products,
    which grow with the story, are left out: a like share of every pass counted, they change no ratio
    much on stories of a few hundred tokens."""
    blocks = lm.blocks()
    if blocks:
        return 2.0 * sum(p.numel() for p in blocks[0].parameters())
    return 2.0 * sum(p.numel() for p in lm.module.parameters()) / lm.n_layer


def head_flops(lm: AttentionLM) -> float:
    """Floating-point operations of the output head (the logits) for one token: two per weight."""
    output_embeddings = getattr(lm.module, "get_output_embeddings", None)  # a transformers model's
    out = output_embeddings() if output_embeddings is not None else getattr(lm.module, "lm_head", None)
    return 2.0 * out.weight.numel() if out is not None and hasattr(out, "weight") else 0.0


def scoring_flops(lm: AttentionLM, lengths: Sequence[int]) -> float:
    """The scoring pass's work over stories of ``lengths`` tokens: every block over every token, no
    output head."""
    return lm.n_layer * sum(lengths) * block_flops(lm)


# ``storylens ablate`` and an explicit ``report --truth-stories`` refuse to start past this many
# floating-point operations unless given OVER_BUDGET_FLAG. The shipped model's whole ablate (every
# head, both modes, its 200 quiz stories) counts 15.4 TFLOP by ablate_cost, under a third of it; a
# model of 30 blocks of 9 heads passes it with a handful of heads (each costs the blocks from its own on).
ABLATION_LIMIT_FLOPS = 50e12


OVER_BUDGET_FLAG = "--over-budget"


@dataclass(frozen=True)
class AblationCost:
    """An ablation run's work, counted before it starts: ``passes`` forward passes of the whole model
    over the stories (the blocks run, over the model's blocks), ``flops`` its floating-point operations
    (:func:`block_flops` a block, :func:`head_flops` an output head, a token), ``scoring`` those of one
    scoring pass over the same stories."""

    passes: float
    flops: float
    scoring: float

    def describe(self) -> str:
        return (
            f"{self.passes:,.0f} forward passes over the stories, about {self.flops / 1e12:,.1f} TFLOP "
            f"({self.flops / self.scoring:,.0f} times one scoring pass)"
        )


def ablate_cost(
    lm: AttentionLM, lengths: Sequence[int], heads: Sequence[str] | None, modes: Sequence[str], group: int
) -> AblationCost:
    """What :func:`~storylens.table.name_ablation.name_ablation_table` will run over stories of ``lengths``
    tokens (an upper bound: it ablates only those with a main character): with ``heads`` None, a
    scoring pass for the name heads and every head alone; else those heads alone; a means pass and the
    unablated losses; and ``group`` heads off together (counted from the first block: an upper bound),
    each head and the group in every one of ``modes``."""
    L = lm.n_layer
    labels = heads if heads is not None else [h.label for h in Head.every(L, lm.n_head)]
    alone = sum(L - Head.parse(h).layer for h in labels)
    blocks = L * (heads is None) + L + L + len(modes) * (alone + (L if group else 0))
    outputs = 1 + len(modes) * (len(labels) + (1 if group else 0))
    tokens = sum(lengths)
    flops = tokens * (blocks * block_flops(lm) + outputs * head_flops(lm))
    return AblationCost(passes=blocks / L, flops=flops, scoring=scoring_flops(lm, lengths))


def check_ablation_budget(
    cost: AblationCost, what: str, *, over: bool = False, limit: float | None = None, stream=None
) -> None:
    """Say ``cost`` on stderr before the run starts; past ``limit`` (default :data:`ABLATION_LIMIT_FLOPS`)
    and not ``over``, refuse it in one line that names the estimate, the budget and the flag that
    runs it anyway."""
    limit = ABLATION_LIMIT_FLOPS if limit is None else limit
    if cost.flops > limit and not over:
        raise UsageError(
            f"{what}: {cost.describe()}, past the budget of {limit / 1e12:g} TFLOP; "
            f"pass {OVER_BUDGET_FLAG} to run it anyway"
        )
    print(f"storylens: {what}: {cost.describe()}", file=stream if stream is not None else sys.stderr, flush=True)
