"""The whole lesson in one call: ``storylens report``.

:func:`build_report` loads the model and the stories, runs the leakage check, scores
every head over the quiz (streaming), draws the figures and the widget, and writes
``report.html`` (one self-contained file), ``heads.csv``, ``heads.json``,
``summary.json`` and the PNG figures into ``out``. Everything is first written to a
temporary folder beside ``out`` and moved in only when complete, so a failure leaves
nothing half-written.

This module runs it (what is computed, in which order, on which core); the numbers become a typed
:class:`~storylens.lesson.summary.ReportSummary` (:mod:`storylens.lesson.tables`; ``summary.json`` is
its :meth:`~storylens.lesson.summary.ReportSummary.to_dict`), the figures are drawn by
:mod:`storylens.lesson.drawing`, and ``report.html`` is rendered by :mod:`storylens.lesson.page`.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from storylens.core.background import run_beside
from storylens.core.errors import StorylensError, UsageError
from storylens.core.heads import Head
from storylens.core.progress import ProgressLines, progress_command
from storylens.core.publish import publish_folder
from storylens.corpus.options import EXAMPLES, check_examples, check_graph_memory
from storylens.corpus.score import write_examples
from storylens.data.leakage import LeakageReport
from storylens.data.names import name_vocabulary
from storylens.data.stories import QUIZ_FILE
from storylens.effects.ablation import head_output_means
from storylens.effects.audit import Audit, audit_every_head, audit_stories
from storylens.effects.cost import (
    ABLATION_LIMIT_FLOPS,
    OVER_BUDGET_FLAG,
    TRUTH_BUDGET,
    TRUTH_FLOOR_FLOPS,
    check_ablation_budget,
    scoring_flops,
)
from storylens.effects.exact import ExactPlan, exact_cost
from storylens.engine.encode import EncodedStory, encode_stories
from storylens.engine.gradients import GRAPH_BYTES
from storylens.engine.record import Counter
from storylens.lesson.beyond import BeyondSummary, beyond_summary, run_beyond
from storylens.lesson.checks import Check, run_checks
from storylens.lesson.drawing import (
    LESSON_GRID_HEADS,
    beside_model_work,
    data_uri,
    data_uris,
    figure_data,
    svg_payloads,
)
from storylens.lesson.figures import FIRST_STORIES, LESSON_FIGURES
from storylens.lesson.inputs import LessonData, lesson_data
from storylens.lesson.page import CHECK_STORIES, CHECK_TOKENS, PRACTITIONER, SECTIONS, report_html
from storylens.lesson.summary import ReportSummary
from storylens.lesson.tables import report_summary
from storylens.lesson.why_cards import why_cards
from storylens.lm import AttentionLM, ModelLike, NativeLM, load_lm, wrap
from storylens.looking.detectors import BUILTIN_DETECTORS, Detector
from storylens.looking.position import PositionControlAccumulator
from storylens.looking.pronouns import PronounAccumulator
from storylens.model.tokenizer import encode_story
from storylens.table.scores import HeadScores, score_heads
from storylens.table.truth import (
    TRUTH_STORIES,
    Truth,
    ablation_flops,
    truth_budget_stories,
    truth_cost,
    truth_table,
    with_causal,
)
from storylens.viz import AttentionWidget, toy_widget
from storylens.viz.explorer import write_explorer_for
from storylens.viz.figures import figure_png_bytes, figure_svg_bytes
from storylens.viz.score_figures import head_heatmap_figure

WIDGET_BUDGET = 4 * 2**20  # bytes of the widget's embedded attention in report.html (8 bits past it)


def parse_sections(text: str) -> tuple[str, ...]:
    """``--sections overview,sinks``: the names, in the page's order; a name that is not a section
    is one line listing the valid ones (a UsageError, exit 2)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise UsageError(
            (
                f"--sections: {', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not a section"
                if bad
                else "--sections: no section given"
            )
            + f"; choose from {', '.join(SECTIONS)}"
        )
    return tuple(k for k in SECTIONS if k in names)


def default_sections(lm: AttentionLM) -> tuple[str, ...]:
    """Every section for storylens's own model (the lesson is about it); the practitioner's for another."""
    return tuple(SECTIONS) if isinstance(lm, NativeLM) else PRACTITIONER


@dataclass(frozen=True)
class ReportOptions:
    """What a report runs with, built once (by the command line, or from :func:`build_report`'s
    keywords) and checked once, here, before any work.

    ``model_source``: what to load when no model is given (None: the shipped one); ``stories``: the
    corpus whose last 200 stories are the quiz; ``quiz``: a file of stories to measure instead;
    ``word``: the leakage check's word; ``prev_limit``: the first stories the previous-token figures
    count; ``beyond``: section 8's experiments; ``detectors``: the user's, beside the built-in ones;
    ``check_stories``/``check_tokens``: the numerical checks' stories and generated tokens;
    ``examples``: queries kept per head and detector; ``truth_stories``: the ablations' stories
    (None: as many as their budget allows), refused past the budget unless ``over_budget``;
    ``causal``: every head's AtP and DLA in the scoring pass (:mod:`storylens.effects.attribution`), its
    gradient pass holding at most ``graph_memory`` MiB of kept graphs;
    ``why``: the why cards' quiz stories (:mod:`storylens.lesson.why_cards`; 0: no cards);
    ``sections``: the page's sections (:data:`SECTIONS`; None: :func:`default_sections`), a section
    left out not computed where it costs anything (the leakage check, the numerical checks, the
    ablations) and its keys left out of summary.json."""

    model_source: str | None = None
    stories: str | None = None
    quiz: str | None = None
    text_field: str = "text"
    word: str = LESSON_FIGURES.leakage_word
    prev_limit: int = FIRST_STORIES
    batch_size: int = 16
    beyond: bool = False
    detectors: tuple[Detector, ...] = ()
    progress: bool = True
    check_stories: int = CHECK_STORIES
    check_tokens: int = CHECK_TOKENS
    examples: int = EXAMPLES
    truth_stories: int | None = None
    over_budget: bool = False
    causal: bool = False
    graph_memory: int = GRAPH_BYTES >> 20
    sections: tuple[str, ...] | None = None
    why: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "detectors", tuple(self.detectors))
        if self.sections is not None:
            object.__setattr__(self, "sections", parse_sections(",".join(self.sections)))
        check_examples(self.examples)
        check_graph_memory(self.graph_memory)
        t = self.truth_stories
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            raise UsageError(f"--truth-stories: a whole number, 0 or more (got {t!r})")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size: must be at least 1 (got {self.batch_size})")
        if isinstance(self.why, bool) or not isinstance(self.why, int) or self.why < 0:
            raise UsageError(f"--why: a whole number of quiz stories, 0 or more (got {self.why!r})")
        if self.prev_limit < 0:
            raise UsageError(f"--prev-limit: must be 0 or more (got {self.prev_limit})")
        if not self.word.strip() or len(self.word.split()) != 1:
            raise UsageError(
                f"--word: give one word for the leakage check to count (the lesson's: Momo), not {self.word!r}"
            )


@dataclass
class Report:
    out: Path
    summary: ReportSummary
    scores: HeadScores
    leakage: LeakageReport | None
    timings: dict = field(default_factory=dict)


@contextmanager
def _timer(timings: dict, name: str):
    t = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t, 3)


@contextmanager
def _one_thread_if(cond: bool):
    """torch on one thread while another process has the other core (two thread pools spinning
    for two cores slow each other several times over)."""
    before = torch.get_num_threads()
    if cond:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_report(
    out: str | os.PathLike = "report",
    *,
    model: ModelLike | None = None,
    options: ReportOptions | None = None,
    **changes: Any,
) -> Report:
    """Run the lesson on ``model`` (default: ``options.model_source``, else the shipped one) and write
    the report into ``out``. ``options`` (default :class:`ReportOptions`), with any of its fields
    given as keywords changed: ``build_report("r", quiz="mine.txt", truth_stories=0)``.

    An explicit ``truth_stories`` says its ablations' cost on stderr once the scoring pass has chosen
    their heads, and past :data:`~storylens.effects.cost.ABLATION_LIMIT_FLOPS` is refused (a
    UsageError, nothing written) unless ``over_budget``.

    With ``progress`` and stderr not a terminal (no tqdm bar), the long loops print a line every
    ``$STORYLENS_PROGRESS_SECONDS`` (default 10) seconds: ``storylens: report: scoring 120/200
    stories, about 30 s left`` (:class:`storylens.lesson.ProgressLines`)."""

    opts = replace(options or ReportOptions(), **changes)
    with progress_command("report"):  # progress lines off a terminal say whose they are
        return _build_report(Path(out), model, opts)


def _build_report(out: Path, model: ModelLike | None, opts: ReportOptions) -> Report:
    """The run: one lock and one temporary folder for all of it (a second run into the same ``out``
    is refused at once, and a kill at any moment leaves the old report: storylens.core.publish)."""

    timings: dict = {}
    t_start = time.perf_counter()
    with publish_folder(out, "report") as tmp:
        with _timer(timings, "load"):
            lm = wrap(model) if model is not None else load_lm(opts.model_source)
            check_examples(opts.examples, lm.n_layer * lm.n_head, len(BUILTIN_DETECTORS) + len(opts.detectors))
            data = lesson_data(
                _quiz_folder(lm), opts.stories, opts.quiz, quiz_option="--quiz", text_field=opts.text_field
            )
        sections = opts.sections if opts.sections is not None else default_sections(lm)
        lesson = "lesson" in sections
        measures = _beyond_measures(lm) if opts.beyond else None
        with _timer(timings, "scoring"):  # the one recording pass: head scores (and --beyond's measures)
            encoded, scores = _score(lm, data.quiz, measures or (), opts)
        with _timer(timings, "figure data"):
            fig_data = figure_data(lm, data.quiz, encoded, scores)
        page = _beside(lm, data, fig_data, scores, tmp, opts, timings, lesson=lesson)
        summary = report_summary(lm, scores, page.leakage, data, fig_data["info"])
        summary.numerics = page.checks
        if not lesson:  # the lesson's figures: no key in summary.json
            summary.leakage = summary.name_heads = summary.previous_token = summary.number_to_reproduce = None
            summary.numerics = None
        summary.sections = list(sections)
        if measures is not None:
            with _timer(timings, "beyond"):
                summary.beyond = _beyond_section(lm, data.quiz, encoded, scores, measures, tmp, page, opts)
        if "truth" in sections:
            summary.faithfulness = _faithfulness(lm, scores, encoded, opts, timings)
        if opts.causal and "causal" in sections:
            summary.audit = _audit(lm, scores, encoded, opts, timings)
            if summary.faithfulness is not None:  # AtP for every head, exact where audited, in the truth table
                summary.faithfulness = _truth_with_atp(summary.faithfulness, scores, summary.audit)
        if opts.why:
            with _timer(timings, "why"):
                summary.why = why_cards(lm, scores, encoded[: opts.why], tmp, progress=opts.progress)
        _write_tables(tmp, lm, scores, summary, opts)
        timings["total_before_html"] = round(time.perf_counter() - t_start, 3)
        summary.timings_s = timings
        html = report_html(summary, scores, page.figs, page.svgs, page.widget_html, page.toy_html)
        (tmp / "report.html").write_text(html, encoding="utf-8")
        (tmp / "summary.json").write_text(summary.to_json(), encoding="utf-8")
    timings["total"] = round(time.perf_counter() - t_start, 3)
    return Report(out=out, summary=summary, scores=scores, leakage=page.leakage, timings=timings)


def _score(
    lm: AttentionLM, quiz: list[str], measures: tuple, opts: ReportOptions
) -> tuple[list[EncodedStory], HeadScores]:
    """The quiz encoded (once, for every step) and every head scored in one recording pass that also
    feeds ``measures``; an explicit ``--truth-stories`` then says its cost (refused past the budget)."""
    encoded = encode_stories(lm, quiz, name_vocabulary(quiz))
    lines = Counter(ProgressLines("scoring", len(encoded), enabled=opts.progress).update)  # counts batches
    exact = None
    if opts.causal and (opts.sections is None or "causal" in opts.sections):  # every head's exact effect, measured
        exact = _exact_plan(lm, encoded, opts)
    scores = score_heads(
        lm,
        encoded,
        batch_size=opts.batch_size,
        measures=(*measures, lines),
        detectors=BUILTIN_DETECTORS + opts.detectors,
        max_stories_prev=min(opts.prev_limit, len(quiz)),
        progress=opts.progress,
        examples=opts.examples,
        causal=opts.causal,
        graph_bytes=opts.graph_memory << 20,
        exact=exact,
    )
    if scores.n_name_scored == 0:
        raise StorylensError(
            f"{opts.quiz if opts.quiz is not None else 'quiz'}: no story has a main character "
            "(a capitalised name mentioned at least twice): nothing to score name heads on"
        )
    truth = opts.sections is None or "truth" in opts.sections  # every default holds the ablations' section
    if opts.truth_stories and truth:  # asked for: its cost said (and past the budget refused) before the figures start
        cost = truth_cost(lm, scores, [len(e.ids) for e in encoded], opts.truth_stories)
        check_ablation_budget(cost, "report: --truth-stories", over=opts.over_budget)
    return encoded, scores


def _exact_plan(lm: AttentionLM, encoded: list[EncodedStory], opts: ReportOptions) -> ExactPlan | None:
    """``--causal``: every head's exact effect over every quiz story where that fits the ablation budget
    (:data:`~storylens.effects.cost.ABLATION_LIMIT_FLOPS`, or past it with ``over_budget``), its cost said on
    stderr; else None, said too (the audit is then of chosen heads on the stories the budget allows)."""
    ids = [e.ids for e in encoded if len(e.ids) >= 2]
    if not ids:
        return None
    tokens = sum(len(s) for s in ids)
    cost = exact_cost(lm, tokens, ("mean",), tokens)
    what = f"report --causal: every head's exact effect over the {len(ids):,} quiz stories"
    if cost.flops > ABLATION_LIMIT_FLOPS and not opts.over_budget:
        print(
            f"storylens: {what}: {cost.describe()}, past the budget of {ABLATION_LIMIT_FLOPS / 1e12:g} TFLOP: not "
            f"measured; AtP is audited on chosen heads instead ({OVER_BUDGET_FLAG}: measure it anyway)",
            file=sys.stderr,
            flush=True,
        )
        return None
    check_ablation_budget(cost, what, over=True)  # said on stderr
    means = head_output_means(lm, ids, batch_size=opts.batch_size, include_marker=False)
    return ExactPlan(("mean",), means, len(ids))


@dataclass
class _PageParts:
    """What the page shows beside the summary: the figures (data URIs, SVG payloads), the widget and
    the toy widget as HTML, the numerical checks and the leakage check."""

    figs: dict[str, str]
    svgs: dict[str, str]
    widget_html: str
    toy_html: str
    checks: list[Check]
    leakage: LeakageReport | None


def _beside(
    lm: AttentionLM,
    data: LessonData,
    fig_data: dict,
    scores: HeadScores,
    tmp: Path,
    opts: ReportOptions,
    timings: dict,
    *,
    lesson: bool = True,
) -> _PageParts:
    """The drawing and the leakage check (numpy, matplotlib and Python; no model) in a child process
    while this one runs the numerical checks and the widget: two cores, two jobs. Without the
    ``lesson`` section, neither the leakage check nor the numerical checks run."""
    check_leakage = lesson and (data.train is not None or (opts.quiz is None and data.stored_leakage is not None))
    info = fig_data["info"]
    with (
        _timer(timings, "figures and leakage beside checks"),
        run_beside(beside_model_work, fig_data, scores, tmp, data if check_leakage else None, opts.word) as drawing,
    ):
        with _timer(timings, "check"), _one_thread_if(drawing.forked):  # one core each
            # the lesson's numerical checks are about storylens's own attention and KV cache
            checks = (
                _numerics(lm, data.quiz, opts.check_stories, opts.check_tokens)
                if isinstance(lm, NativeLM) and lesson
                else []
            )
        with _timer(timings, "widget"):
            widget = AttentionWidget.from_recording(
                fig_data["text"],
                fig_data["tokens"],
                fig_data["att"],
                fig_data["enc"],
                block=info["block"],
                head=info["head"],
                budget=WIDGET_BUDGET,
                mode="one" if fig_data["n_heads"] <= LESSON_GRID_HEADS else "maps",
            )
            (tmp / "widget.html").write_text(widget.to_html(), encoding="utf-8")
            toy = toy_widget()
    fig_names, leakage, timings["figures"], timings["leakage"] = drawing.result
    figs, svgs = data_uris(tmp, fig_names), svg_payloads(tmp, fig_names)
    return _PageParts(figs, svgs, widget._repr_html_(), toy._repr_html_(), checks, leakage)


def _faithfulness(
    lm: AttentionLM, scores: HeadScores, encoded: list[EncodedStory], opts: ReportOptions, timings: dict
) -> Truth | None:
    """The top heads switched off on the first quiz stories (as many as the ablations' budget allows,
    or ``--truth-stories``), with how they were chosen; None when none are."""
    n = opts.truth_stories
    if n is None:
        n = truth_budget_stories(lm, scores, [len(e.ids) for e in encoded])
    if not n:
        return None
    with _timer(timings, "faithfulness"):
        truth = truth_table(lm, scores, encoded, n_stories=n, batch_size=opts.batch_size, progress=opts.progress)
    how = _truth_stories_note(lm, scores, encoded, truth.n_stories, asked=opts.truth_stories)
    return replace(truth, stories_chosen=how)


def _audit(
    lm: AttentionLM, scores: HeadScores, encoded: list[EncodedStory], opts: ReportOptions, timings: dict
) -> Audit | None:
    """AtP against the exact effect of every head over every quiz story, both from the scoring pass
    (:func:`storylens.effects.audit.audit_every_head`); where the exact effect was not measured, the audit
    of chosen heads on the stories the ablations' budget allows (:func:`storylens.effects.audit.audit`)."""
    every = _every_head_audit(lm, scores, encoded)
    if every is not None:
        return every
    n = opts.truth_stories
    if n is None:
        n = truth_budget_stories(lm, scores, [len(e.ids) for e in encoded])
    with _timer(timings, "audit"):
        return audit_stories(lm, encoded[:n], batch_size=opts.batch_size, progress=opts.progress)


def _every_head_audit(lm: AttentionLM, scores: HeadScores, encoded: list[EncodedStory]) -> Audit | None:
    names = ("atp_mean", "atp_mean_se", "atp_zero", "atp_zero_se", "exact_mean", "exact_mean_se")
    cols: dict[str, torch.Tensor | None] = {}
    for name in names:
        values = scores.column(name) if scores.heads and name in scores.heads[0].scores else [None]
        cols[name] = None if any(v is None for v in values) else torch.tensor(values).view(lm.n_layer, lm.n_head)
    heads = list(Head.every(lm.n_layer, lm.n_head))
    measured = [e for e in encoded if len(e.ids) >= 2]
    return audit_every_head(cols, heads, len(measured), sum(len(e.ids) - 1 for e in measured))


def _truth_with_atp(truth: Truth, scores: HeadScores, audit: Audit | None) -> Truth:
    """The faithfulness table with AtP (mean ablation) beside each row and the audit's exact effect
    where it ablated the row's head (:func:`storylens.table.truth.with_causal`)."""
    exact = {} if audit is None else {r.head: (r.exact_mean.nats, r.exact_mean.se) for r in audit.rows}
    return with_causal(truth, scores, exact, 0 if audit is None else audit.n_stories)


def _write_tables(tmp: Path, lm: AttentionLM, scores: HeadScores, summary: ReportSummary, opts: ReportOptions) -> None:
    """heads.csv, heads.json, examples.json and explore.html."""
    scores.to_csv(tmp / "heads.csv")
    scores.to_json(tmp / "heads.json")
    if scores.examples is not None:
        write_examples(scores.examples, lm, tmp / "examples.json")
    kept = f"{opts.examples} per head and detector" if scores.examples is not None else "not kept (--examples 0)"
    meta = {
        "model": summary.model.described,
        "stories": f"{summary.quiz.stories:,} quiz stories ({summary.quiz.source})",
        "examples": kept,
    }
    write_explorer_for(tmp, title=f"storylens explorer: {summary.model.display_name}", meta=meta)


def _truth_stories_note(
    lm: AttentionLM, scores: HeadScores, encoded: list[EncodedStory], n: int, *, asked: int | None
) -> str:
    """How the ablations' ``n`` stories were chosen (``asked``: the --truth-stories given, None for the
    budget) and what they cost beside the scoring pass, in words."""
    lengths = [len(e.ids) for e in encoded]
    m = min(TRUTH_STORIES, len(lengths))  # what the budget chose from
    work = ablation_flops(lm, scores, lengths[: max(n, m)])
    scoring = scoring_flops(lm, lengths)
    cost = f"{sum(work[:n]) / scoring:.2f} times the scoring pass's work"
    first = "the first quiz story" if n == 1 else f"the first {n} quiz stories"
    if asked is not None:
        held = f" (asked {asked}; the quiz holds {len(lengths)})" if asked > len(lengths) else ""
        return f"{first}, as asked (--truth-stories){held}: {cost}"
    floor = f"{TRUTH_FLOOR_FLOPS / 1e12:g} TFLOP"
    allowed = max(TRUTH_BUDGET * scoring, TRUTH_FLOOR_FLOPS)
    rule = f"at most {TRUTH_BUDGET:.0%} of the scoring pass's work, or {floor} where that is more"
    if sum(work[:n]) > allowed:  # one story, over the budget
        note = f"the first quiz story, over the ablations' budget ({rule}) but never none: {cost}"
    else:
        note = f"{first}, as many of the first {m} as fit the ablations' budget ({rule}): {cost}"
    if n < m:
        note += f"; --truth-stories {m} runs {m}, {sum(work[:m]) / scoring:.1f} times"
    return note


def _numerics(lm: NativeLM, quiz: list[str], n_stories: int, n_tokens: int) -> list[Check]:
    """The lesson's numerical checks on the first ``n_stories`` quiz stories and ``n_tokens`` generated."""
    ids = [encode_story(lm.tokenizer, s, lm.window).ids for s in quiz[:n_stories]]
    return run_checks(lm.module, ids, gen_tokens=n_tokens)


def _quiz_folder(lm: AttentionLM) -> Path | None:
    """Where the model's own quiz may lie: its folder, or None for a transformers folder without one
    (:func:`storylens.lesson.lesson_data` then uses the lesson's quiz, shipped with storylens)."""

    folder = lm.source_folder
    if isinstance(lm, NativeLM) or (folder is not None and (folder / QUIZ_FILE).is_file()):
        return folder
    return None


def _beyond_measures(lm: AttentionLM) -> tuple[PositionControlAccumulator, PronounAccumulator]:
    """The measures ``--beyond`` feeds from the scoring pass: position control, pronouns."""

    return (PositionControlAccumulator(lm.n_layer, lm.n_head, lm.window), PronounAccumulator(lm.n_layer, lm.n_head))


def _beyond_section(
    lm: AttentionLM,
    stories: list[str],
    encoded: list[EncodedStory],
    scores: HeadScores,
    measures: tuple[PositionControlAccumulator, PronounAccumulator],
    tmp: Path,
    page: _PageParts,
    opts: ReportOptions,
) -> BeyondSummary:
    """The report's section 8: its findings; its figure written into ``tmp`` (PNG and SVG) and added
    to the page's."""

    position, pronouns = measures[0].result(), measures[1].result()  # fed by the scoring pass: no second recording
    b = run_beyond(lm, stories, scores, position=position, pronouns=pronouns, encoded=encoded, progress=opts.progress)
    s = beyond_summary(b, scores)
    fig = head_heatmap_figure(
        {r.head: r.zero_name_increase for r in s.ablation.rows},
        title="Name-loss increase with each head zero-ablated (nats)",
        colorbar_label="loss increase on the name",
        fmt="{:+.3f}",
        highlight=s.ablation.top_name_loss_head,
    )
    png = figure_png_bytes(fig)
    (tmp / "ablation_name_loss.png").write_bytes(png)
    (tmp / "ablation_name_loss.svg").write_bytes(figure_svg_bytes(fig))
    page.figs["ablation_name_loss"] = data_uri(png)
    page.svgs.update(svg_payloads(tmp, ["ablation_name_loss"]))
    return s
