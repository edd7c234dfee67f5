"""``storylens check``: measure the lesson's numerical promises on this machine (float32 and
float64), beside the bounds rounding alone allows."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

from storylens.cli.options import add_model, load_native
from storylens.core.errors import StorylensError, UsageError
from storylens.core.publish import write_text_atomic
from storylens.lesson.checks import lesson_note, run_checks
from storylens.lesson.inputs import lesson_data
from storylens.model.gpt import GPT
from storylens.model.tokenizer import encode_story, eot_id

COMMAND = "check"
POSITION = 60


def add_parser(sub) -> None:
    c = sub.add_parser(COMMAND, help="measure the lesson's numerical promises on this machine (float32 and float64)")
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
    add_model(c, dtype=False)  # its own --dtype: the precision(s) measured in
    c.set_defaults(func=run)


def _check_stories(model: GPT, args) -> tuple[list[list[int]], str]:
    """The quiz (the corpus's, else the one shipped with the model), cut to the window; for a model
    with neither, stories the model writes itself."""

    window, tokenizer = model.config.block_size, model.tokenizer
    assert tokenizer is not None  # load_native's model was wrapped, which needs its tokenizer
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


def run(args) -> int:
    if args.n_stories is not None and args.n_stories < 1:
        raise UsageError("--n-stories: must be at least 1")
    if not 1 <= args.gen_tokens:
        raise UsageError("--gen-tokens: must be at least 1")
    model = load_native(args, "check")
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
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
