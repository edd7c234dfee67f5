"""``storylens generate``: write a story from a prompt (KV-cached, streamed), or record its
attention and write a page that replays the writing (``--record --html FILE``)."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import torch

from storylens.cli.options import add_model, check_seed, load
from storylens.core.errors import StorylensError, UsageError
from storylens.core.publish import write_text_atomic
from storylens.lm.generate import record_generation, stream_text
from storylens.viz import replay_widget

COMMAND = "generate"
POSITION = 20


def add_parser(sub) -> None:
    g = sub.add_parser(COMMAND, help="write a story from a prompt (KV-cached, streamed)")
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
    add_model(g)
    g.set_defaults(func=run)


def _record_needs_html(args) -> int | None:
    """``--html`` and ``--record`` only together: said on stderr with exit code 2 (even with
    ``--debug``), before anything else is checked; None when they are."""
    if args.html is not None and not args.record:
        print("storylens: error: --html: needs --record (the page replays the recorded attention)", file=sys.stderr)
        return 2
    if args.record and args.html is None:
        print("storylens: error: --record: give --html FILE to write the replay page", file=sys.stderr)
        return 2
    return None


def _validate(args) -> None:
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
    check_seed(args.seed)


def run(args) -> int:
    refused = _record_needs_html(args)
    if refused is not None:
        return refused
    _validate(args)
    if args.html is not None:
        return _generate_recorded(args)
    model = load(args)
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
    model = load(args)
    recorded = record_generation(
        model,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        seed=args.seed,
        stop_at_marker=not args.no_stop,
    )
    tok = model.tokenizer
    print(args.prompt + tok.decode(recorded.ids[recorded.prompt_len :]))
    write_text_atomic(out, replay_widget(recorded, tok).to_html())
    print(
        f"replay written to {out} ({len(recorded.ids) - recorded.prompt_len} tokens, each with its recorded attention)",
        file=sys.stderr,
    )
    return 0
