"""The ``storylens`` command.

Every user-fixable problem is one line on stderr and a non-zero exit; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import StorylensError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and the exit code 2), not a usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or hub id (default: the shipped Tiny Storyteller)")
    p.add_argument("--allow-download", action="store_true", help="let --model fetch a hub id over the network")


def _load(args):
    from .hub import load_model

    return load_model(args.model, allow_download=args.allow_download)


def _validate_generate(args) -> None:
    import math

    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise StorylensError("prompt: not valid text (it holds bytes that are not UTF-8)") from None
    if not args.prompt.strip():
        raise StorylensError("prompt: empty; give the story's first words, e.g. storylens generate \"Once upon a time\"")
    if args.max_new_tokens < 0:
        raise StorylensError(f"--max-new-tokens: must be 0 or more (got {args.max_new_tokens})")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise StorylensError(f"--temperature: must be a finite number, 0 (greedy) or more (got {args.temperature})")
    if args.top_k < 0:
        raise StorylensError(f"--top-k: must be 0 (off) or more (got {args.top_k})")
    if not 0 <= args.seed < 2**64:
        raise StorylensError(f"--seed: must be between 0 and 2^64 - 1 (got {args.seed})")


def cmd_generate(args) -> int:
    import torch

    from .tokenizer import eot_id

    _validate_generate(args)
    if args.html is not None:
        return _generate_recorded(args)
    model = _load(args)
    tok = model.tokenizer
    ids = [eot_id(tok)] + tok.encode(args.prompt).ids
    if len(ids) + args.max_new_tokens > model.config.block_size:
        raise StorylensError(
            f"generate: prompt ({len(ids)} tokens with the opening marker) + --max-new-tokens "
            f"({args.max_new_tokens}) passes the {model.config.block_size}-token window; ask for fewer tokens"
        )
    idx = torch.tensor([ids])
    gen = torch.Generator().manual_seed(args.seed)
    try:
        steps = model.generate_stream(
            idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
            generator=gen, use_kv_cache=not args.no_cache, eos_id=None if args.no_stop else eot_id(tok),
        )
        out = sys.stdout
        out.write(args.prompt)
        new: list[int] = []
        shown = ""
        for step in steps:
            if step.token == eot_id(tok):
                break
            new.append(step.token)
            text = tok.decode(new)
            if text.endswith("\ufffd"):  # a character split across byte-level tokens: wait for the rest
                continue
            out.write(text[len(shown):])
            out.flush()
            shown = text
        out.write(tok.decode(new)[len(shown):] + "\n")
    except ValueError as e:
        raise StorylensError(f"generate: {e}") from None
    return 0


def _generate_recorded(args) -> int:
    """``generate --record --html FILE``: the story, then a page that replays its writing."""
    from .generation import record_generation
    from .publish import write_text_atomic
    from .viz import replay_widget

    if args.no_cache:
        raise StorylensError("--record: records the KV-cached generation; drop --no-cache")
    out = Path(args.html)
    if out.is_dir():
        raise StorylensError(f"{out}: is a folder; give an .html file name")
    model = _load(args)
    run = record_generation(model, args.prompt, args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k or None, seed=args.seed, stop_at_marker=not args.no_stop)
    tok = model.tokenizer
    print(args.prompt + tok.decode(run.ids[run.prompt_len:]))
    write_text_atomic(out, replay_widget(run, tok).to_html())
    print(f"replay written to {out} ({len(run.ids) - run.prompt_len} tokens, each with its recorded attention)",
          file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    from dataclasses import fields

    from .data import load_split
    from .train import TrainConfig, export_checkpoint, lesson_files, train, validate_config

    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    cfg = TrainConfig(**overrides)
    validate_config(cfg)
    if args.first is not None and args.first < 201:
        raise StorylensError(f"--first: at least 201 stories (200 for the quiz and one to train on), got {args.first}")
    split = load_split(args.stories, first=args.first)
    try:
        result = train(split, Path(args.out), cfg, resume=args.resume)
    except KeyboardInterrupt as e:
        print(f"\n{e or 'interrupted'}; continue with --resume", file=sys.stderr)
        return 130
    evals = result["state"]["evals"]
    if evals:
        print(f"quiz perplexity {evals[-1]['quiz_perplexity']:.3f} after {result['state']['step']} steps")
    if args.export:
        folder = export_checkpoint(Path(args.out), Path(args.export), lesson_files(split))
        print(f"model folder written to {folder}")
    return 0


def cmd_export_hf(args) -> int:
    from .hub import export_hf

    model = _load(args)
    folder = export_hf(model, Path(args.dir))
    print(f"transformers GPT2LMHeadModel written to {folder}")
    return 0


def cmd_perplexity(args) -> int:
    from .lesson import lesson_data
    from .train import quiz_perplexity

    model = _load(args)
    data = lesson_data(getattr(model, "source_folder", None), args.stories)
    print(f"quiz perplexity {quiz_perplexity(model, model.tokenizer, data.quiz):.3f} ({data.quiz_source})")
    return 0


def cmd_data_download(args) -> int:
    from .data import download_tinystories

    path = download_tinystories(args.split)
    print(f"TinyStories {args.split} split: {path}")
    print(f"use it with --stories tinystories{'-valid' if args.split == 'valid' else ''} "
          f"(e.g. storylens train --stories tinystories --first 20000, the lesson's recipe)")
    return 0


def _check_stories(model, args) -> tuple[list[list[int]], str]:
    """The quiz (the corpus's, else the one shipped with the model), cut to the window; for a model
    with neither, stories the model writes itself."""
    import torch

    from .lesson import lesson_data
    from .tokenizer import encode_story, eot_id

    window = model.config.block_size
    try:
        data = lesson_data(getattr(model, "source_folder", None), args.stories)
    except StorylensError as e:
        if args.stories is not None:
            raise
        gen = torch.Generator().manual_seed(0)
        ids = []
        for _ in range(args.n_stories or 8):
            out = model.generate(torch.tensor([[eot_id(model.tokenizer)]]), window - 1, temperature=0.8,
                                 top_k=40, generator=gen)
            ids.append(out[0].tolist())
        return ids, f"{len(ids)} stories the model wrote (no corpus: {str(e).split(':')[-1].strip()})"
    quiz = data.quiz[: args.n_stories] if args.n_stories else data.quiz
    return [encode_story(model.tokenizer, s, window).ids for s in quiz], f"{len(quiz)} quiz stories"


def cmd_check(args) -> int:
    import json
    import platform

    import torch

    from .numerics import run_checks

    if args.n_stories is not None and args.n_stories < 1:
        raise StorylensError("--n-stories: must be at least 1")
    if not 1 <= args.gen_tokens:
        raise StorylensError("--gen-tokens: must be at least 1")
    model = _load(args)
    ids, source = _check_stories(model, args)
    dtypes = {"both": (torch.float32, torch.float64), "float32": (torch.float32,), "float64": (torch.float64,)}
    checks = run_checks(model, ids, dtypes=dtypes[args.dtype], gen_tokens=args.gen_tokens)
    cpu = _cpu_name()
    print(f"storylens check on {cpu} (torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()} kernels, "
          f"{platform.machine()}), {source}")
    print(f"{'check':34} {'dtype':8} {'measured':>10} {'bound':>10} {'lesson':>8}  ok  detail")
    for c in checks:
        lesson = f"{c.lesson:.0e}" if c.lesson is not None else ""
        print(f"{c.name:34} {c.dtype:8} {c.measured:10.2e} {c.bound:10.2e} {lesson:>8}  "
              f"{'yes' if c.passed else 'NO '}  {c.detail}")
    print("bounds: rounding alone (see storylens.numerics); the lesson's figures are for comparison")
    if args.json:
        from .publish import write_text_atomic

        write_text_atomic(Path(args.json), json.dumps(
            {"cpu": cpu, "torch": torch.__version__, "stories": source,
             "checks": [c.to_dict() for c in checks]}, indent=1))
    failed = [c for c in checks if not c.passed]
    if failed:
        print(f"storylens: error: {len(failed)} check(s) past their bound: "
              + ", ".join(f"{c.name} ({c.dtype})" for c in failed), file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    from .train import TrainConfig

    from . import __version__

    p = _Parser(prog="storylens", description="Read Tiny Storyteller's attention.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"storylens {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="write a story from a prompt (KV-cached, streamed)")
    g.add_argument("prompt", help="the story's first words")
    g.add_argument("--max-new-tokens", type=int, default=150, help="at most this many new tokens (default 150)")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens; 0 for all (default 40)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed, 0 to 2^64 - 1 (default 0)")
    g.add_argument("--record", action="store_true", help="record every new token's attention (use with --html)")
    g.add_argument("--html", default=None, metavar="FILE",
                   help="with --record: write a page that replays the writing, token by token, with its attention")
    g.add_argument("--no-cache", action="store_true", help="recompute everything each step (slow reference)")
    g.add_argument("--no-stop", action="store_true", help="keep going past the end-of-story marker")
    _add_model(g)
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("train", help="train Tiny Storyteller on the training stories")
    t.add_argument("--stories", default=None, help="corpus file (default: ../shared/data/tinystories/stories.txt.gz)")
    t.add_argument("--out", default="runs/tiny-storyteller", help="run folder (checkpoint, tokenizer)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    t.add_argument("--export", default=None, help="write a model folder here when done")
    t.add_argument("--first", type=int, default=None, metavar="N",
                   help="use only the corpus's first N stories (the lesson: --stories tinystories --first 20000)")
    d = TrainConfig()
    for name in ("max_steps", "batch_size", "eval_every", "seed", "warmup_steps", "vocab_size"):
        t.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {getattr(d, name)}")
    for name in ("lr", "min_lr", "weight_decay", "dropout", "attn_dropout", "ema_decay", "checkpoint_minutes"):
        t.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=f"default {getattr(d, name)}")
    t.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default fp32 (bf16 autocast is slower here)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("export-hf", help="export to a transformers GPT2LMHeadModel folder")
    e.add_argument("dir", help="the folder to write (new, empty, or an earlier export)")
    _add_model(e)
    e.set_defaults(func=cmd_export_hf)

    q = sub.add_parser("perplexity", help="quiz perplexity of a model")
    q.add_argument("--stories", default=None, help="corpus whose last 200 stories are the quiz "
                   "(default: the shared corpus, else the quiz shipped with the model)")
    _add_model(q)
    q.set_defaults(func=cmd_perplexity)

    c = sub.add_parser("check", help="measure the lesson's numerical promises on this machine (float32 and float64)")
    c.add_argument("--stories", default=None, help="corpus whose quiz is used (default: the shared corpus)")
    c.add_argument("--n-stories", type=int, default=None, help="use only the first N quiz stories")
    c.add_argument("--gen-tokens", type=int, default=200, help="tokens generated with and without the cache")
    c.add_argument("--dtype", choices=["both", "float32", "float64"], default="both",
                   help="precision(s) to measure in (default both)")
    c.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    _add_model(c)
    c.set_defaults(func=cmd_check)

    dd = sub.add_parser("data", help="the TinyStories corpus: storylens data download")
    dsub = dd.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    dl = dsub.add_parser("download", help="fetch TinyStories from the Hugging Face Hub into the user cache")
    dl.add_argument("--split", choices=["train", "valid"], default="train",
                    help="train (1.9 GB, what the lesson trains on) or valid (19 MB); default train")
    dl.set_defaults(func=cmd_data_download, allow_download=True)

    try:
        from .report import add_report_parser

        add_report_parser(sub)
    except ImportError:
        pass
    try:
        from .analysis.beyond import add_ablate_parser

        add_ablate_parser(sub)
    except ImportError:
        pass
    return p


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
    if not getattr(args, "allow_download", False):
        # No network unless asked: the Hugging Face clients run offline (no DNS, no socket).
        from .hub import hub_offline

        ctx = hub_offline(True)
    else:
        from contextlib import nullcontext

        ctx = nullcontext()
    try:
        with ctx:
            return args.func(args)
    except (StorylensError, KeyboardInterrupt, OSError, MemoryError) as e:
        if args.debug:
            raise
        message, code = _describe(e)
        print(f"storylens: {message}", file=sys.stderr)
        return code


def _describe(e: BaseException) -> tuple[str, int]:
    """One line and an exit code for a problem the user can act on."""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(e, MemoryError):
        return "error: out of memory", 2
    if isinstance(e, OSError):
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return f"error: {where}{e.strerror or _one_line(e)}", 2
    return f"error: {_one_line(e)}", 2


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
