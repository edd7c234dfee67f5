"""Where ``storylens circuit``'s time goes on a shape of ``bench_circuit.py``: EAP's stages and each circuit size of
the faithfulness curve, timed in one process as multiples of the model's bare forward over the same batches:

    python benchmarks/profile_circuit.py [--shape llama-30x9 | gpt2-small] [--pairs 64] [--rounds 3] [--vocab N]

* **the output head where the metric reads it**: a forward with the logits at each pair's last position alone
  (what every pass of ``circuit`` and ``patch`` runs, :class:`~storylens.effects.patching.PairMetric`), and EAP's
  scores so against EAP's with the logits at every position. The shapes take the shipped tokenizer's 4,096-row
  vocabulary, whose head is small; ``--vocab 49152`` (SmolLM's) or ``50257`` (GPT-2's) gives the real one;

* **EAP, per stage** (every batch of ``eap_scores``): the corrupt run, the gradient pass (the clean run with a
  graph and its backward), the writers' differences, and the contraction of the differences with the receivers'
  gradients, a slice of positions at a time and (beside it, on the same tensors, in turns first and second: the
  first after the backward runs slower) one block at a time;
* **the curve, per size** (the first four of its batches, which hold no graph): the corrupt run with the stream
  with every edge ablated kept from it (as ``edge_metrics`` runs it with pairs; beside it, the pass of its own that
  makes that stream under a mean or zero ablation), and
  the edge-patched run of EAP's top circuit at each of MIB's sizes (the smallest prune to few edges, the largest
  keeps half of them), with how many of the receivers keep any edge and how many blocks' MLPs and attentions
  have one.

Every stage runs over the whole prompts, as given (the pairs not sorted, the start a batch's pairs share not run
once: ``storylens.circuits.prefix``, which ``bench_circuit.py``'s rows measure with and without), so each stage's
share of a run is read on the same tokens as the forward's. Each figure is the minimum over ``--rounds``, the
forward's too. A tool for finding what to speed up, not a
benchmark: the ratios users compare are ``bench_circuit.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_circuit import _llama_pairs  # noqa: E402
from bench_record import build  # noqa: E402

from storylens.circuits import edge_patch, edges, faithfulness  # noqa: E402
from storylens.circuits.receivers import receiver_grads, receiver_grads_at  # noqa: E402
from storylens.effects.patching import PairMetric, pair_batches  # noqa: E402
from storylens.lm import load_lm  # noqa: E402


def _timed(times: dict, key: object, fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    times.setdefault(key, []).append(time.perf_counter() - t)
    return out


def eap_stages(lm, pairs, rounds: int) -> dict[str, float]:
    graph = edges.graph_of(lm)
    batches = pair_batches(lm, pairs, edges.fitting_pairs(lm, pairs, 32))
    times: dict = {}
    for r in range(rounds):
        per: dict = {}
        for b in batches:
            metric = PairMetric(b)
            _, corrupt = _timed(per, "corrupt run", edges.run_pass, lm, b.corrupt, metric, False, kinds=edges.WRITTEN)
            run, g_logits, *_ = _timed(per, "gradient pass", edges.gradient_blocks, lm, b.clean, metric)
            delta = _timed(per, "differences", edges._Delta, lm, corrupt, run)
            piece = functools.partial(receiver_grads_at, lm, run)
            blocks = ((layer, receiver_grads(lm, run, layer)) for layer in reversed(range(lm.n_layer)))
            ways = [
                ("contraction, slices", edges._contract_chunked, graph, g_logits, piece, delta),
                ("contraction, block by block", edges._contract, lm, graph, g_logits, blocks, delta),
            ]
            for key, fn, *args in ways if r % 2 else ways[::-1]:  # the first after the backward pays more
                _timed(per, key, fn, *args)
        with torch.no_grad():
            _timed(per, "forward", lambda: [lm.forward(b.clean) for b in pair_batches(lm, pairs)])
        for k, v in per.items():
            times.setdefault(k, []).append(sum(v))
    fwd = min(times.pop("forward"))
    print(f"EAP on {len(pairs)} pairs, {len(batches)} batches, forward {fwd:.2f} s (32 pairs a batch)")
    out = {k: min(v) / fwd for k, v in times.items()}
    for k, v in out.items():
        print(f"  {k:30} {v:5.2f}x forward")
    return out


def curve_sizes(lm, pairs, rounds: int) -> dict[str, float]:
    graph = edges.graph_of(lm)
    scores = edges.eap_scores(lm, pairs)
    circuits = [faithfulness.top_circuit(scores, int(p * graph.n_edges)) for p in faithfulness.PERCENTAGES[:-1]]
    batches = pair_batches(lm, pairs, edges.fitting_pairs(lm, pairs, 32, graph=False))[:4]
    made = []
    for b in batches:
        metric = PairMetric(b)
        away, _, bases = faithfulness._corrupt_away(lm, b, metric)  # the corrupt run's stream, as edge_metrics's
        made.append((b, metric, away, bases))
    times: dict = {}
    for _ in range(rounds):
        with torch.no_grad():
            _timed(times, "forward", lambda: [lm.forward(b.clean) for b, *_ in made])
        _timed(times, "corrupt", lambda: [faithfulness._corrupt_away(lm, b, m) for b, m, *_ in made])
        _timed(times, "stream", lambda: [edge_patch.ablated_bases(lm, b.clean, m, a) for b, m, a, _ in made])
        for p, c in zip(faithfulness.PERCENTAGES, circuits):
            ablated = ~c & edges.edge_mask(graph)
            t = time.perf_counter()
            for b, m, a, s in made:
                edge_patch.patch_edges(lm, b.clean, m, ablated, a, s)
            times.setdefault(p, []).append(time.perf_counter() - t)
    fwd = min(times.pop("forward"))
    print(f"the curve's runs on {len(made)} batches (forward {fwd:.2f} s)")
    print(f"  {'the corrupt run (and its stream)':44} {min(times.pop('corrupt')) / fwd:5.2f}x forward")
    print(f"  {'(the stream made by a pass of its own)':44} {min(times.pop('stream')) / fwd:5.2f}x forward")
    out = {}
    per = graph.per_block
    for (p, v), c in zip(times.items(), circuits):
        live = [c[:, i * per : (i + 1) * per] for i in range(graph.n_layer)]
        mlps, attns = sum(bool(x[:, -1].any()) for x in live), sum(bool(x[:, :-1].any()) for x in live)
        out[f"{p:.1%}"] = min(v) / fwd
        print(
            f"  {p:6.1%} ({int(c.sum()):6,} edges; receivers with one {int(c.any(0).sum()):3}/{len(graph.receivers)}; "
            f"MLPs {mlps:2}/{graph.n_layer}, attentions {attns:2}/{graph.n_layer}) {min(v) / fwd:5.2f}x forward"
        )
    return out


def output_head(lm, pairs, rounds: int) -> None:
    batches = pair_batches(lm, pairs, edges.fitting_pairs(lm, pairs, 32))

    class Everywhere(PairMetric):  # the same metric, the logits made at every position
        def __init__(self, b):
            self.b = b

    times: dict = {}
    for r in range(rounds):
        with torch.no_grad():
            _timed(times, "forward", lambda: [lm.forward(b.clean) for b in batches])
            _timed(times, "at", lambda: [lm.forward(b.clean, logits=b.last) for b in batches])
        for key, metric in [("eap at", PairMetric), ("eap everywhere", Everywhere)][:: 1 if r % 2 else -1]:
            edges.PairMetric = metric  # what eap_scores builds each batch's metric with
            _timed(times, key, edges.eap_scores, lm, pairs)
        edges.PairMetric = PairMetric
    fwd = min(times["forward"])
    vocab = lm.module.get_output_embeddings().weight.shape[0]
    print(f"the output head ({vocab:,} rows) at the last positions alone, {len(batches)} batches")
    print(f"  forward                         {min(times['at']) / fwd:5.2f}x the forward with every position's")
    print(
        f"  EAP                             {min(times['eap at']) / min(times['eap everywhere']):5.2f}x EAP with every position's"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("llama-30x9", "gpt2-small"), default="llama-30x9")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=None, help="the vocabulary's rows (default: the tokenizer's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lm = load_lm(str(build(args.shape, Path(tmp), args.vocab)))
        pairs = _llama_pairs(lm, args.pairs)
        output_head(lm, pairs, args.rounds)
        eap_stages(lm, pairs, args.rounds)
        curve_sizes(lm, pairs, args.rounds)


if __name__ == "__main__":
    main()
