"""Regenerate the docs' table of recording on transformers models from a benchmark run:

    python benchmarks/bench_record.py --json benchmarks/record.json
    python scripts/readme_record_table.py benchmarks/record.json

Replaces the text between <!-- record:start --> and <!-- record:end -->.
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.readme_tables import update

NAMES = {"llama-30x9": "Llama 30 x 9 heads (3 key/value)", "gpt2-small": "GPT-2-small shape (12 x 12)"}
TARGETS = {"score (raw)": "≤ 1.15x", "score": "≤ 1.15x"}


def _rounds(section: dict, side: str, over: str) -> str:
    """``side``'s time over ``over``'s in each round, where the run kept every round's times."""
    a = section.get("all_seconds")
    if not a or len(a.get(side, ())) < 2:
        return ""
    return "; round by round " + ", ".join(f"{t / b:.2f}x" for t, b in zip(a[side], a[over], strict=True))


def table(r: dict) -> str:
    speeds = [m["speed"] for m in r["models"].values() if "speed" in m]
    rounds = speeds[0].get("rounds", r["rounds"]) if speeds else r["rounds"]  # a section keeps its run's rounds
    rows = [
        f"Measured by `python benchmarks/bench_record.py` on {r['cpu']} ({r['cores']} cores, torch {r['torch']}, "
        f"transformers {r['transformers']}, {r['threads']} threads), seeded random weights, best of "
        f"{rounds} rounds, every side run on each batch in turn (the first side rotating), so that each is timed "
        "within seconds of the others; each ratio is to the model's bare sdpa forward in the same round:",
        "",
        "| model | what | time | ratio to bare | target |",
        "|---|---|---|---|---|",
    ]
    for kind, entry in r["models"].items():
        s = entry["speed"]
        for side, sec in s["seconds"].items():
            what = {
                "bare": f"bare forward, sdpa, no output head ({s['stories']} quiz stories, {s['batches']} batches, "
                f"{s['padded_tokens']:,} padded tokens)",
                "score (raw)": "`score_heads`' recording, every built-in detector, raw attention",
                "score": "the same as `storylens score` (also norm-weighted columns, output norms)"
                + _rounds(s, "score", "bare"),
                "score, no sink columns": "the same without the sink and context columns (their cost)",
                "score, eager": "the same with transformers' eager attention (before)",
                "TL patterns": "TransformerLens `run_with_cache`, patterns only (no scores)",
            }[side]
            ratio = "1" if side == "bare" else f"{s['ratio'][side]:.2f}x"
            rows.append(f"| {NAMES[kind]} | {what} | {sec:.1f} s | {ratio} | {TARGETS.get(side, '')} |")
        if s.get("tl_note"):
            rows.append(f"| {NAMES[kind]} | TransformerLens did not load it: {s['tl_note']} | | | |")
    for kind, entry in r["models"].items():
        c = entry.get("commands")
        if c:
            rows += [
                "",
                f"`storylens report --model` against `storylens score --model` on the same 200 quiz stories, "
                f"{NAMES[kind]}, each a whole process (on {c.get('machine', r['cpu'])}): report {c['seconds']['report']:.1f} s, score "
                f"{c['seconds']['score']:.1f} s, **{c['report_over_score']:.2f}x** (target ≤ 1.3x), the best of each"
                + _rounds(c, "report", "score")
                + ".",
            ]
    for kind, entry in r["models"].items():
        e = entry.get("end_to_end")
        if e:
            best = e["ratios"].index(e["ratio"])
            rows += [
                "",
                f"`storylens score` end to end as a user runs it (`score_heads` with every built-in column and "
                f"the top examples, encoding included) against the bare forward on the same length-packed batches, "
                f"{NAMES[kind]}, the first {e['stories']} quiz stories in {e['batches']} batches (on "
                f"{e.get('machine', r['cpu'])}, `--sections end_to_end`): bare {e['seconds']['bare'][best]:.1f} s, "
                f"score {e['seconds']['score'][best]:.1f} s, **{e['ratio']:.2f}x** (target ≤ 1.15x), the best of "
                f"{len(e['ratios'])} rounds; round by round " + ", ".join(f"{x:.2f}x" for x in e["ratios"]) + ""
                f" (median {statistics.median(e['ratios']):.2f}x: whole runs a minute long on a shared machine, "
                "whose speed drifts between them).",
            ]
            parts = e.get("breakdown")
            if parts:
                rows += [
                    "",
                    "Where the time goes, each over the bare forward in the same rounds (round by round): the "
                    "recording of the same encoded stories with every map formed and handed to a measure that "
                    "does nothing, "
                    + ", ".join(f"{x:.2f}x" for x in parts["maps"])
                    + "; handing over what score's measures read besides (key columns, value and output norms), "
                    + ", ".join(f"{x:.2f}x" for x in parts["maps and inputs"])
                    + "; score's measures fed, "
                    + ", ".join(f"{x:.2f}x" for x in parts["recording"])
                    + (
                        "; with the top examples kept too, "
                        + ", ".join(f"{x:.2f}x" for x in parts["recording and examples"])
                        + "; the rest of `score` (name vocabulary, encoding, the induction score on random tokens, "
                        "the table) is the step from there to the figure above."
                        if "recording and examples" in parts
                        else "; the rest of `score` (name vocabulary, encoding, top examples, the induction score "
                        "on random tokens, the table) is the step from there to the figure above."
                    ),
                ]
    for kind, entry in r["models"].items():
        mem = entry.get("memory")
        if not mem:
            continue
        rows += ["", f"Peak memory above the loaded model, one story scored, {NAMES[kind]}:", ""]
        impls = sorted({m["impl"] for m in mem}, key=lambda i: i == "eager")
        rows.append(
            "| tokens | "
            + " | ".join("storylens attention (streamed)" if i != "eager" else "eager" for i in impls)
            + " |"
        )
        rows.append("|---" * (len(impls) + 1) + "|")
        for tokens in sorted({m["tokens"] for m in mem}):
            cells = [
                f"{next(m['above_mb'] for m in mem if m['tokens'] == tokens and m['impl'] == i):.0f} MB" for i in impls
            ]
            rows.append(f"| {tokens:,} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    run = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/record.json").read_text())
    update("record", table(run))
    print(table(run))
