"""``storylens circuit``'s methods on the shipped model, and their cost on the 30 x 9 Llama shape, side by side:

    python benchmarks/bench_circuit.py [--json benchmarks/circuit.json] [--llama-pairs 64] [--vocab real|tokenizer]
        [--shapes-only | --shipped-only]

* **shipped**: on the name task (``--pairs names``) and the indirect-object pairs, for each of ``eap``,
  ``eap-ig-inputs`` and ``eap-ig-activations`` (5 steps): the faithfulness curve of its top circuits (each run
  exactly), CPR and CMD with their bootstrap errors, and its time against one bare forward pass over the same
  pairs, timed in the same run;
* **llama-30x9** and **gpt2-small**: a seeded random Llama of the 30 x 9-head shape with 3 key/value heads (576
  wide) and a GPT-2 of GPT-2 small's shape (12 x 12 heads, 768 wide), storylens's tokenizer with the real
  models' vocabularies (SmolLM's 49,152 rows, GPT-2's 50,257: the output head its real size; ``--vocab
  tokenizer``: the tokenizer's 4,096), ``--llama-pairs``
  pairs of 21 to 35 tokens, and one story of 2,000 tokens (the shipped quiz run together) under zero ablation:
  the edges (grouped, and what ungrouping would give), EAP's and EAP-IG's time against a bare forward, a
  faithfulness curve (seeded random circuits at MIB's ten sizes, each run exactly, and the corrupt run they share:
  the target is about ten forwards; random circuits cut nearly every receiver from a set of its own, the costliest
  case) and the curve ``circuit`` runs (EAP's top circuits at those sizes, pruned) against a bare forward,
  and the peak memory each adds above the model (the resident peak from a reset, a fresh process per method) against the size
  of the ``[batch, pos, writers, d_model]`` difference buffer EAP-IG's code holds whole.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_record import build  # noqa: E402

from storylens.circuits import prefix  # noqa: E402
from storylens.circuits.edges import METHODS, Graph, eap_scores, edge_mask, fitting_pairs, graph_of  # noqa: E402
from storylens.circuits.faithfulness import PERCENTAGES, edge_metrics, faithfulness  # noqa: E402
from storylens.circuits.prefix import shared_start, start_ordered  # noqa: E402
from storylens.circuits.stories import edge_batch, loss_batch, zero_values  # noqa: E402
from storylens.data.sources import open_source  # noqa: E402
from storylens.effects.patching import BATCH_PAIRS, PAIR_SETS, encode_pairs, pair_batches, read_pairs  # noqa: E402
from storylens.lm import load_lm  # noqa: E402

STEPS = 5
VOCABS = {"llama-30x9": 49152, "gpt2-small": 50257}  # the real models' (SmolLM-135M's, GPT-2's)
STORY_TOKENS = 2000  # one long story: the corpus form's memory where the difference buffer is largest
QUIZ = Path(__file__).resolve().parents[1] / "storylens/pretrained/tiny-storyteller/quiz.txt.gz"


def _forward_time(lm, pairs) -> float:
    """A bare forward over ``pairs``'s clean prompts, batched in the order the circuit's runs batch them (pairs alike
    together: less padding for both, so the ratio is not the sorting's)."""
    batches = pair_batches(lm, start_ordered(pairs)[0])
    with torch.no_grad():
        t = time.perf_counter()
        for b in batches:
            lm.forward(b.clean)
        return time.perf_counter() - t


def shipped() -> dict:
    lm = load_lm(None)
    out = {}
    for task in ("names", "indirect-object"):
        pairs = encode_pairs(lm, read_pairs(PAIR_SETS[task]))
        fwd = min(_forward_time(lm, pairs) for _ in range(3))
        rows = {}
        for method in METHODS:
            t = time.perf_counter()
            scores = eap_scores(lm, pairs, method=method, steps=STEPS)
            took = time.perf_counter() - t
            f = faithfulness(lm, pairs, scores)
            rows[method] = {"over_forward": took / fwd, "faithfulness": f.to_dict()}
            print(f"{task:16} {method:19} {took / fwd:7.1f}x forward  CPR {f.cpr:.3f} ± {f.cpr_se:.3f}  "
                  f"CMD {f.cmd:.3f}  f at 1%: {f.f[3]:+.3f} ± {f.f_se[3]:.3f}", flush=True)  # fmt: skip
        out[task] = {"pairs": len(pairs), "edges": graph_of(lm).n_edges, "methods": rows}
    return out


def _llama_pairs(lm, n: int):
    rows = read_pairs(PAIR_SETS["names"])
    return encode_pairs(lm, (rows * (n // len(rows) + 1))[:n])


def _random_circuit(lm, share: float = 0.05) -> torch.Tensor:
    """A seeded random circuit of ``share`` of the edges: nearly every receiver cut from a set of its own (where the
    model's structure is not read, an edge-patched pass then needs a copy of the batch per receiver)."""
    mask = edge_mask(graph_of(lm))
    keep = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) < share
    return keep & mask


def _long_story(lm, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One story of ``tokens`` tokens: the shipped quiz's stories run together (real text), as one row."""
    text = " ".join(open_source(str(QUIZ)))
    ids = [lm.marker_id] + lm.encode_batch([text])[0].ids[: tokens - 1]
    x = torch.tensor([ids])
    return x, torch.ones_like(x, dtype=torch.bool)


def llama_one(folder: str, what: str, n: int) -> dict:
    """In a fresh process: one method's time against a bare forward and the peak memory it adds (``story`` and
    ``story-patched``: on one story of ``STORY_TOKENS`` tokens instead of the pairs, under zero ablation)."""
    lm = load_lm(folder)
    what, _, whole = what.partition(":")
    prefix.SHARE = not whole  # ":whole": every run over the whole prompts, the shared start not run once
    if what.startswith("story"):
        ids, valid = _long_story(lm, min(STORY_TOKENS, lm.window))
        with torch.no_grad():
            fwd = min(_timed(lambda: lm.forward(ids)) for _ in range(2))
    else:
        pairs = _llama_pairs(lm, n)
        fwd = min(_forward_time(lm, pairs) for _ in range(2))
    scores = eap_scores(lm, pairs) if what == "curve" else None  # the circuits the curve runs, not timed
    base = _reset_peak()
    t = time.perf_counter()
    curve = [_random_circuit(lm, share) for share in PERCENTAGES]
    if what == "patched":
        edge_metrics(lm, pairs, curve)
    elif what == "curve":
        assert scores is not None
        faithfulness(lm, pairs, scores)
    elif what == "story":
        edge_batch(lm, ids, valid, zero_values(lm), "eap", 1)
    elif what == "story-patched":
        loss_batch(lm, ids, valid, zero_values(lm), torch.stack(curve))
    else:
        eap_scores(lm, pairs, method=what, steps=STEPS)
    took = time.perf_counter() - t
    return {"over_forward": took / fwd, "peak_above_mb": (_status_kb("VmHWM") - base) / 1024}


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """The resident size now (kB), the peak reset to it (``5`` to /proc/self/clear_refs: Linux's way), so that
    what a run adds is measured from the model and a forward as they stand, not from the loader's own peak (which
    ``ru_maxrss`` keeps and which hid every run's peak below it)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS")


def shape(kind: str, n: int, base: Path, vocab: int | None) -> dict:
    """``kind`` of bench_record's random models (``llama-30x9``, ``gpt2-small``) with ``vocab`` rows (None: the
    tokenizer's): the edges, and each run's time and memory in a fresh process."""
    folder = build(kind, base, vocab)
    lm = load_lm(str(folder))
    g = graph_of(lm)
    pairs = _llama_pairs(lm, n)
    tokens = max(len(p.clean_ids) for p in pairs)
    d_model = lm.head_output_weights(0).shape[-1]
    buffer = n * tokens * len(g.writers) * d_model * 4 / 2**20  # float32, EAP-IG's activation_difference
    out = {
        "pairs": n,
        "tokens": tokens,
        "edges": g.n_edges,
        "edges_ungrouped": Graph(g.n_layer, g.n_head, g.n_head).n_edges,
        "difference_buffer_mb": buffer,
        "vocab": int(lm.module.get_output_embeddings().weight.shape[0]),
        "shared_share": _shared_share(lm, pairs),
    }
    out["story_tokens"] = min(STORY_TOKENS, lm.window)  # GPT-2 small's window is 1,024
    out["story_buffer_mb"] = out["story_tokens"] * len(g.writers) * d_model * 4 / 2**20
    for what in ("eap", "eap:whole", "eap-ig-inputs", "patched", "curve", "curve:whole", "story", "story-patched"):
        cmd = [sys.executable, __file__, "--one", str(folder), what, str(n)]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        out[what] = res
        whole = out["story_buffer_mb"] if what.startswith("story") else buffer
        print(f"{kind} {what:14} {res['over_forward']:7.1f}x forward, peak +{res['peak_above_mb']:.0f} MB "
              f"(the whole difference buffer: {whole:.0f} MB)", flush=True)  # fmt: skip
    return out


def _shared_share(lm, pairs) -> float:
    """The share of the curve's batches' tokens (padding included) in a start their pairs share, run once."""
    ordered = start_ordered(pairs)[0]
    batches = pair_batches(lm, ordered, fitting_pairs(lm, ordered, BATCH_PAIRS, graph=False))
    return sum(shared_start(b) * len(b.clean) for b in batches) / sum(b.clean.numel() for b in batches)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--llama-pairs", type=int, default=64)
    p.add_argument("--one", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("--shapes-only", action="store_true", help="only the random models' costs, into --json as it is")
    p.add_argument("--vocab", choices=("real", "tokenizer"), default="real", help="the random models' vocabularies")
    p.add_argument("--shipped-only", action="store_true", help="only the shipped model's runs, into --json as it is")
    args = p.parse_args()
    if args.one:
        folder, what, n = args.one
        print(json.dumps(llama_one(folder, what, int(n))))
        return
    if args.shipped_only:
        result = json.loads(Path(args.json).read_text()) if args.json else {}
        result["shipped"] = shipped()
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return
    with tempfile.TemporaryDirectory() as tmp:
        old = json.loads(Path(args.json).read_text()) if args.shapes_only and args.json else {}
        result = old or {
            "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "steps": STEPS,
            "shipped": shipped(),
        }
        for kind in ("llama-30x9", "gpt2-small"):
            result[kind] = shape(kind, args.llama_pairs, Path(tmp), VOCABS[kind] if args.vocab == "real" else None)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
