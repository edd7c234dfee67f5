"""Every head's exact effect: what one head costs against one forward pass, side by side.

    python benchmarks/bench_exact.py --json benchmarks/exact.json [--stories 40] [--llama-stories 4] [--rounds 2]

On the shipped Tiny Storyteller (its quiz's first ``--stories`` stories) and a seeded random Llama of the
30 x 9-head shape (``bench_record.build``; its first ``--llama-stories``), float32, the same length-packed
batches for every side, each round timing in turn:

* ``forward``: one unablated forward pass over the batches, with logits and the loss (the comparator);
* ``every head at once``: :func:`storylens.effects.exact.exact_head_effects` (blocks before a head's not
  rerun; a block's heads as copies of the batch), zero ablation, every head;
* ``head by head``: :func:`storylens.effects.audit.exact_effects`, the audit's way: a whole forward pass
  per head, zero ablation, on one head of every block (the cost per head is what is compared).

A forward pass runs once before the rounds (warm-up, untimed). Each ablation side's figure is its time per head over the forward's time in the same round (the ideal
for every head at once is about (L + 1) / (2 L), the blocks from a head's own on, plus the output head),
the best of ``--rounds`` rounds; the rounds' figures are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_perf import _cpu  # noqa: E402
from bench_record import build  # noqa: E402

from storylens.core.batching import BATCH_TOKENS, length_batches  # noqa: E402
from storylens.core.heads import Head  # noqa: E402
from storylens.data.stories import load_split  # noqa: E402
from storylens.effects.ablation import _pad  # noqa: E402
from storylens.effects.audit import exact_effects, story_losses  # noqa: E402
from storylens.effects.exact import exact_head_effects  # noqa: E402
from storylens.lm import load_lm  # noqa: E402


def _encoded(lm, n: int) -> list[list[int]]:
    return [[lm.marker_id, *lm.encode(s)][: lm.window] for s in load_split().quiz[:n]]


def _forward(lm, ids: list[list[int]]) -> None:
    with torch.inference_mode():
        for idx in length_batches([len(s) for s in ids], 16, BATCH_TOKENS):
            story_losses(lm, *_pad([ids[i] for i in idx], lm.marker_id, lm.device))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(lm, ids: list[list[int]], rounds: int) -> dict:
    heads = lm.n_layer * lm.n_head
    sample = [Head(layer, layer % lm.n_head) for layer in range(lm.n_layer)]  # one head of every block
    _forward(lm, ids)  # warm-up
    out: dict = {
        "heads": heads,
        "sampled": len(sample),
        "stories": len(ids),
        "tokens": sum(map(len, ids)),
        "rounds": [],
    }
    for _ in range(rounds):
        fwd = _timed(lambda: _forward(lm, ids))
        every = _timed(lambda: exact_head_effects(lm, ids, ("zero",), batch_size=16))
        one = _timed(lambda: exact_effects(lm, ids, sample, ("zero",), batch_size=16))
        out["rounds"].append(
            {"forward_s": fwd, "every_head_s": every, "head_by_head_s": one,
             "every_head_per_head": every / heads / fwd, "head_by_head_per_head": one / len(sample) / fwd}
        )  # fmt: skip
    best = min(out["rounds"], key=lambda r: r["every_head_per_head"])
    out["every_head_per_head"] = best["every_head_per_head"]
    out["head_by_head_per_head"] = min(r["head_by_head_per_head"] for r in out["rounds"])
    out["ideal"] = (lm.n_layer + 1) / (2 * lm.n_layer)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--stories", type=int, default=40)
    parser.add_argument("--llama-stories", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"machine": _cpu(), "threads": args.threads, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder, n in (("shipped", None, args.stories), ("llama-30x9", "llama-30x9", args.llama_stories)):
            lm = load_lm(build(folder, Path(tmp)) if folder else None)
            results["models"][name] = r = bench(lm, _encoded(lm, n), args.rounds)
            print(
                f"{name}: {r['heads']} heads, {r['stories']} stories; one head, over one forward: "
                f"every head at once {r['every_head_per_head']:.2f}x, head by head {r['head_by_head_per_head']:.2f}x "
                f"(ideal (L + 1) / 2L = {r['ideal']:.2f})",
                flush=True,
            )
    args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
