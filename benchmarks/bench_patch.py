"""``storylens patch``'s cost against the model's bare forward pass, printed side by side.

    python benchmarks/bench_patch.py [--rounds 3] [--pairs 20] [--gpt2-small]

On the example pairs shipped with storylens (``storylens/data/example_pairs.jsonl``), batched as
``storylens patch`` batches them, for the shipped model and (``--gpt2-small``) a random model of GPT-2
small's shape (12 x 12 heads, d_model 768) with storylens's tokenizer:

* ``forward``: one bare forward pass over the clean texts of every pair (logits included);
* ``atp``: AtP for every head (a corrupt forward keeping ``z``, a clean forward, one backward), and
  its ratio to ``forward``;
* ``exact``: exact patching of every head; per pair and head, and its ratio to one forward per pair
  (``forward / pairs``): about 1 means a patched head costs one forward, less where the blocks
  before the head are skipped.

Median of ``--rounds`` timings, torch on the threads it has.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from storylens.effects.patching import EXAMPLE_PAIRS, encode_pairs, pair_batches, patch_heads, read_pairs
from storylens.lm import AttentionLM, load_lm, wrap


def _median(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(lm: AttentionLM, n_pairs: int, rounds: int) -> dict:
    rows = read_pairs(EXAMPLE_PAIRS)
    rows = (rows * (n_pairs // len(rows) + 1))[:n_pairs]
    pairs = encode_pairs(lm, rows)
    batches = pair_batches(lm, pairs)

    @torch.no_grad()
    def forward() -> None:
        for b in batches:
            lm.forward(b.clean)

    heads = lm.n_layer * lm.n_head
    t_fwd = _median(forward, rounds)
    t_atp = _median(lambda: patch_heads(lm, pairs, exact=0), rounds)
    t_all = _median(lambda: patch_heads(lm, pairs, exact="all"), rounds)
    t_exact = max(t_all - t_atp, 0.0)
    per_pair_head = t_exact / (heads * len(pairs))
    return {
        "model": lm.name,
        "heads": heads,
        "pairs": len(pairs),
        "forward_s": t_fwd,
        "atp_s": t_atp,
        "atp_x_forward": t_atp / t_fwd,
        "exact_s": t_exact,
        "exact_per_pair_head_ms": 1e3 * per_pair_head,
        "exact_per_pair_head_x_forward_per_pair": per_pair_head / (t_fwd / len(pairs)),
    }


def _gpt2_small() -> AttentionLM:
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    native = load_lm()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=native.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = GPT2Config(vocab_size=native.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    return wrap(GPT2LMHeadModel(cfg).eval(), tok, name="random GPT-2 small shape")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--gpt2-small", action="store_true", help="also a random model of GPT-2 small's shape")
    args = ap.parse_args()
    models = [load_lm()] + ([_gpt2_small()] if args.gpt2_small else [])
    print(
        f"{'model':28} {'heads':>5} {'pairs':>5} {'forward s':>9} {'atp s':>7} {'atp/fwd':>7} "
        f"{'exact s':>8} {'ms/pair-head':>12} {'/fwd-per-pair':>13}"
    )
    for lm in models:
        r = measure(lm, args.pairs, args.rounds)
        print(
            f"{r['model'][:28]:28} {r['heads']:5} {r['pairs']:5} {r['forward_s']:9.3f} {r['atp_s']:7.3f} "
            f"{r['atp_x_forward']:7.2f} {r['exact_s']:8.3f} {r['exact_per_pair_head_ms']:12.3f} "
            f"{r['exact_per_pair_head_x_forward_per_pair']:13.2f}"
        )


if __name__ == "__main__":
    main()
