"""The circuit page's figures, from a run of storylens circuit (never typed in):

    storylens circuit --out circuit-run --second-pairs names-paraphrased
    storylens circuit --stories storylens/pretrained/tiny-storyteller/quiz.txt.gz --out circuit-stories
    python benchmarks/bench_circuit.py --json benchmarks/circuit.json
    storylens circuit --stories storylens/pretrained/tiny-storyteller/quiz.txt.gz --limit 40 \
        --method eap-ig-activations --out circuit-stories-ig
    storylens circuit --stories storylens/pretrained/tiny-storyteller/quiz.txt.gz --limit 40 --out circuit-stories-40
    python scripts/docs_circuit_table.py circuit-run/circuit.json benchmarks/circuit.json \
        circuit-stories-ig/circuit.json circuit-stories-40/circuit.json circuit-stories/circuit.json

Replaces the text between <!-- circuit-shipped:start/end -->, <!-- circuit-cost:start/end --> and
<!-- circuit-stories:start/end --> on docs/circuit.md.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update
from storylens.circuits.run import ENOUGH, f_text, load_circuit


def shipped(path: str) -> str:
    r = load_circuit(path)
    f = r.faithfulness
    if r.task == "stories":
        method = "" if r.method == "eap" else f" --method {r.method}"
        intro = (
            f"`storylens circuit --stories storylens/pretrained/tiny-storyteller/quiz.txt.gz --limit {r.stories}"
            f"{method} --out circuit-stories` ({r.model}, the first {r.stories:,} quiz stories, {r.tokens:,} "
            f"predicted tokens, {r.ablation} ablation, {r.n_edges:,} edges). {r.verdict}"
        )
    else:
        intro = (
            f"`storylens circuit --out circuit-run` ({r.model}, the name task's {r.pairs} pairs, {r.n_edges:,} "
            f"edges). {r.verdict}"
        )
    rows = "pairs" if r.task == "pairs" else "stories"
    lines = [
        intro,
        "",
        "| edges (share) | kept after pruning | faithfulness |",
        "|---|---|---|",
    ]
    lines += [
        f"| {p:.1%} | {k:,} | {round(x, 3) + 0.0:+.3f} ± {se:.3f} |"
        for p, k, x, se in zip(f.percentages, f.kept, f.f, f.f_se)
    ]
    lines += ["", f"CPR {f.cpr:.3f} ± {f.cpr_se:.3f}, CMD {f.cmd:.3f} ± {f.cmd_se:.3f}."]
    if r.circuit_size is not None:
        edges = sorted((e for e in r.edges if e.in_circuit), key=lambda e: -abs(e.score))
        lines += [
            "",
            f"The smallest circuit keeping {ENOUGH:.0%} of the metric: {len(edges)} edges (the top {r.circuit_size} "
            f"before pruning), f {r.circuit_f:+.3f}. Its largest edges:",
            "",
            f"| writer | receiver | {r.method} score |",
            "|---|---|---|",
        ]
        lines += [f"| {e.writer} | {e.receiver} | {e.score:+.4f} ± {e.score_se:.4f} |" for e in edges[:10]]
    if r.oracle is not None:
        o = r.oracle
        rho = "n/a" if o.rho is None else f"{o.rho:.3f}"
        lines += ["", f"Oracle: {len(o.rows)} edges ablated alone and run, Spearman's rho against the scores {rho}"
                  + (f"; opposite signs beyond both errors: {', '.join(o.disagree)}." if o.disagree else "; no edge of opposite signs beyond both errors.")]  # fmt: skip
        if r.task == "stories":
            lines += ["", f"| edge | why | {r.method} score | exact effect (nats per token) |", "|---|---|---|---|"]
            lines += [f"| {x.writer} -> {x.receiver} | {x.why} | {x.score:+.4f} ± {x.score_se:.4f} | "
                      f"{x.exact:+.4f} ± {x.exact_se:.4f} |" for x in o.rows]  # fmt: skip
    if r.stability is not None:
        s = r.stability
        lines += ["", f"Stability over {s.resamples} bootstrap resamples of the {rows}: Jaccard {s.jaccard:.3f} (sd "
                  f"{s.jaccard_sd:.3f}) with the {s.kept}-edge circuit; {s.core} edges found in every resample keep f "
                  f"{f_text(s.core_f, s.core_f_se)}."]  # fmt: skip
    if r.second is not None:
        t = r.second
        spread = "" if t.jaccard_sd is None else f" (sd {t.jaccard_sd:.3f} over {t.resamples} resamples of it)"
        lines += ["", f"Found again on a second file of pairs (`--second-pairs names-paraphrased`: {t.source}, "
                  f"{t.pairs} pairs of the same behaviour in ten other stories). {t.verdict} Its {t.kept}-edge circuit "
                  f"has Jaccard {t.jaccard:.3f}{spread} with this one; the {t.shared} edges both hold keep f "
                  f"{f_text(t.shared_f, t.shared_f_se)} on the first pairs, and its own circuit "
                  f"{f_text(t.second_f, t.second_f_se)}."]  # fmt: skip
    return "\n".join(lines)


def _vocab(m: dict) -> str:
    return f"a {m['vocab']:,}-row vocabulary (the output head its size), " if "vocab" in m else ""


def cost(path: str) -> str:
    bench = json.loads(Path(path).read_text())
    lines = [
        f"Measured by `benchmarks/bench_circuit.py` ({bench['threads']} threads, {bench['machine']}; EAP-IG with "
        f"{bench['steps']} steps). Time against one bare forward pass over the same pairs, timed in the same run.",
        "",
        "| task | method | time (x a forward) | CPR | CMD | f at 1 % of the edges |",
        "|---|---|---|---|---|---|",
    ]
    for task, t in bench["shipped"].items():
        for method, m in t["methods"].items():
            f = m["faithfulness"]
            at = f["percentages"].index(0.01)
            lines.append(
                f"| {task} ({t['pairs']} pairs) | {method} | {m['over_forward']:.1f} | {f['cpr']:.3f} ± {f['cpr_se']:.3f} "
                f"| {f['cmd']:.3f} ± {f['cmd_se']:.3f} | {f['f'][at]:+.3f} ± {f['f_se'][at]:.3f} |"
            )
    what = {
        "llama-30x9": "A seeded random Llama of the 30 x 9-head shape with 3 key/value heads",
        "gpt2-small": "A seeded random GPT-2 of GPT-2 small's shape (12 x 12 heads)",
    }
    names = {
        "eap": "EAP",
        "eap:whole": "EAP, every run over the whole prompts (their shared start not run once)",
        "eap-ig-inputs": "EAP-IG (inputs)",
        "patched": "a faithfulness curve: 10 random circuits at MIB's sizes, each run exactly (target: about 10)",
        "curve": "the curve `circuit` runs: EAP's top circuits at MIB's sizes, pruned, each run exactly",
        "curve:whole": "the same curve, every run over the whole prompts",
        "story": "EAP on one story",
        "story-patched": "the faithfulness curve on it",
    }
    for kind, intro in what.items():
        if kind not in bench:
            continue
        m = bench[kind]
        ungrouped = m["edges_ungrouped"]
        grouped = f" ({ungrouped:,} if its key/value heads were ungrouped)" if ungrouped != m["edges"] else ""
        lines += [
            "",
            f"{intro}, {_vocab(m)}{m['pairs']} pairs of up to {m['tokens']} tokens, and one story of {m.get('story_tokens', 0):,} "
            f"tokens: {m['edges']:,} edges{grouped}. The whole `[batch, pos, writers, d_model]` difference buffer "
            f"would be {m['difference_buffer_mb']:,.0f} MB for the pairs and {m.get('story_buffer_mb', 0):,.0f} MB "
            "for the story; storylens holds at most 256 MiB of it at once."
            + (
                f" {m['shared_share']:.0%} of the pairs' batched tokens lie in a start the batch's pairs share, run once."
                if "shared_share" in m
                else ""
            ),  # fmt: skip
            "",
            "| run | time (x a forward) | peak memory above the model and a forward |",
            "|---|---|---|",
        ]
        lines += [
            f"| {names[k]} | {m[k]['over_forward']:.1f} | {m[k]['peak_above_mb']:,.0f} MB |" for k in names if k in m
        ]
    return "\n".join(lines)


def compared(paths: list[str]) -> str:
    """The stories' runs side by side (method, stories, the curve's areas, the oracle, the stability), then the
    first run in full."""
    runs = [load_circuit(p) for p in paths]
    lines = [
        "| method | stories | CPR | CMD | f at 1 % | oracle: Spearman's rho (edges with opposite signs) | "
        "Jaccard over resamples | core's f |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        f, o, st = r.faithfulness, r.oracle, r.stability
        at = f.percentages.index(0.01)
        rho = "n/a" if o is None or o.rho is None else f"{o.rho:.3f} ({len(o.disagree)} of {len(o.rows)})"
        jac = "n/a" if st is None else f"{st.jaccard:.3f} (sd {st.jaccard_sd:.3f})"
        core = "n/a" if st is None else f"{f_text(st.core_f, st.core_f_se)} ({st.core} edges)"
        method = r.method + ("" if r.ig_steps is None else f" ({r.ig_steps} steps)")
        lines.append(
            f"| {method} | {r.stories:,} | {f.cpr:.3f} ± {f.cpr_se:.3f} | {f.cmd:.3f} ± {f.cmd_se:.3f} | "
            f"{f.f[at]:+.3f} ± {f.f_se[at]:.3f} | {rho} | {jac} | {core} |"
        )
    return "\n".join(lines + ["", shipped(paths[0])])


if __name__ == "__main__":  # "-" for a file leaves its table as it is
    args = sys.argv[1:] + ["-"] * 3
    for marker, make, arg in (("circuit-shipped", shipped, args[0]), ("circuit-cost", cost, args[1])):
        if arg != "-":
            print(update(marker, make(arg)))
    if args[2] != "-":
        print(update("circuit-stories", compared([a for a in args[2:] if a != "-"])))
