"""The ``storylens`` command.

Every user-fixable problem is one line on stderr and a non-zero exit; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from storylens import __version__
from storylens.analysis.ablation import generation_divergence, name_ablation_table, normalise_heads
from storylens.analysis.audit import AUDIT_HEADS, audit_lines
from storylens.analysis.detectors import BUILTIN_DETECTORS, pattern_detector
from storylens.analysis.encode import BATCH_STORIES, CHUNK_STORIES
from storylens.analysis.gradients import GRAPH_BYTES
from storylens.analysis.perplexity import perplexity
from storylens.analysis.truth import (
    ABLATION_LIMIT_FLOPS,
    OVER_BUDGET_FLAG,
    TRUTH_BUDGET,
    TRUTH_FLOOR_FLOPS,
    TRUTH_STORIES,
    ablate_cost,
    check_ablation_budget,
)
from storylens.core.errors import StorylensError, UsageError
from storylens.core.heads import head_label, parse_head_label
from storylens.core.offline import hub_offline
from storylens.core.progress import NO_PROGRESS_HELP, progress_command
from storylens.core.publish import check_target_folder, write_text_atomic
from storylens.corpus.ray_engine import check_address
from storylens.corpus.score import EXAMPLES, EXAMPLES_BUDGET, ScoreOptions, score_corpus
from storylens.data.sources import open_source
from storylens.data.stories import download_tinystories, load_split
from storylens.lesson.checks import lesson_note, run_checks
from storylens.lesson.figures import DIVERGENCE_PROMPT, FIRST_STORIES, LESSON_FIGURES, PREV_HEAD_LEVEL
from storylens.lesson.inputs import lesson_data
from storylens.lesson.page import PRACTITIONER, SECTIONS
from storylens.lesson.report import ReportOptions, _quiz_folder, build_report, parse_sections
from storylens.lesson.tables import f3
from storylens.lm import NativeLM, is_transformers_folder, load_lm, resolve_device, resolve_dtype
from storylens.lm.generate import record_generation, stream_text
from storylens.model.gpt import GPT
from storylens.model.hub import export_hf
from storylens.model.tokenizer import encode_story, eot_id
from storylens.training.copying import COPYING_FILE, read_copying
from storylens.training.copying import SAMPLES as COPY_SAMPLES
from storylens.training.page import write_timeline_page
from storylens.training.timeline import TIMELINE_FILE
from storylens.training.train import TrainConfig, export_checkpoint, lesson_files, train, validate_config
from storylens.viz import replay_widget


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and the exit code 2), not a usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_model(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    """``--model``, ``--allow-download``, ``--device`` and (unless the command has a ``--dtype`` of
    its own: ``check``) ``--dtype``."""
    p.add_argument("--model", default=None, help="model folder or hub id (default: the shipped Tiny Storyteller)")
    p.add_argument("--allow-download", action="store_true", help="let --model fetch a hub id over the network")
    p.add_argument("--device", default=None, help="run the model on cpu, cuda, cuda:N or mps (default cpu)")
    if dtype:
        p.add_argument(
            "--dtype",
            dest="model_dtype",
            choices=["float32", "float64", "bfloat16", "float16"],
            default=None,
            help="run the model in this precision (default: as stored)",
        )


OVER_BUDGET_HELP = (
    f"start even where the ablations' estimate (said before they start) passes {ABLATION_LIMIT_FLOPS / 1e12:g} "
    "TFLOP; without it such a run is refused"
)


def _load(args):
    """The ``--model``: a storylens folder, a transformers folder or a hub id, as an AttentionLM,
    in ``--dtype`` on ``--device``."""

    device = resolve_device(getattr(args, "device", None), "--device")
    dtype = resolve_dtype(getattr(args, "model_dtype", None), "--dtype")
    if getattr(args, "engine", None) == "ray" and (device is not None or dtype is not None):
        # each Ray actor loads --model itself, as stored on its CPU: refused rather than ignored
        raise UsageError("--device and --dtype: only with --engine local (Ray actors load the model as stored)")
    return load_lm(args.model, allow_download=args.allow_download, dtype=dtype, device=device)


def _load_native(args, what: str) -> GPT:
    """A storylens model (the commands about storylens's own attention paths, KV cache and export);
    a transformers folder is refused before it is loaded."""

    wrong = f"{what}: works on storylens's own models; {args.model} is a transformers model"
    if args.model is not None and is_transformers_folder(Path(args.model)):
        raise StorylensError(wrong)
    lm = _load(args)
    if not isinstance(lm, NativeLM):
        raise StorylensError(wrong)
    return lm.module


def load_detector(path: str):
    """A user head detector from a Python file defining ``pattern(ids) -> [batch, query, key]`` key
    weights and, optionally, ``NAME`` (default: the file's stem). The file is run as Python: only
    pass files you wrote or trust."""
    import importlib.util

    file = Path(path)
    if not file.is_file():
        raise StorylensError(f"--detector {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"storylens_detector_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise StorylensError(f"--detector {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error becomes one line
        raise StorylensError(f"--detector {path}: {type(e).__name__}: {_one_line(e)}") from None
    except SystemExit as e:
        raise StorylensError(f"--detector {path}: called sys.exit({e.code!r}) while loading") from None
    fn = getattr(module, "pattern", None)
    if not callable(fn):
        raise StorylensError(f"--detector {path}: defines no function pattern(ids) -> [batch, query, key] weights")
    try:
        return pattern_detector(getattr(module, "NAME", file.stem), fn)
    except ValueError as e:
        raise StorylensError(f"--detector {path}: {e}") from None


def _out_path(value: str, option: str = "--out") -> Path:
    """An output folder option as a path; an empty one is refused (it would mean the current folder)."""
    if not value.strip():
        raise UsageError(f"{option}: empty; give the output folder a name")
    return Path(value)


def _validate_generate(args) -> None:
    import math

    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("prompt: not valid text (it holds bytes that are not UTF-8)") from None
    if not args.prompt.strip():
        raise UsageError('prompt: empty; give the story\'s first words, e.g. storylens generate "Once upon a time"')
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens: must be 0 or more (got {args.max_new_tokens})")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature: must be a finite number, 0 (greedy) or more (got {args.temperature})")
    if args.top_k < 0:
        raise UsageError(f"--top-k: must be 0 (off) or more (got {args.top_k})")
    _check_seed(args.seed)


def _check_seed(seed: int) -> None:
    """A sampling seed torch takes: 0 to 2^64 - 1 (a negative one would wrap to another seed)."""
    if not 0 <= seed < 2**64:
        raise UsageError(f"--seed: must be between 0 and 2^64 - 1 (got {seed})")


def cmd_generate(args) -> int:
    import itertools

    import torch

    _validate_generate(args)
    if args.html is not None:
        return _generate_recorded(args)
    model = _load(args)
    ids = model.encode(args.prompt)
    if len(ids) + args.max_new_tokens > model.window:
        raise StorylensError(
            f"generate: prompt ({len(ids)} tokens with the opening marker) + --max-new-tokens "
            f"({args.max_new_tokens}) passes the {model.window}-token window; ask for fewer tokens"
        )
    idx = torch.tensor([ids], device=model.device)
    marker = model.marker_id
    gen = torch.Generator(device=model.device).manual_seed(args.seed)
    try:
        steps = model.generate_stream(
            idx,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            generator=gen,
            use_kv_cache=not args.no_cache,
            eos_id=None if args.no_stop else marker,
        )
        out = sys.stdout
        out.write(args.prompt)
        tokens = itertools.takewhile(lambda t: t != marker, (s.token for s in steps))
        for piece in stream_text(model.tokenizer, tokens):  # each piece as soon as its characters are whole
            out.write(piece)
            out.flush()
        out.write("\n")
    except ValueError as e:
        raise StorylensError(f"generate: {e}") from None
    return 0


def _generate_recorded(args) -> int:
    """``generate --record --html FILE``: the story, then a page that replays its writing."""

    if args.no_cache:
        raise UsageError("--record: records the KV-cached generation; drop --no-cache")
    out = Path(args.html)
    if out.is_dir():
        raise StorylensError(f"{out}: is a folder; give an .html file name")
    model = _load(args)
    run = record_generation(
        model,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        seed=args.seed,
        stop_at_marker=not args.no_stop,
    )
    tok = model.tokenizer
    print(args.prompt + tok.decode(run.ids[run.prompt_len :]))
    write_text_atomic(out, replay_widget(run, tok).to_html())
    print(
        f"replay written to {out} ({len(run.ids) - run.prompt_len} tokens, each with its recorded attention)",
        file=sys.stderr,
    )
    return 0


def cmd_train(args) -> int:
    from dataclasses import fields

    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    cfg = TrainConfig(**overrides)
    validate_config(cfg)
    if args.first is not None and args.first < 201:
        raise UsageError(f"--first: at least 201 stories (200 for the quiz and one to train on), got {args.first}")
    if args.copying_samples < 0:
        raise UsageError(f"--copying-samples: 0 or more (got {args.copying_samples})")
    split = load_split(args.stories, first=args.first)
    try:
        with progress_command("train"):
            result = train(
                split,
                _out_path(args.out),
                cfg,
                resume=args.resume,
                copying_samples=args.copying_samples,
                progress=not args.no_progress,
            )
    except KeyboardInterrupt as e:
        print(f"\n{e or 'interrupted'}; continue with --resume", file=sys.stderr)
        return 130
    state = result["state"]
    evals = state["evals"]
    if evals:
        print(f"quiz perplexity {evals[-1]['quiz_perplexity']:.3f} after {state['step']} steps")
        share = state.get("timeline_seconds", 0.0) / max(state["train_seconds"], 1e-9)
        print(
            f"head timeline: {len(evals)} evaluations in {Path(args.out) / TIMELINE_FILE} "
            f"({state.get('timeline_seconds', 0.0):.1f} s, {100 * share:.1f}% of the training steps' time)"
        )
    copied = read_copying(args.out)
    if copied is not None and copied["share"] is not None:
        print(
            f"copying: {100 * copied['share']:.1f}% of the 8-word runs in {copied['samples']} generated stories "
            f"occur in the training stories ({Path(args.out) / COPYING_FILE})"
        )
    if args.export:
        folder = export_checkpoint(Path(args.out), _out_path(args.export, "--export"), lesson_files(split))
        print(f"model folder written to {folder}")
    return 0


def cmd_timeline(args) -> int:
    if args.heads < 1:
        raise UsageError(f"--heads: at least 1 (got {args.heads})")
    out = write_timeline_page(args.runs, _out_path(args.out), k=args.heads)
    print(f"head timeline of {len(args.runs)} run(s) written to {out / 'timeline.html'}")
    return 0


def cmd_export_hf(args) -> int:

    model = _load_native(args, "export-hf")
    folder = export_hf(model, _out_path(args.dir, "dir"))
    print(f"transformers GPT2LMHeadModel written to {folder}")
    return 0


def cmd_perplexity(args) -> int:

    lm = _load(args)
    data = lesson_data(_quiz_folder(lm), args.stories)
    print(f"quiz perplexity {perplexity(lm, data.quiz):.3f} ({data.quiz_source})")
    return 0


def cmd_data_download(args) -> int:

    path = download_tinystories(args.split)
    print(f"TinyStories {args.split} split: {path}")
    print(
        f"use it with --stories tinystories{'-valid' if args.split == 'valid' else ''} "
        f"(e.g. storylens train --stories tinystories --first 20000, the lesson's recipe)"
    )
    return 0


def _check_stories(model: GPT, args) -> tuple[list[list[int]], str]:
    """The quiz (the corpus's, else the one shipped with the model), cut to the window; for a model
    with neither, stories the model writes itself."""
    import torch

    window, tokenizer = model.config.block_size, model.tokenizer
    assert tokenizer is not None  # _load_native's model was wrapped, which needs its tokenizer
    try:
        data = lesson_data(getattr(model, "source_folder", None), args.stories)
    except StorylensError as e:
        if args.stories is not None:
            raise
        device = next(model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(0)
        ids = []
        for _ in range(args.n_stories or 8):
            out = model.generate(
                torch.tensor([[eot_id(tokenizer)]], device=device),
                window - 1,
                temperature=0.8,
                top_k=40,
                generator=gen,
            )
            ids.append(out[0].tolist())
        return ids, f"{len(ids)} stories the model wrote (no corpus: {str(e).split(':')[-1].strip()})"
    quiz = data.quiz[: args.n_stories] if args.n_stories else data.quiz
    return [encode_story(tokenizer, s, window).ids for s in quiz], f"{len(quiz)} quiz stories"


def cmd_check(args) -> int:
    import json
    import platform

    import torch

    if args.n_stories is not None and args.n_stories < 1:
        raise UsageError("--n-stories: must be at least 1")
    if not 1 <= args.gen_tokens:
        raise UsageError("--gen-tokens: must be at least 1")
    model = _load_native(args, "check")
    ids, source = _check_stories(model, args)
    dtypes = {"both": (torch.float32, torch.float64), "float32": (torch.float32,), "float64": (torch.float64,)}
    checks = run_checks(model, ids, dtypes=dtypes[args.dtype], gen_tokens=args.gen_tokens)
    cpu = _cpu_name()
    print(
        f"storylens check on {cpu} (torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()} kernels, "
        f"{platform.machine()}), {source}"
    )
    print(f"{'check':34} {'dtype':8} {'measured':>10} {'bound':>10} {'lesson':>8}  ok  detail")
    for c in checks:
        lesson = f"{c.lesson:.0e}" if c.lesson is not None else ""
        print(
            f"{c.name:34} {c.dtype:8} {c.measured:10.2e} {c.bound:10.2e} {lesson:>8}  "
            f"{'yes' if c.passed else 'NO '}  {c.detail}"
        )
    print("bounds: rounding alone (see storylens.lesson.checks); beside the lesson's figures:")
    for c in checks:
        if c.lesson is not None:
            print(f"  {c.name} ({c.dtype}): {lesson_note(c)}")
    if args.json:
        write_text_atomic(
            Path(args.json),
            json.dumps(
                {"cpu": cpu, "torch": torch.__version__, "stories": source, "checks": [c.to_dict() for c in checks]},
                indent=1,
            ),
        )
    failed = [c for c in checks if not c.passed]
    if failed:
        print(
            f"storylens: error: {len(failed)} check(s) past their bound: "
            + ", ".join(f"{c.name} ({c.dtype})" for c in failed),
            file=sys.stderr,
        )
        return 1
    return 0


def _cpu_name() -> str:
    import platform

    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# `storylens --help` lists the commands as a newcomer meets them: the lesson's report, watching the model
# write, then any corpus and any model (score, ablate, patch), the checks, the data, training last.
COMMAND_ORDER = (
    "report",
    "generate",
    "score",
    "ablate",
    "patch",
    "check",
    "perplexity",
    "data",
    "train",
    "timeline",
    "export-hf",
)
DESCRIPTION = (
    "Read the attention heads of Tiny Storyteller (shipped) or any transformers causal LM: where each head "
    "looks, what it moves, attention sinks and dormant heads, and causal effects, over any corpus."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``storylens`` parser: global options, then one subparser per command (its ``func``)."""

    p = _Parser(prog="storylens", description=DESCRIPTION)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"storylens {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (  # in the order a newcomer meets them: COMMAND_ORDER
        add_report_parser,
        add_generate_parser,
        add_score_parser,
        add_ablate_parser,
        add_patch_parser,
        add_check_parser,
        add_perplexity_parser,
        add_data_parser,
        add_train_parser,
        add_timeline_parser,
        add_export_parser,
    ):
        add(sub)
    return p


def _add_quiz_stories(p: argparse.ArgumentParser) -> None:
    """``--stories``: the corpus whose last 200 stories are the quiz (``perplexity``, ``ablate``)."""
    p.add_argument(
        "--stories",
        default=None,
        help="corpus whose last 200 stories are the quiz "
        "(default: the shared corpus, else the quiz shipped with the model)",
    )


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="write a story from a prompt (KV-cached, streamed)")
    g.add_argument("prompt", help="the story's first words")
    g.add_argument("--max-new-tokens", type=int, default=150, help="at most this many new tokens (default 150)")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens; 0 for all (default 40)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed, 0 to 2^64 - 1 (default 0)")
    g.add_argument("--record", action="store_true", help="record every new token's attention (use with --html)")
    g.add_argument(
        "--html",
        default=None,
        metavar="FILE",
        help="with --record: write a page that replays the writing, token by token, with its attention",
    )
    g.add_argument("--no-cache", action="store_true", help="recompute everything each step (slow reference)")
    g.add_argument("--no-stop", action="store_true", help="keep going past the end-of-story marker")
    _add_model(g)
    g.set_defaults(func=cmd_generate)


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train Tiny Storyteller on the training stories")
    t.add_argument("--stories", default=None, help="corpus file (default: ../shared/data/tinystories/stories.txt.gz)")
    t.add_argument("--out", default="runs/tiny-storyteller", help="run folder (checkpoint, tokenizer)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    t.add_argument("--export", default=None, help="write a model folder here when done")
    t.add_argument(
        "--copying-samples",
        type=int,
        default=COPY_SAMPLES,
        metavar="N",
        help=f"when done, generate N stories and count their 8-word runs found in the training stories "
        f"(default {COPY_SAMPLES}; 0: skip)",
    )
    t.add_argument(
        "--first",
        type=int,
        default=None,
        metavar="N",
        help="use only the corpus's first N stories (the lesson: --stories tinystories --first 20000)",
    )
    _add_train_config(t)
    t.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    t.set_defaults(func=cmd_train)


def _add_train_config(t: argparse.ArgumentParser) -> None:
    """One option per :class:`TrainConfig` field a run may change (``--max-steps``, ``--lr``, ...),
    unset by default so the config's own default (named in the help) holds."""
    d = TrainConfig()
    for name in (
        "max_steps",
        "batch_size",
        "eval_every",
        "seed",
        "warmup_steps",
        "vocab_size",
        "n_layer",
        "n_head",
        "n_embd",
    ):
        t.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {getattr(d, name)}")
    for name in ("lr", "min_lr", "weight_decay", "dropout", "attn_dropout", "ema_decay", "checkpoint_minutes"):
        t.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=f"default {getattr(d, name)}")
    t.add_argument(
        "--dtype", choices=["fp32", "bf16"], default=None, help="default fp32 (bf16 autocast is slower here)"
    )


def add_timeline_parser(sub) -> None:
    tl = sub.add_parser("timeline", help="figures and a page of heads forming over training runs")
    tl.add_argument("runs", nargs="+", help="training run folders (or their heads_timeline.jsonl, or exported models)")
    tl.add_argument("--out", default="timeline", help="folder for timeline.html and the PNG/SVG figures")
    tl.add_argument("--heads", type=int, default=3, help="strongest heads drawn per detector (default 3)")
    tl.set_defaults(func=cmd_timeline)


def add_export_parser(sub) -> None:
    e = sub.add_parser("export-hf", help="export to a transformers GPT2LMHeadModel folder")
    e.add_argument("dir", help="the folder to write (new, empty, or an earlier export)")
    _add_model(e)
    e.set_defaults(func=cmd_export_hf)


def add_perplexity_parser(sub) -> None:
    q = sub.add_parser("perplexity", help="quiz perplexity of a model")
    _add_quiz_stories(q)
    _add_model(q)
    q.set_defaults(func=cmd_perplexity)


def add_check_parser(sub) -> None:
    c = sub.add_parser("check", help="measure the lesson's numerical promises on this machine (float32 and float64)")
    c.add_argument("--stories", default=None, help="corpus whose quiz is used (default: the shared corpus)")
    c.add_argument("--n-stories", type=int, default=None, help="use only the first N quiz stories")
    c.add_argument("--gen-tokens", type=int, default=200, help="tokens generated with and without the cache")
    c.add_argument(
        "--dtype",
        choices=["both", "float32", "float64"],
        default="both",
        help="precision(s) to measure in (default both)",
    )
    c.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    _add_model(c, dtype=False)  # its own --dtype: the precision(s) measured in
    c.set_defaults(func=cmd_check)


def add_data_parser(sub) -> None:
    dd = sub.add_parser("data", help="the TinyStories corpus: storylens data download")
    dsub = dd.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    dl = dsub.add_parser("download", help="fetch TinyStories from the Hugging Face Hub into the user cache")
    dl.add_argument(
        "--split",
        choices=["train", "valid"],
        default="train",
        help="train (1.9 GB, what the lesson trains on) or valid (19 MB); default train",
    )
    dl.set_defaults(func=cmd_data_download, allow_download=True)


# ---------------------------------------------------------------- report and ablate


def print_summary(report, file=None) -> None:
    """``storylens report``'s printout: the report's summary (a :class:`storylens.lesson.summary.ReportSummary`)."""

    file = file or sys.stdout
    s = report.summary
    q, mk = s.quiz, s.marker

    def p(*a) -> None:
        print(*a, file=file)

    p(
        f"quiz: {q.stories} stories ({q.cut_to_window} cut to the window), "
        f"{q.with_main_character} with a main character, {q.name_scored} scored"
    )
    if s.name_heads is not None:  # the lesson's section ran
        _print_lesson(s, p)
    else:
        p(f"{mk.called.removeprefix('the ')}: highest {mk.highest.head} {f3(mk.highest.marker)}")
        p(f"sections: {', '.join(s.sections or [])} (--sections lesson for the lesson's figures)")
    p(f"report written to {report.out / 'report.html'} in {report.timings['total']:.1f} s")


def _print_lesson(s, p) -> None:
    """The lesson's part of the printout: the leakage check, the name heads, the previous-token and
    marker heads, the number to reproduce."""
    lk, nh, pt, mk, nr = s.leakage, s.name_heads, s.previous_token, s.marker, s.number_to_reproduce
    if lk.stats is not None:
        st = lk.stats
        p(
            f"leakage ({lk.source}): {st.n_duplicates} identical, {st.n_mentioning} mention {st.word!r}, "
            f"{st.run_words}-word runs in training: mean {f3(st.run_share_mean)}, max {f3(st.run_share_max)}"
        )
    else:
        p(f"leakage: {lk.source}")
    p("")
    p(f"{'head':6} {'name mass':>10} {'baseline':>9} {'ratio':>6}")
    for h in nh.top:
        p(f"{h.head:6} {h.name_mass:10.3f} {nh.baseline:9.3f} {h.ratio:5.1f}x")
    p(f"{nh.below_baseline} of {s.model.n_heads} heads below the baseline")
    p("")
    first, argmax = pt.highest_first, pt.best_argmax_first
    p(
        f"previous-token heads above {PREV_HEAD_LEVEL}: {pt.above_half}; highest {pt.highest.head} "
        f"{f3(pt.highest.prev_token)}; first {first.stories} stories: {first.head} {f3(first.prev_token)} "
        f"(last four {f3(first.prev4)}), best top-key share {argmax.head} {f3(argmax.share)}"
    )
    p(f"{mk.called.removeprefix('the ')}: highest {mk.highest.head} {f3(mk.highest.marker)}")
    p("")
    p(
        f"top name head: {nr.head}  name mass {nr.name_mass:.3f} vs baseline {nr.baseline:.3f} "
        f"({nr.ratio:.1f}x) over {nr.stories} of {nr.of} stories"
    )


def add_report_parser(sub) -> None:
    r = sub.add_parser("report", help="run the whole lesson and write report.html, heads.csv/json and figures")
    _add_model(r)
    _add_examples(r)
    _add_causal(r)
    r.add_argument(
        "--truth-stories",
        type=int,
        default=None,
        metavar="N",
        # argparse formats help with %: the budget's percent sign is written %% (one shows)
        help="switch each detector's strongest heads off on the first N quiz stories, for the table of what "
        f"heads look at, move and matter for (default: up to {TRUTH_STORIES}, as many as cost at most "
        f"{TRUTH_BUDGET:.0%}% of the scoring pass or {TRUTH_FLOOR_FLOPS / 1e12:g} TFLOP; 0: leave the table out); "
        f"an N given says its cost once scoring ends and past {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP needs "
        f"{OVER_BUDGET_FLAG}",
    )
    r.add_argument(
        "--stories",
        default=None,
        help="the corpus (split: last 200 stories = quiz; default: the "
        "shared corpus if present, else the quiz and leakage check shipped with the model)",
    )
    r.add_argument(
        "--quiz",
        default=None,
        help="score every story of this file instead of the corpus's quiz "
        "(text with <|endoftext|> lines, .jsonl, .parquet or a saved dataset folder)",
    )
    r.add_argument(
        "--text-field",
        default="text",
        help="with --quiz: the story's field in JSON lines, Parquet or a dataset (default text)",
    )
    r.add_argument("--out", default="report", help="output folder (default: report)")
    r.add_argument(
        "--word",
        default=LESSON_FIGURES.leakage_word,
        help=f"leakage check: count quiz stories mentioning this word (default {LESSON_FIGURES.leakage_word})",
    )
    r.add_argument(
        "--detector",
        action="append",
        default=[],
        metavar="FILE",
        help="add a head detector: a Python file defining pattern(ids) -> key weights "
        "[batch, query, key] (and optionally NAME); may be given more than once",
    )
    r.add_argument(
        "--prev-limit",
        type=int,
        default=FIRST_STORIES,
        help=f"previous-token figures also over the first N stories (lesson: {FIRST_STORIES})",
    )
    r.add_argument("--batch-size", type=int, default=16, help="stories per recorded forward pass (default 16)")
    r.add_argument(
        "--beyond",
        action="store_true",
        help="also switch heads off, control for position, and measure pronouns (slower)",
    )
    r.add_argument(
        "--sections",
        default=None,
        metavar="A,B",
        help=f"the page's sections, any of {','.join(SECTIONS)} (default: every one for storylens's own model; "
        f"for another model {','.join(PRACTITIONER)}: what a practitioner reads, the lesson left out)",
    )
    r.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    r.add_argument(OVER_BUDGET_FLAG, action="store_true", help=OVER_BUDGET_HELP)
    r.set_defaults(func=_cmd_report)


def _cmd_report(args) -> int:

    options = ReportOptions(
        stories=args.stories,
        quiz=args.quiz,
        text_field=args.text_field,
        word=args.word,
        prev_limit=args.prev_limit,
        batch_size=args.batch_size,
        beyond=args.beyond,
        progress=not args.no_progress,
        detectors=tuple(load_detector(f) for f in args.detector),
        examples=args.examples,
        causal=args.causal,
        graph_memory=args.graph_memory,
        truth_stories=args.truth_stories,
        over_budget=args.over_budget,
        sections=None if args.sections is None else parse_sections(args.sections),
    )
    out = _out_path(args.out)
    check_target_folder(out)  # before the model or any story: a bad --out costs nothing
    report = build_report(out, model=_load(args), options=options)
    print_summary(report)
    return 0


def add_ablate_parser(sub) -> None:
    a = sub.add_parser("ablate", help="switch heads off and measure the loss on the main character's name")
    a.add_argument(
        "--heads",
        nargs="*",
        default=None,
        help="only these heads, e.g. L4H2 L5H1: each alone, then "
        "all together (default: every head alone, plus the top three name heads together)",
    )
    a.add_argument(
        "--mode",
        choices=["zero", "mean"],
        default=None,
        help="replace a head's output by zeros or by its mean output (default: both)",
    )
    _add_model(a)
    _add_quiz_stories(a)
    a.add_argument("--quiz", default=None, help="measure on every story of this file instead")
    a.add_argument("--prompt", default=DIVERGENCE_PROMPT, help="prompt for the generation side-by-side")
    a.add_argument(
        "--seed", type=int, default=0, help="sampling seed for the side-by-side generation, 0 to 2^64 - 1 (default 0)"
    )
    a.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    a.add_argument(OVER_BUDGET_FLAG, action="store_true", help=OVER_BUDGET_HELP)
    a.set_defaults(func=_cmd_ablate)


def _cmd_ablate(args) -> int:

    modes = (args.mode,) if args.mode else ("zero", "mean")
    _check_seed(args.seed)
    heads = None
    if args.heads:  # wrong on its face: refused before the model loads
        try:
            heads = [head_label(*parse_head_label(h)) for h in args.heads]
        except ValueError as e:
            raise UsageError(f"--heads: {e}") from None
    model = _load(args)
    stories = lesson_data(_quiz_folder(model), args.stories, args.quiz, quiz_option="--quiz").quiz
    # --heads: those heads alone (one row each) and, two or more, together; none: every head
    # alone plus the top three name heads together
    group = heads if heads is None or len(heads) > 1 else []
    if heads:
        normalise_heads(model, heads)  # a head the model lacks: refused before anything is estimated
    lengths = [min(len(model.encode(s)), model.window) for s in stories]
    cost = ablate_cost(model, lengths, heads, modes, group=3 if group is None else len(group))
    check_ablation_budget(cost, "ablate", over=args.over_budget)  # said before it starts; refused past the budget
    with progress_command("ablate"):  # off a terminal: a progress line every few seconds
        table = name_ablation_table(
            model, stories, name_heads=group, heads=heads, modes=modes, progress=not args.no_progress
        )
    print(table.format())
    first = heads[0] if heads else table.rows[-1].label.split("+")[0]
    d = generation_divergence(
        model,
        args.prompt,
        heads or [first],
        seed=args.seed,
        max_new_tokens=80,
        mode=modes[0],
        temperature=0.8,
        top_k=40,
    )
    print()
    print(d.format())
    sys.stdout.flush()
    return 0


def add_patch_parser(sub) -> None:
    p = sub.add_parser(
        "patch", help="every head's effect on a task of clean/corrupt pairs (attribution and exact patching)"
    )
    p.add_argument(
        "--pairs",
        default=None,
        help='a .jsonl file, one {"clean", "corrupt", "answer", "wrong"} object a line '
        "(default: the example pairs shipped with storylens, names in the stories' style)",
    )
    p.add_argument("--out", required=True, help="output folder: patch.csv, patch.json, patch.html")
    p.add_argument(
        "--exact",
        default=None,
        metavar="all|K",
        help="heads patched exactly: all, or the top K by |atp| (default: all while heads x pairs <= 1000, "
        "else the top 1000 // pairs)",
    )
    _add_model(p)
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.set_defaults(func=_cmd_patch)


def _cmd_patch(args) -> int:
    from storylens.analysis.patching import EXAMPLE_PAIRS, encode_pairs, patch_heads, read_pairs, write_patch
    from storylens.core.progress import ProgressLines

    exact: str | int | None = args.exact
    if args.exact is not None and args.exact != "all":
        if not args.exact.isdigit():
            raise UsageError(f"--exact: {args.exact!r}; give all or a number of heads")
        exact = int(args.exact)
    out = _out_path(args.out)
    check_target_folder(out)  # before the model: a bad --out costs nothing
    source = Path(args.pairs) if args.pairs is not None else EXAMPLE_PAIRS
    rows = read_pairs(source)  # bad lines refused before the model loads
    model = _load(args)
    pairs = encode_pairs(model, rows, source.name)
    lines = ProgressLines("patching", 2 * len(pairs), unit="pairs", enabled=not args.no_progress)
    with progress_command("patch"):
        result = patch_heads(model, pairs, exact=exact, progress=lines.update)
    write_patch(out, result, model, pairs)
    print(result_summary(result))
    return 0


def result_summary(result) -> str:
    """What ``storylens patch`` prints: the metrics and the ten heads of largest effect."""
    from storylens.analysis.patching import summary_lines

    return "\n".join(summary_lines(result))


def add_score_parser(sub) -> None:

    s = sub.add_parser("score", help="score every head over any corpus (streamed; checkpointed; on Ray if asked)")
    s.add_argument(
        "--stories",
        required=True,
        metavar="SRC",
        help="a .txt/.gz file with <|endoftext|> lines, .jsonl, .parquet, a saved Hugging Face dataset "
        "folder, or hf:OWNER/NAME (the local cache, or the hub with --allow-download)",
    )
    s.add_argument("--out", required=True, help="output folder: heads.csv, heads.json, summary.json")
    s.add_argument("--text-field", default="text", help="the story's field in JSON lines, Parquet or a dataset")
    s.add_argument(
        "--split",
        default=None,
        help="a Hugging Face dataset's split (default train; refused for a source without splits)",
    )
    s.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N stories")
    s.add_argument(
        "--batch-size",
        type=int,
        default=BATCH_STORIES,
        help=f"stories per forward pass (default {BATCH_STORIES}: on a CPU nearly as fast as more, with "
        "less peak memory; raise it on a GPU)",
    )
    s.add_argument(
        "--chunk-stories",
        type=int,
        default=CHUNK_STORIES,
        help=f"stories encoded and batched together, the unit of checkpoints and of Ray work (default {CHUNK_STORIES})",
    )
    s.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        metavar="N",
        help="write a checkpoint after every N batches (at the end of a chunk; default 50)",
    )
    s.add_argument("--resume", action="store_true", help="go on from the checkpoint an interrupted run left")
    s.add_argument("--engine", choices=["local", "ray"], default="local", help="this process, or Ray actors")
    s.add_argument("--workers", type=int, default=2, help="with --engine ray: how many actors (default 2)")
    s.add_argument("--address", default=None, help="with --engine ray: join this cluster (default: a local Ray)")
    s.add_argument("--detector", action="append", default=[], metavar="FILE", help="add a head detector (see report)")
    _add_examples(s)
    _add_causal(s)
    _add_audit(s)
    s.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    _add_model(s)
    s.set_defaults(func=cmd_score)


def _add_audit(s) -> None:
    s.add_argument(
        "--audit",
        type=int,
        nargs="?",
        const=AUDIT_HEADS,
        default=0,
        metavar="K",
        help=f"with --causal: after scoring, check AtP against exact ablation (mean and zero) on the K heads of "
        f"largest |AtP| and K drawn at random, as the report does; audit.csv and summary.json's audit "
        f"(--audit alone: K = {AUDIT_HEADS}; 0, the default: none; see docs/audit.md)",
    )
    s.add_argument(
        "--audit-stories",
        type=int,
        default=None,
        metavar="N",
        help=f"the audit on the first N stories (default: as many of the first {TRUTH_STORIES} as cost at most "
        f"{TRUTH_BUDGET:.0%}% of the scoring pass or {TRUTH_FLOOR_FLOPS / 1e12:g} TFLOP); its cost is said before "
        f"scoring starts, and past {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP needs {OVER_BUDGET_FLAG}",
    )
    s.add_argument("--seed", type=int, default=0, help="the audit's random heads: seed, 0 to 2^64 - 1 (default 0)")
    s.add_argument(OVER_BUDGET_FLAG, action="store_true", help=OVER_BUDGET_HELP)


def _add_causal(s) -> None:
    s.add_argument(
        "--causal",
        action="store_true",
        help="also every head's effect on the loss: attribution patching (atp_mean, atp_zero) and direct logit "
        "attribution (dla), with standard errors; per batch, a backward pass and a second forward of every "
        "block but those whose graphs --graph-memory keeps (see docs/causal.md)",
    )
    s.add_argument(
        "--graph-memory",
        type=int,
        default=GRAPH_BYTES >> 20,
        metavar="MB",
        help="with --causal: the MiB the gradient pass may hold of the first blocks' graphs, so that it need not "
        f"run them twice (default {GRAPH_BYTES >> 20}; 0: the least memory, one block's activations at a time)",
    )


def _add_examples(s) -> None:
    s.add_argument(
        "--examples",
        type=int,
        default=EXAMPLES,
        metavar="K",
        help=f"keep the K queries where each head fires most, per detector, in examples.json (default {EXAMPLES}; "
        f"0: none; at most {EXAMPLES_BUDGET:,} examples in all, heads x detectors x K: about 1 KB each, refused past it)",
    )


def cmd_score(args) -> int:

    if args.engine != "ray" and (args.address or args.workers != 2):
        raise UsageError("--workers and --address: only with --engine ray")
    _check_seed(args.seed)
    options = ScoreOptions(
        batch_size=args.batch_size,
        chunk_stories=args.chunk_stories,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        engine=args.engine,
        workers=args.workers,
        address=args.address,
        model_source=args.model,
        detectors=BUILTIN_DETECTORS + tuple(load_detector(f) for f in args.detector),
        progress=not args.no_progress,
        examples=args.examples,
        causal=args.causal,
        graph_memory=args.graph_memory,
        audit=args.audit,
        audit_stories=args.audit_stories,
        seed=args.seed,
        over_budget=args.over_budget,
    )
    if args.engine == "ray" and args.address:
        check_address(args.address)  # in seconds, before the first pass reads the corpus
    out = _out_path(args.out)
    check_target_folder(out)  # before the model or any story: a bad --out costs nothing
    source = open_source(
        args.stories, text_field=args.text_field, limit=args.limit, split=args.split, allow_download=args.allow_download
    )
    run = score_corpus(_load(args), source, out, options)
    s, st = run.summary, run.summary.stories
    print(
        f"{st.stories:,} stories from {st.source}: {st.cut_to_window:,} cut to the window, "
        f"{st.with_main_character:,} with a main character ({st.name_scored:,} scored for names)"
    )
    for name, top in s.top.items():
        if top is not None:
            print(f"  {name:16} highest {top.head} {top.score:.3f}")
    print(
        f"written to {run.out} (scoring {s.timings_s['scoring']:.1f} s, first pass {s.timings_s['first_pass']:.1f} s, "
        f"engine {s.engine.name})"
    )
    if s.audit is not None:
        print("\n".join(audit_lines(s.audit)))
    elif options.audit:
        print("audit: not run (the model's heads could not be reached, or no story predicts a token)")
    return 0


def _debug_everywhere(parser: argparse.ArgumentParser) -> None:
    """``--debug`` works before or after the subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
                _debug_everywhere(sp)  # nested commands too (storylens data download --debug)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    _debug_everywhere(parser)
    args = parser.parse_args(argv)
    if getattr(args, "html", None) is not None and not getattr(args, "record", False):
        print("storylens: error: --html: needs --record (the page replays the recorded attention)", file=sys.stderr)
        return 2
    if getattr(args, "record", False) and getattr(args, "html", None) is None:
        print("storylens: error: --record: give --html FILE to write the replay page", file=sys.stderr)
        return 2
    # No network unless asked: the Hugging Face clients run offline (no DNS, no socket).
    try:
        with hub_offline(not getattr(args, "allow_download", False)):
            return args.func(args)
    except (StorylensError, KeyboardInterrupt, OSError, MemoryError) as e:
        if args.debug:
            raise
        message, code = _describe(e)
        print(f"storylens: {message}", file=sys.stderr)
        return code


def _describe(e: BaseException) -> tuple[str, int]:
    """One line and an exit code for a problem the user can act on: 2 for a usage error (as
    argparse's own), 1 for a problem found while running, 130 when interrupted."""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(e, MemoryError):
        return "error: out of memory", 1
    if isinstance(e, OSError):
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return f"error: {where}{e.strerror or _one_line(e)}", 1
    return f"error: {_one_line(e)}", 2 if isinstance(e, UsageError) else 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
