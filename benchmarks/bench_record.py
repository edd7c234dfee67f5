"""Recording a transformers model's attention at the cost of its own forward pass, side by side.

    python benchmarks/bench_record.py --json benchmarks/record.json [--stories 60] [--rounds 2]
    python benchmarks/bench_record.py --json benchmarks/record.json --merge --sections commands
    python scripts/readme_record_table.py benchmarks/record.json     # the docs' table (docs/benchmarks.md)

Two seeded random transformers models, built and saved here (no hub is reached): a Llama of the
30 x 9-head shape with 3 key/value heads (576 wide, 1,536 in the MLP, 4,096 positions) and a
GPT-2-small shape (12 x 12 heads, 768 wide, 1,024 positions), both with storylens's tokenizer.
Over the first ``--stories`` quiz stories, batched the same way for every side (longest first,
at most 16 stories and 4,096 padded tokens a batch, ``storylens.core.batching``):

* ``bare``: the model's own forward with sdpa attention and no output head: the comparator;
* ``score (raw)``: ``score_heads``' recording (``record`` into a ``HeadScoreAccumulator``) with
  every built-in detector, raw attention only;
* ``score``: the same as ``storylens score`` runs it (also every norm-weighted column and the
  output norms, from the same pass);
* ``score, no sink columns``: ``score`` without the sink and context columns
  (:mod:`storylens.looking.sinks`): what they cost;
* ``score, eager``: the same with transformers' eager attention, the path before storylens's own;
* ``TL patterns``: TransformerLens ``run_with_cache`` keeping only the patterns, over the same
  batches (caching alone, no score computed), where TransformerLens loads the model.

Every side starts from the same encoded stories (tokenizing is in none of them). Sides are
interleaved batch by batch: each batch goes through every side in turn, the first side rotating
from batch to batch, so that every side's time is taken within seconds of the others' (a shared
machine's speed drifts by a fifth over a minute; paired this way the drift falls on every side
alike). A round is one pass over the batches; each ratio is a side's summed time over ``bare``'s
in the same round, the best of ``--rounds`` rounds, and every round's times are kept.

End to end (``end_to_end``): ``storylens score``'s work on the same stories' texts against ``bare``
over the same length-packed batches, paired batch by batch as above. In each round: the name
vocabulary's first pass and the encoding, timed; then every batch through each side in turn (the
first side rotating): ``bare``; ``record``'s step for the batch (its wiring made once a round, as
``record`` makes it once a run, and counted in the side's time) into a measure that asks for the maps alone and does nothing (the attention kernel forming every map);
one that asks for what score's measures read besides (the key columns summed in the kernel, value and
head-output norms) and does nothing; score's measures fed (every detector, the norm-weighted and sink
columns); and those with the top examples, ``storylens.corpus.options.EXAMPLES`` per head and detector
(``BREAKDOWN``); then the induction test on random tokens and the table, timed. ``score`` is the last
side's time plus the timed steps. The figure is the median of the rounds' ratios. As the check, each round then times whole ``score_heads`` runs (as ``storylens score``
calls it) against the bare forward over every batch, alternating which goes first (``whole_ratios``):
whole runs a minute long each, which a shared machine's drift between them moves by a tenth.

Memory: one story of 1,000, 2,000 and 3,000 tokens scored on the Llama, each side in its own
process: peak resident memory above the loaded model (sampled every 5 ms).
Commands: ``storylens report --model`` against ``storylens score --model`` on the Llama, the same
200 quiz stories, each a whole process, in interleaved rounds.

``--sections`` runs only some of ``speed``, ``memory`` and ``commands``; with ``--merge`` the
sections not run are kept from the ``--json`` file already there, and each section says the
machine it was measured on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_perf import _cpu  # noqa: E402
from bench_transformerlens import PeakSampler, rss_mb  # noqa: E402

MODELS = ("llama-30x9", "gpt2-small")
SECTIONS = ("speed", "end_to_end", "memory", "commands")
# end to end, where score's time goes, batch by batch: the recording with a measure that asks for the
# maps alone and does nothing with them; one that asks for what score's measures read besides and does
# nothing; score's measures fed; and those with the top examples. score's time adds to the last the
# name vocabulary, the encoding, the induction score on random tokens and the table.
BREAKDOWN = ("maps", "maps and inputs", "recording", "recording and examples")
MEMORY_TOKENS = (1000, 2000, 3000)


def build(kind: str, folder: Path, vocab: int | None = None) -> Path:
    """A seeded random model of ``kind`` saved in ``folder/kind`` (made once), its vocabulary the shipped
    tokenizer's or ``vocab`` rows (the real model's: SmolLM's 49,152, GPT-2's 50,257; the rows past the
    tokenizer's never read, the output head its real size)."""
    import torch
    import transformers

    from storylens.model.hub import load_model

    out = folder / (kind if vocab is None else f"{kind}-v{vocab}")
    if (out / "config.json").exists():
        return out
    native = load_model().tokenizer
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=native, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    vocab, marker = vocab or native.get_vocab_size(), tok.bos_token_id
    if kind == "llama-30x9":
        cfg = transformers.LlamaConfig(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=4096, vocab_size=vocab,
            bos_token_id=marker, eos_token_id=marker, tie_word_embeddings=True,
        )  # fmt: skip
    else:
        cfg = transformers.GPT2Config(
            n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=vocab,
            bos_token_id=marker, eos_token_id=marker,
        )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def bench_speed(folder: Path, n_stories: int, rounds: int) -> dict:
    import torch

    from storylens.core.batching import BATCH_TOKENS, length_batches
    from storylens.data.names import name_vocabulary
    from storylens.data.stories import load_split
    from storylens.engine.encode import batch_of, encode_stories
    from storylens.engine.record import record
    from storylens.lm import load_lm
    from storylens.table.accumulator import HeadScoreAccumulator

    stories = load_split().quiz[:n_stories]
    lm = load_lm(str(folder))
    model = lm.module
    own = model.config._attn_implementation  # storylens's attention (or eager where it cannot)
    encoded = encode_stories(lm, stories, name_vocabulary(stories))
    order = length_batches([len(s.ids) for s in encoded], 16, BATCH_TOKENS)
    groups = [[encoded[i] for i in idx] for idx in order]
    batches = [batch_of(g, lm.marker_id, lm.device).ids for g in groups]

    def attention(name: str) -> None:
        if model.config._attn_implementation != name:
            model.set_attn_implementation(name)

    def bare(i: int, acc) -> None:
        attention("sdpa")
        with torch.inference_mode():
            lm.forward(batches[i], logits=False)

    def score(faithful: bool, impl: str, sinks: bool = True):
        def run(i: int, acc) -> None:  # score_heads' recording of this batch, into the round's accumulator
            attention(impl)
            if not sinks:
                acc.sinks = None  # the same pass without the sink and context columns (their cost)
            record(lm, groups[i], [acc], progress=False)

        return run, faithful

    sides: dict = {
        "bare": (bare, None),
        "score (raw)": score(False, own),
        "score": score(True, own),
        "score, no sink columns": score(True, own, sinks=False),
        "score, eager": score(True, "eager"),
    }
    tl_note = None
    try:
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers(str(folder), device="cpu")
        bridge.eval()

        def tl(i: int, acc) -> None:
            with torch.inference_mode():
                bridge.run_with_cache(batches[i], names_filter=lambda n: n.endswith("hook_pattern"))

        sides["TL patterns"] = (tl, None)
    except Exception as e:  # noqa: BLE001 (reported, not raised: TransformerLens is optional here)
        tl_note = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    names = list(sides)
    best: dict[str, float] = {}
    ratios: dict[str, float] = {}
    every: dict[str, list[float]] = {name: [] for name in names}
    turn = 0
    for r in range(rounds):
        times = dict.fromkeys(names, 0.0)
        accs = {
            name: None if faithful is None else HeadScoreAccumulator(lm.n_layer, lm.n_head, faithful=faithful)
            for name, (_, faithful) in sides.items()
        }
        for i in range(len(batches)):  # every side on this batch, seconds apart; who goes first rotates
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                fn = sides[name][0]
                t = time.perf_counter()
                fn(i, accs[name])
                times[name] += time.perf_counter() - t
            turn += 1
        for name, t in times.items():
            print(f"  round {r + 1}: {name}: {t:.2f} s ({t / times['bare']:.3f}x bare)", flush=True)
            every[name].append(t)
            best[name] = min(best.get(name, float("inf")), t)
            ratios[name] = min(ratios.get(name, float("inf")), t / times["bare"])
    attention(own)
    tokens = sum(int(ids.numel()) for ids in batches)
    return {
        "stories": n_stories,
        "padded_tokens": tokens,
        "batches": len(batches),
        "attention": own,
        "paired": "batch",
        "seconds": best,
        "ratio": ratios,
        "all_seconds": every,
        "tl_note": tl_note,
    }


def bench_end_to_end(folder: Path, n_stories: int, rounds: int) -> dict:
    """``storylens score``'s work against the bare forward over the same length-packed batches, paired
    batch by batch, with its fixed costs measured in the same round; and whole ``score_heads`` runs
    against whole bare passes, alternating, as the check (see the module docstring)."""
    import torch

    from storylens.analysis import score_heads
    from storylens.core.batching import BATCH_TOKENS, length_batches
    from storylens.core.modes import eval_mode
    from storylens.corpus.options import EXAMPLES
    from storylens.data.names import name_vocabulary
    from storylens.data.stories import load_split
    from storylens.engine.encode import BATCH_STORIES, batch_of, encode_stories
    from storylens.engine.record import Needs, RecordStats, _Pass, plan
    from storylens.lm import load_lm
    from storylens.table.accumulator import HeadScoreAccumulator
    from storylens.table.scores import score_table

    stories = load_split().quiz[:n_stories]
    lm = load_lm(str(folder))
    model = lm.module
    own = model.config._attn_implementation
    encoded = encode_stories(lm, stories, name_vocabulary(stories))
    # the batches score_heads makes: one chunk (CHUNK_STORIES >= the quiz), length-packed
    order = length_batches([len(s.ids) for s in encoded], BATCH_STORIES, BATCH_TOKENS)
    made = [batch_of([encoded[i] for i in idx], lm.marker_id, lm.device) for idx in order]
    batches = [b.ids for b in made]
    tokens = int(sum(int(b.lengths.sum()) for b in made))  # the stories' tokens, each opening marker included

    def bare_batch(i: int, _encoded, _acc) -> None:
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            lm.forward(batches[i], logits=False)
        model.set_attn_implementation(own)

    def recorded(i: int, encoded_now, wiring) -> None:  # record's step for this batch, into the round's measure
        with eval_mode(lm.module), torch.inference_mode(), wiring.context():
            wiring.run(batch_of([encoded_now[j] for j in order[i]], lm.marker_id, lm.device))

    class Idle:  # a measure that asks for what ``needs`` says and does nothing with it
        def __init__(self, needs) -> None:
            self.needs = needs

        def begin(self, batch) -> None: ...

        def feed(self, chunk) -> None: ...

        def end(self) -> None: ...

    faithful_needs = HeadScoreAccumulator(lm.n_layer, lm.n_head, faithful=True).needs
    measures: dict[str, Callable[[], object]] = {  # each side's measure, fresh every round
        "bare": lambda: None,
        "maps": lambda: Idle(Needs()),
        "maps and inputs": lambda: Idle(faithful_needs),
        "recording": lambda: HeadScoreAccumulator(lm.n_layer, lm.n_head, faithful=True),
        "recording and examples": lambda: HeadScoreAccumulator(lm.n_layer, lm.n_head, examples=EXAMPLES),
    }
    runs = {name: (bare_batch if name == "bare" else recorded) for name in measures}
    names = list(measures)
    score_heads(lm, stories[:2], progress=False)  # warm
    every: dict[str, list[float]] = {name: [] for name in [*names, "fixed", "score"]}
    whole: dict[str, list[float]] = {"bare": [], "score": []}
    ratios, whole_ratios = [], []
    turn = 0
    for r in range(rounds):
        # score's own steps outside the recording, as score_heads takes them: the name vocabulary's
        # pass and the encoding here, the induction test on random tokens and the table at the end
        t = time.perf_counter()
        encoded_now = encode_stories(lm, stories, name_vocabulary(stories))
        fixed = time.perf_counter() - t
        times = dict.fromkeys(names, 0.0)
        accs, wirings = {}, {}
        for name, make in measures.items():  # each side's recording wired once a round, as record wires it once a run
            t = time.perf_counter()
            accs[name] = make()
            if name != "bare":
                wirings[name] = _Pass(lm, [accs[name]], plan(lm, [accs[name]]))
            times[name] += time.perf_counter() - t
        for i in range(len(batches)):  # every side on this batch, seconds apart; who goes first rotates
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                t = time.perf_counter()
                runs[name](i, encoded_now, wirings.get(name))
                times[name] += time.perf_counter() - t
            turn += 1
        stats = RecordStats(
            len(encoded_now), sum(s.cut for s in encoded_now), sum(s.main is not None for s in encoded_now)
        )
        t = time.perf_counter()
        score_table(accs["recording and examples"], stats, None, lm.window, lm)
        fixed += time.perf_counter() - t
        for name in names:
            every[name].append(times[name])
        every["fixed"].append(fixed)
        every["score"].append(times["recording and examples"] + fixed)
        ratios.append(every["score"][-1] / times["bare"])
        # the check: whole runs, score_heads as storylens score calls it against the bare forward over
        # every batch, alternating which goes first
        for side in ("bare", "score") if r % 2 == 0 else ("score", "bare"):
            t = time.perf_counter()
            if side == "bare":
                for i in range(len(batches)):
                    bare_batch(i, None, None)
            else:
                score_heads(lm, stories, batch_size=BATCH_STORIES, examples=EXAMPLES, progress=False)
            whole[side].append(time.perf_counter() - t)
        whole_ratios.append(whole["score"][-1] / whole["bare"][-1])
        print(
            f"  end to end, round {r + 1}: paired by batch: bare {times['bare']:.1f} s, score "
            f"{every['score'][-1]:.1f} s (fixed {fixed:.2f} s): {ratios[-1]:.3f}x bare; "
            + ", ".join(f"{name} {times[name] / times['bare']:.3f}x" for name in BREAKDOWN)
            + f"; whole runs: bare {whole['bare'][-1]:.1f} s, score {whole['score'][-1]:.1f} s: {whole_ratios[-1]:.3f}x",
            flush=True,
        )
    return {
        "stories": n_stories,
        "batches": len(batches),
        "tokens": tokens,
        "padded_tokens": int(sum(b.numel() for b in batches)),
        "attention": own,
        "examples": EXAMPLES,
        "paired": "batch",
        "seconds": every,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "breakdown": {name: [t / b for t, b in zip(every[name], every["bare"])] for name in BREAKDOWN},
        "whole_seconds": whole,
        "whole_ratios": whole_ratios,
    }


def memory_child(folder: str, tokens: int, impl: str) -> None:
    """One story of ``tokens`` tokens scored in this process; prints JSON."""
    import torch

    from storylens.analysis import score_heads
    from storylens.data.stories import load_split
    from storylens.lm import load_lm

    torch.set_num_threads(2)
    lm = load_lm(folder)
    text = ""
    for story in load_split().quiz:
        text = f"{text} {story}" if text else story
        if len(lm.encode(text)) >= tokens:
            break
    enc = lm.encode_batch([text])[0]
    text = text[: enc.offsets[tokens - 2][1]]  # tokens - 1 of the story's own: the marker opens it
    lm.module.set_attn_implementation(impl)
    score_heads(lm, ["Tom and Sam. " + text[:200]], progress=False)  # warm: kernels, allocator
    loaded = rss_mb()
    with PeakSampler() as peak:
        score_heads(lm, [text], progress=False)
    print(json.dumps({"tokens": tokens, "impl": impl, "loaded_mb": loaded, "above_mb": peak.peak - loaded}))


def bench_memory(folder: Path, own: str) -> list[dict]:
    rows = []
    for tokens in MEMORY_TOKENS:
        for impl in (own, "eager"):
            out = subprocess.run(
                [sys.executable, __file__, "--memory-child", str(folder), str(tokens), impl],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  {tokens} tokens, {impl}: {row['above_mb']:.0f} MB above the loaded model", flush=True)
            rows.append(row)
    return rows


def bench_commands(folder: Path, rounds: int) -> dict:
    """``storylens report --model`` against ``storylens score --model`` on the same quiz (the corpus's
    200 quiz stories, written to a file that both read), each a whole process as a user runs it, in
    interleaved rounds (best of ``rounds``)."""
    from storylens.data.stories import EOT, load_split

    with tempfile.TemporaryDirectory() as tmp:
        quiz = Path(tmp) / "quiz.txt"
        quiz.write_text("".join(f"{s}\n{EOT}\n" for s in load_split().quiz), encoding="utf-8")
        exe = str(Path(sys.executable).with_name("storylens"))
        commands = {
            "score": [exe, "score", "--model", str(folder), "--stories", str(quiz), "--no-progress"],
            "report": [exe, "report", "--model", str(folder), "--quiz", str(quiz), "--no-progress"],
        }
        seconds: dict[str, list[float]] = {k: [] for k in commands}
        for r in range(rounds):
            for name, cmd in commands.items():
                out = Path(tmp) / f"{name}{r}"
                t = time.perf_counter()
                subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True)
                seconds[name].append(time.perf_counter() - t)
                print(f"  storylens {name} --model: {seconds[name][-1]:.1f} s", flush=True)
    best = {k: min(v) for k, v in seconds.items()}
    return {"seconds": best, "all_seconds": seconds, "report_over_score": best["report"] / best["score"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stories", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    ap.add_argument("--no-memory", action="store_true", help="skip the long-story memory runs")
    ap.add_argument("--no-commands", action="store_true", help="skip storylens report against storylens score")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {','.join(SECTIONS)}")
    ap.add_argument("--merge", action="store_true", help="keep the sections not run from the --json file")
    ap.add_argument("--folder", default=None, help="where the random models are saved (default: a temporary folder)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 2, or 1 on one core)")
    ap.add_argument("--memory-child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        folder, tokens, impl = args.memory_child
        memory_child(folder, int(tokens), impl)
        return
    import torch
    import transformers

    torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.folder or tmp)
        result: dict = {
            "cpu": _cpu(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "rounds": args.rounds,
            "models": {},
        }
        sections = {x for x in args.sections.split(",") if x}
        if sections - set(SECTIONS):
            raise SystemExit(f"--sections: choose from {', '.join(SECTIONS)}")
        if args.no_memory:
            sections.discard("memory")
        if args.no_commands:
            sections.discard("commands")
        for kind in [m for m in args.models.split(",") if m]:
            if kind not in MODELS:
                raise SystemExit(f"--models: no model {kind!r} (choose from {', '.join(MODELS)})")
            folder = build(kind, base)
            print(f"{kind}:", flush=True)
            entry: dict = {}
            if "speed" in sections:
                speed = bench_speed(folder, args.stories, args.rounds)
                entry["speed"] = speed
                for name, r in speed["ratio"].items():
                    print(f"  {name}: {speed['seconds'][name]:.2f} s, {r:.3f}x bare", flush=True)
            if "end_to_end" in sections:
                entry["end_to_end"] = bench_end_to_end(folder, args.stories, args.rounds)
                print(f"  score end to end: {entry['end_to_end']['ratio']:.3f}x bare", flush=True)
            if kind == "llama-30x9" and "memory" in sections:
                entry["memory"] = bench_memory(folder, entry.get("speed", {}).get("attention", "storylens"))
            if kind == "llama-30x9" and "commands" in sections:
                entry["commands"] = bench_commands(folder, args.rounds)
            for section in entry.values():
                if isinstance(section, dict):  # memory is a list of rows: it is measured with the speed
                    section["machine"], section["rounds"] = result["cpu"], args.rounds
            result["models"][kind] = entry
    if args.merge and args.json and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        for kind, entry in old["models"].items():
            mine = result["models"].setdefault(kind, {})
            for name, section in entry.items():
                if name not in mine:
                    if isinstance(section, dict):
                        section.setdefault("machine", old["cpu"])
                        section.setdefault("rounds", old["rounds"])
                    mine[name] = section
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
