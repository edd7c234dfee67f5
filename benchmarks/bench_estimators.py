"""Every head's exact effect beside each estimator: how well each agrees with it, and what each costs.

    python benchmarks/bench_estimators.py --json benchmarks/estimators.json [--stories 200] [--llama-stories 2]

On the shipped Tiny Storyteller over its quiz's first ``--stories`` stories (the 200 by default), mean ablation,
the mean over those stories, the same length-packed batches for every side:

* ``forward``: one unablated forward pass with logits and the loss (the comparator), timed first;
* ``exact``: :func:`storylens.effects.exact.exact_head_effects`, every head;
* each estimator (:mod:`storylens.effects.estimators`): ``atp``, ``atp*``, ``ig`` at 1 and 4 steps,
  ``quadratic``: its time over the forward's, Spearman's rho against the exact effect over the 24 heads
  (``atp*``: against ``|exact|``, its estimate being a size), the heads of opposite sign beyond both errors,
  the largest exact effect outside its top 5;
* ``means``: the mean's own sampling error: the exact effects on the quiz with the heads' means taken over two
  disjoint samples of n stories of the corpus (none of them quiz stories; n = 500 and 2,000, what ``score
  --exact``'s first pass could have drawn instead): the largest and the median change of a head's effect
  against its standard error;
* ``patch``: ``storylens patch`` on the 20 example pairs with each estimator: rho against exact patching.

On a seeded random Llama of the 30 x 9-head shape (``bench_record.build``; its quiz's first ``--llama-stories``
stories): each estimator's time and the exact effect's, over one forward pass timed in the same run.
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
from bench_exact import _encoded, _forward  # noqa: E402
from bench_perf import _cpu  # noqa: E402
from bench_record import build  # noqa: E402

from storylens.data.stories import load_split  # noqa: E402
from storylens.effects.ablation import head_output_means  # noqa: E402
from storylens.effects.estimators import audit_estimate, column_stem, effects_of, estimate_head_effects  # noqa: E402
from storylens.effects.exact import exact_head_effects  # noqa: E402
from storylens.effects.patch_more import patch_more  # noqa: E402
from storylens.effects.patching import EXAMPLE_PAIRS, encode_pairs, read_pairs  # noqa: E402
from storylens.lm import load_lm  # noqa: E402

SIDES = (("atp", 1), ("atp*", 1), ("ig", 1), ("ig", 4), ("quadratic", 1))


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _name(est: str, steps: int) -> str:
    return f"ig({steps})" if est == "ig" else est


def shipped(lm, n: int) -> dict:
    ids = _encoded(lm, n)
    means = head_output_means(lm, ids, batch_size=16, include_marker=False)
    _forward(lm, ids)  # warm-up
    _, fwd = _timed(lambda: _forward(lm, ids))
    acc, t_exact = _timed(lambda: exact_head_effects(lm, ids, ("mean",), means=means, batch_size=16))
    exact = effects_of(acc.columns(), "exact_mean")
    out: dict = {
        "stories": len(ids),
        "tokens": sum(len(s) - 1 for s in ids),
        "forward_s": fwd,
        "exact": {"over_forward": t_exact / fwd, "heads": {h.label: [e.nats, e.se] for h, e in exact.items()}},
        "estimators": {},
    }
    print(f"shipped: forward {fwd:.2f} s, exact {t_exact / fwd:.1f}x", flush=True)
    for est, steps in SIDES:
        got, t = _timed(
            lambda e=est, m=steps: estimate_head_effects(lm, ids, e, ("mean",), means=means, steps=m, batch_size=16)
        )
        estimate = effects_of(got.columns(), f"{column_stem(est)}_mean")
        a = audit_estimate(est, "mean", estimate, exact, len(ids))
        out["estimators"][_name(est, steps)] = {
            "over_forward": t / fwd,
            "rho": a.rho,
            "disagree": [d.head for d in a.disagree],
            "missed": a.missed.to_dict() if a.missed is not None else None,
            "sum": sum(e.nats for e in estimate.values()),
            "heads": {h.label: [e.nats, e.se] for h, e in estimate.items()},
        }
        print(f"  {_name(est, steps):10} rho {a.rho:+.3f}  {t / fwd:6.1f}x a forward", flush=True)
    train = [[lm.marker_id, *lm.encode(s)][: lm.window] for s in load_split().train[:4000]]
    out["means"] = {}
    for n in (500, 2000):  # two disjoint samples of n stories each: what score --exact's first pass could draw
        a, b = (
            head_output_means(lm, part, batch_size=16, include_marker=False) for part in (train[:n], train[n : 2 * n])
        )
        ea, eb = _exact_with(lm, ids, a), _exact_with(lm, ids, b)
        moved = {h.label: abs(eb[h].nats - ea[h].nats) / ea[h].se for h in ea}
        worst = max(moved, key=moved.__getitem__)
        out["means"][str(n)] = {"largest_change_over_se": moved[worst], "head": worst,
                                "median_change_over_se": sorted(moved.values())[len(moved) // 2]}  # fmt: skip
        print(
            f"  means over {n} stories against another {n}: the largest change is {moved[worst]:.3f} se ({worst})",
            flush=True,
        )
    return out


def _exact_with(lm, ids, means):
    return effects_of(exact_head_effects(lm, ids, ("mean",), means=means, batch_size=16).columns(), "exact_mean")


def patched(lm) -> dict:
    pairs = encode_pairs(lm, read_pairs(EXAMPLE_PAIRS), EXAMPLE_PAIRS.name)
    out = {}
    for est, steps in SIDES:
        r = patch_more(lm, pairs, exact="all", estimator=est, ig_steps=steps)
        out[_name(est, steps)] = {"rho": r.estimate_spearman, "atp_rho": r.spearman}
        print(f"  patch {_name(est, steps):10} rho {r.estimate_spearman:+.3f}", flush=True)
    return out


def llama(lm, n: int) -> dict:
    ids = _encoded(lm, n)
    means = head_output_means(lm, ids, batch_size=16, include_marker=False)
    _forward(lm, ids)
    _, fwd = _timed(lambda: _forward(lm, ids))
    _, t_exact = _timed(lambda: exact_head_effects(lm, ids, ("mean",), means=means, batch_size=16))
    out = {"stories": len(ids), "forward_s": fwd, "exact_over_forward": t_exact / fwd, "estimators": {}}
    print(f"llama-30x9: forward {fwd:.2f} s, exact {t_exact / fwd:.1f}x", flush=True)
    for est, steps in (("atp", 1), ("atp*", 1), ("ig", 4), ("quadratic", 1)):
        _, t = _timed(
            lambda e=est, m=steps: estimate_head_effects(lm, ids, e, ("mean",), means=means, steps=m, batch_size=16)
        )
        out["estimators"][_name(est, steps)] = t / fwd
        print(f"  {_name(est, steps):10} {t / fwd:6.1f}x a forward", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--stories", type=int, default=200)
    parser.add_argument("--llama-stories", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {"machine": _cpu(), "threads": args.threads}
    lm = load_lm(None)
    results["shipped"] = shipped(lm, args.stories)
    args.json.write_text(json.dumps(results, indent=1) + "\n")  # kept as it goes
    results["patch"] = patched(lm)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    if not args.skip_llama:
        with tempfile.TemporaryDirectory() as tmp:
            results["llama-30x9"] = llama(load_lm(build("llama-30x9", Path(tmp))), args.llama_stories)
    args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
