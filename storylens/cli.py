"""The ``storylens`` command.

Every user-fixable problem is one line on stderr and a non-zero exit; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import StorylensError


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or hub id (default: the shipped Tiny Storyteller)")
    p.add_argument("--allow-download", action="store_true", help="let --model fetch a hub id over the network")


def _load(args):
    from .hub import load_model

    return load_model(args.model, allow_download=args.allow_download)


def cmd_generate(args) -> int:
    import torch

    from .tokenizer import eot_id

    if not args.prompt.strip():
        raise StorylensError("prompt: empty; give the story's first words, e.g. storylens generate \"Once upon a time\"")
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


def cmd_train(args) -> int:
    from dataclasses import fields

    from .data import load_split
    from .train import TrainConfig, export_checkpoint, train

    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    cfg = TrainConfig(**overrides)
    split = load_split(args.stories)
    try:
        result = train(split, Path(args.out), cfg, resume=args.resume)
    except KeyboardInterrupt as e:
        print(f"\n{e or 'interrupted'}; continue with --resume", file=sys.stderr)
        return 130
    evals = result["state"]["evals"]
    if evals:
        print(f"quiz perplexity {evals[-1]['quiz_perplexity']:.3f} after {result['state']['step']} steps")
    if args.export:
        folder = export_checkpoint(Path(args.out), Path(args.export))
        print(f"model folder written to {folder}")
    return 0


def cmd_export_hf(args) -> int:
    from .hub import export_hf

    model = _load(args)
    folder = export_hf(model, Path(args.dir))
    print(f"transformers GPT2LMHeadModel written to {folder}")
    return 0


def cmd_perplexity(args) -> int:
    from .data import load_split
    from .train import quiz_perplexity

    model = _load(args)
    split = load_split(args.stories)
    print(f"quiz perplexity {quiz_perplexity(model, model.tokenizer, split.quiz):.3f} ({len(split.quiz)} quiz stories)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .train import TrainConfig

    p = argparse.ArgumentParser(prog="storylens", description="Read Tiny Storyteller's attention.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="write a story from a prompt (KV-cached, streamed)")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=150)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40, help="0 for no top-k")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-cache", action="store_true", help="recompute everything each step (slow reference)")
    g.add_argument("--no-stop", action="store_true", help="keep going past the end-of-story marker")
    _add_model(g)
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("train", help="train Tiny Storyteller on the training stories")
    t.add_argument("--stories", default=None, help="corpus file (default: ../shared/data/tinystories/stories.txt.gz)")
    t.add_argument("--out", default="runs/tiny-storyteller", help="run folder (checkpoint, tokenizer)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    t.add_argument("--export", default=None, help="write a model folder here when done")
    d = TrainConfig()
    for name in ("max_steps", "batch_size", "eval_every", "seed"):
        t.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {getattr(d, name)}")
    for name in ("lr", "dropout", "checkpoint_minutes"):
        t.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=f"default {getattr(d, name)}")
    t.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default fp32 (bf16 autocast is slower here)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("export-hf", help="export to a transformers GPT2LMHeadModel folder")
    e.add_argument("dir")
    _add_model(e)
    e.set_defaults(func=cmd_export_hf)

    q = sub.add_parser("perplexity", help="quiz perplexity of a model")
    q.add_argument("--stories", default=None)
    _add_model(q)
    q.set_defaults(func=cmd_perplexity)

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except StorylensError as e:
        if args.debug:
            raise
        print(f"storylens: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("storylens: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
