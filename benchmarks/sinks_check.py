"""Does the dormant flag name heads that move nothing? A constructed model with sinks, side by side.

    python benchmarks/sinks_check.py [--layers 4] [--stories 40] [--draws 20] [--json benchmarks/sinks.json]

A seeded Llama (grouped key/value heads, storylens's tokenizer) built here, in float64: in every block
head 1 attends only to position 0 (the construction of tests/analysis/test_sinks.py, its key read
from a feature only the opening token has), head 3 attends to the previous token, and the others
have random queries and keys over the tokens' own features; no block writes into the three features
the heads' queries and keys read, so every block's sink stays a sink. The model is scored over the
first ``--stories`` quiz stories (cut to 40 words), and then, exactly: the change in the stories'
mean next-token loss (pooled over predicted tokens, with its standard error over stories:
``storylens.engine.accumulate.RatioAccumulator``) when the flagged heads are mean-ablated together
(their output replaced after the opening token by its mean over these stories) against ``--draws``
random draws of as many heads from all of them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storylens.analysis import score_heads  # noqa: E402
from storylens.core.heads import Head  # noqa: E402
from storylens.engine.accumulate import RatioAccumulator  # noqa: E402
from storylens.lm import load_lm  # noqa: E402

D_MODEL, N_HEAD, N_KV, D_HEAD = 64, 4, 2, 16
C, S, N = 0, 1, 2  # constant feature; opening token only; every other token


def build(folder: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from storylens.model.hub import load_model

    native = load_model().tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_object=native, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    bos = tok.bos_token_id
    cfg = LlamaConfig(
        hidden_size=D_MODEL, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV, max_position_embeddings=128, vocab_size=native.get_vocab_size(),
        rope_theta=1e4, bos_token_id=bos, eos_token_id=bos, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).double()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 0.003)
        emb[:, C], emb[:, S], emb[:, N] = 1.0, 0.0, 1.0
        emb[bos, S], emb[bos, N] = 1.0, 0.0
        freq = [1e4 ** (-2 * i / D_HEAD) for i in range(D_HEAD // 2)]  # the rotary pairs' frequencies
        slow, prev = D_HEAD // 2 - 1, next(i for i, f in enumerate(freq) if f <= 0.1)
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_proj.weight.normal_(0, 1.0)
            a.k_proj.weight.normal_(0, 1.0)
            a.q_proj.weight[:, :3] = 0.0
            a.k_proj.weight[:, :3] = 0.0
            a.v_proj.weight[:, :3] = 0.0
            a.v_proj.weight.mul_(30.0)
            for h in (0, 2):  # head 1 (group 0) and head 3 (group 1): built, not random
                a.q_proj.weight[h * D_HEAD : (h + 1) * D_HEAD] = 0.0
            a.k_proj.weight.zero_()  # both groups' keys are built: heads 2 and 4 read them with random queries
            a.q_proj.weight[0 * D_HEAD + slow, C] = 10.0
            a.k_proj.weight[0 * D_HEAD + slow, S] = 10.0
            angle = freq[prev]
            a.q_proj.weight[2 * D_HEAD + prev, C] = 40.0
            a.k_proj.weight[1 * D_HEAD + prev, C] = 40.0 * math.cos(angle)
            a.k_proj.weight[1 * D_HEAD + prev + D_HEAD // 2, C] = 40.0 * math.sin(angle)
            a.o_proj.weight[:3] = 0.0  # no block writes into the features the queries and keys read
            layer.mlp.down_proj.weight[:3] = 0.0
    out = folder / f"sinks-{layers}"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def mean_ablation_effect(lm, ids: list[list[int]], heads: list[Head], means: torch.Tensor) -> tuple[float, float]:
    """The change in the mean next-token loss (nats, pooled over predicted tokens) with ``heads``' outputs
    replaced after the opening token by ``means``, and its standard error over stories."""
    by_layer: dict[int, list[int]] = {}
    for h in heads:
        by_layer.setdefault(h.layer, []).append(h.head)

    def replace(z, hook):
        z = z.clone()
        for h in by_layer.get(hook.layer, []):
            z[:, 1:, h] = means[hook.layer, h]
        return z

    acc = RatioAccumulator(())
    for story in ids:
        x = torch.tensor([story])
        with torch.no_grad():
            clean = torch.nn.functional.cross_entropy(lm.module(x).logits[0, :-1], x[0, 1:], reduction="sum")
            with lm.hooks([(f"blocks.{layer}.attn.hook_z", replace) for layer in by_layer]):
                off = torch.nn.functional.cross_entropy(lm.module(x).logits[0, :-1], x[0, 1:], reduction="sum")
        acc.add((off - clean).reshape(1), torch.tensor([len(story) - 1.0]))
    r, se = acc.result()
    return float(r), float(se)


def z_means(lm, ids: list[list[int]]) -> torch.Tensor:
    """Each head's mean z over every position after the opening token, ``[layer, head, d_head]``."""
    sums, count = {}, 0

    def add(z, hook):
        sums[hook.layer] = sums.get(hook.layer, 0) + z[0, 1:].sum(0)

    with lm.hooks([(f"blocks.{i}.attn.hook_z", add) for i in range(lm.n_layer)]), torch.no_grad():
        for story in ids:
            lm.module(torch.tensor([story]))
            count += len(story) - 1
    return torch.stack([sums[i] for i in range(lm.n_layer)]) / count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stories", type=int, default=40)
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import tempfile

    from storylens.data.stories import load_split

    stories = [" ".join(s.split()[:40]) for s in load_split().quiz[: args.stories]]
    with tempfile.TemporaryDirectory() as tmp:
        lm = load_lm(build(Path(tmp), args.layers), dtype=torch.float64)
        scores = score_heads(lm, stories, progress=False)
        ids = [lm.encode(s) for s in stories]
        means = z_means(lm, ids)
        flagged = [h.at for h in scores.heads if h.dormant]
        rows = {
            h.label: {k: h[k] for k in ("first_mass", "sink_rate", "context_share", "context_norm")}
            for h in scores.heads
        }
        joint = mean_ablation_effect(lm, ids, flagged, means)
        rng = random.Random(0)
        every = [h.at for h in scores.heads]
        draws = [mean_ablation_effect(lm, ids, rng.sample(every, len(flagged)), means) for _ in range(args.draws)]
    effects = [d[0] for d in draws]
    result = {
        "layers": args.layers,
        "heads": len(every),
        "stories": args.stories,
        "flagged": [h.label for h in flagged],
        "flagged_effect": {"nats": joint[0], "se": joint[1]},
        "random_draws": {
            "draws": args.draws,
            "mean_nats": sum(effects) / len(effects),
            "min_nats": min(effects),
            "max_nats": max(effects),
            "each": [{"nats": e, "se": s} for e, s in draws],
        },
        "columns": rows,
    }
    print(f"{len(flagged)} of {len(every)} heads flagged dormant: {', '.join(result['flagged'])}")
    print(f"mean-ablating them together: {joint[0]:+.3g} nats (se {joint[1]:.2g}) over {args.stories} stories")
    print(
        f"{args.draws} random draws of {len(flagged)} heads: mean {result['random_draws']['mean_nats']:+.3g} nats, "
        f"from {min(effects):+.3g} to {max(effects):+.3g} (typical se {sorted(s for _, s in draws)[len(draws) // 2]:.2g})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
