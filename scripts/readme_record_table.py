"""Regenerate the docs' table of recording on transformers models from a benchmark run:

    python benchmarks/bench_record.py --json benchmarks/record.json
    python scripts/readme_record_table.py benchmarks/record.json

Replaces the text between <!-- record:start --> and <!-- record:end -->.
"""

import json
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


def _x(values) -> str:
    return ", ".join(f"{x:.3f}x" for x in values)


def _throughput(e: dict) -> str:
    """Both sides' throughput round by round (a run's ``tokens``; older runs have none)."""
    if "tokens" not in e:
        return ""
    sec = e["seconds"]
    rate = lambda side: ", ".join(f"{e['tokens'] / t:,.0f}" for t in sec[side])  # noqa: E731
    return (
        f" Throughput over its {e['tokens']:,} tokens (each story's opening marker included; {e['padded_tokens']:,} "
        f"padded), round by round: `score` {rate('score')} tokens/s, the bare forward {rate('bare')} tokens/s."
    )


def _end_to_end(e: dict, name: str, machine: str) -> list[str]:
    """The end-to-end paragraphs: score's work paired batch by batch with the bare forward (the
    figure), where its time goes, and whole runs as the check."""
    sec, parts = e["seconds"], e["breakdown"]
    rounds = len(e["ratios"])
    out = [
        f"`storylens score` end to end as a user runs it (every built-in column, the norm-weighted and sink "
        f"columns and the top examples, the name vocabulary and encoding included) against the bare forward on "
        f"the same length-packed batches, {name}, the first {e['stories']} quiz stories in {e['batches']} "
        f"batches (on {machine}, `--sections end_to_end`), each batch through both in turn: "
        f"**{e['ratio']:.3f}x** (target ≤ 1.15x), the median of {rounds} rounds; round by round "
        + _x(e["ratios"])
        + " (bare "
        + ", ".join(f"{t:.1f} s" for t in sec["bare"])
        + "; score "
        + ", ".join(f"{t:.1f} s" for t in sec["score"])
        + ", of which name vocabulary, encoding, the induction test on random tokens and the table "
        + ", ".join(f"{t:.2f} s" for t in sec["fixed"])
        + ")."
        + _throughput(e),
        "",
        "Where the time goes, each over the bare forward on the same batches, round by round: the recording "
        "with every map formed and handed to a measure that does nothing, "
        + _x(parts["maps"])
        + "; handing over what score's measures read besides (key columns, value and output norms), "
        + _x(parts["maps and inputs"])
        + "; score's measures fed, "
        + _x(parts["recording"])
        + "; with the top examples kept too, "
        + _x(parts["recording and examples"])
        + "; the steps outside the recording make the rest.",
    ]
    whole = e.get("whole_ratios")
    if whole:
        out += [
            "",
            "The check, in the same rounds: whole `score_heads` runs against whole bare passes over every batch, "
            "one after the other (a minute each, so a shared machine's drift between them falls on one side): "
            + _x(whole)
            + ".",
        ]
    return out


def table(r: dict) -> str:
    speeds = [m["speed"] for m in r["models"].values() if "speed" in m]
    rounds = speeds[0].get("rounds", r["rounds"]) if speeds else r["rounds"]  # a section keeps its run's rounds
    cpu = speeds[0].get("machine", r["cpu"]) if speeds else r["cpu"]  # and its processor (--merge)
    rows = [
        f"Measured by `python benchmarks/bench_record.py` on {cpu} ({r['cores']} cores, torch {r['torch']}, "
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
            rows += ["", *_end_to_end(e, NAMES[kind], e.get("machine", r["cpu"]))]
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
