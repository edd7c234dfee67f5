"""``storylens report``: run the whole lesson and write report.html, heads.csv/json and figures;
its printout (:func:`print_summary`)."""

from __future__ import annotations

import argparse
import sys

from storylens.cli.options import (
    add_causal,
    add_examples,
    add_model,
    add_no_progress,
    add_over_budget,
    graph_memory_of,
    load,
    load_detector,
    out_path,
)
from storylens.core.publish import check_target_folder
from storylens.effects.cost import ABLATION_LIMIT_FLOPS, OVER_BUDGET_FLAG, TRUTH_BUDGET, TRUTH_FLOOR_FLOPS
from storylens.lesson.figures import FIRST_STORIES, LESSON_FIGURES, PREV_HEAD_LEVEL
from storylens.lesson.page import PRACTITIONER, SECTIONS
from storylens.lesson.report import ReportOptions, build_report, parse_sections
from storylens.lesson.tables import f3
from storylens.table.truth import TRUTH_STORIES

COMMAND = "report"
POSITION = 10


def add_parser(sub) -> None:
    r = sub.add_parser(COMMAND, help="run the whole lesson and write report.html, heads.csv/json and figures")
    add_model(r)
    add_examples(r)
    add_causal(r)
    r.add_argument(
        "--why",
        type=int,
        default=0,
        metavar="N",
        help="explain the strongest name, previous-token and induction heads by their query-key terms over the first "
        "N quiz stories (a card each on report.html, their pages in why/; one forward a story and head, batches of "
        "one, so several times the scoring pass: benchmarks/bench_why.py; default 0: none)",
    )
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
    _add_inputs(r)
    _add_page(r)
    add_no_progress(r)
    add_over_budget(r)
    r.set_defaults(func=run)


def _add_inputs(r: argparse.ArgumentParser) -> None:
    """The stories read (``--stories``, ``--quiz``, ``--text-field``), the output folder, the
    leakage check's ``--word`` and the user's ``--detector`` files."""
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


def _add_page(r: argparse.ArgumentParser) -> None:
    """How the page is measured and what it holds: ``--prev-limit``, ``--batch-size``,
    ``--beyond``, ``--sections``."""
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


def run(args) -> int:
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
        graph_memory=graph_memory_of(args),
        truth_stories=args.truth_stories,
        over_budget=args.over_budget,
        sections=None if args.sections is None else parse_sections(args.sections),
        why=args.why,
    )
    out = out_path(args.out)
    check_target_folder(out, kind="report")  # before the model or any story: a bad --out costs nothing
    report = build_report(out, model=load(args), options=options)
    print_summary(report)
    return 0


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
