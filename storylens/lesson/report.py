"""The whole lesson in one call: ``storylens report``.

:func:`build_report` loads the model and the stories, runs the leakage check, scores
every head over the quiz (streaming), draws the figures and the widget, and writes
``report.html`` (one self-contained file), ``heads.csv``, ``heads.json``,
``summary.json`` and the PNG figures into ``out``. Everything is first written to a
temporary folder beside ``out`` and moved in only when complete, so a failure leaves
nothing half-written.

Data first, then the page: the figures become a typed :class:`~storylens.lesson.summary.ReportSummary`
(``summary.json`` is its :meth:`~storylens.lesson.summary.ReportSummary.to_dict`), and ``report.html`` is
``templates/report.html.j2`` rendered by Jinja2 with autoescaping, the lesson's own figures read from
:mod:`storylens.lesson.figures`.
"""

from __future__ import annotations

import base64
import math
import os
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from storylens.analysis.detectors import BUILTIN_DETECTORS
from storylens.analysis.encode import encode_stories
from storylens.analysis.names import name_vocabulary
from storylens.analysis.position import PositionControlAccumulator
from storylens.analysis.pronouns import PronounAccumulator
from storylens.analysis.record import Counter
from storylens.analysis.scores import score_heads
from storylens.analysis.truth import (
    TRUTH_BUDGET,
    TRUTH_FLOOR_FLOPS,
    TRUTH_STORIES,
    ablation_flops,
    check_ablation_budget,
    scoring_flops,
    truth_budget_stories,
    truth_cost,
    truth_table,
)
from storylens.core.background import run_beside
from storylens.core.errors import StorylensError, UsageError
from storylens.core.heads import parse_head_label
from storylens.core.progress import ProgressLines, progress_command
from storylens.core.publish import check_target_folder, publish_folder
from storylens.corpus.score import EXAMPLES, check_examples, write_examples
from storylens.data.stories import QUIZ_FILE
from storylens.lesson.beyond import beyond_summary, run_beyond
from storylens.lesson.checks import run_checks
from storylens.lesson.figures import FIRST_STORIES, LESSON_FIGURES, MARKER_HEAD_LEVEL, PREV_HEAD_LEVEL, TOP_HEADS
from storylens.lesson.inputs import leakage_for, lesson_data
from storylens.lesson.summary import (
    ArgmaxAll,
    ArgmaxFirst,
    BeyondSummary,
    Faithfulness,
    HeadMass,
    Leakage,
    LeakageStats,
    Marker,
    MarkerHighest,
    ModelInfo,
    NameHeads,
    NumberToReproduce,
    NumericRow,
    PrevFirst,
    PrevHighest,
    PreviousToken,
    QuizInfo,
    ReportSummary,
    StoryShown,
)
from storylens.lm import NativeLM, load_lm, wrap
from storylens.model.tokenizer import encode_story
from storylens.recording import figure_tokens, story_attention
from storylens.viz import (
    HEATMAP_CSS,
    AttentionWidget,
    all_heads_figure,
    causal_mask_figure,
    head_heatmap_html,
    name_attention_profile,
    name_head_figure,
    name_mass_bar_figure,
    toy_widget,
)
from storylens.viz.explorer import write_explorer_for
from storylens.viz.figures import figure_png_bytes, figure_svg_bytes, head_heatmap_figure
from storylens.viz.widget import page_script

CHECK_STORIES = 4  # the report's numerical checks run on the first 4 quiz stories ...
CHECK_TOKENS = 32  # ... and 32 generated tokens (storylens check runs all 200 stories and 200 tokens)

GRID_TOKENS = 24  # the 24-head grid shows the first 24 tokens, every one labelled ...
GRID_LABEL_PT = 8.5  # ... in 8.5-point type at 100 dpi (about 12 pixels), shown unscaled in the page
LESSON_GRID_HEADS = 24  # up to this many heads, "all heads on one story" is the lesson's one picture;
# past it the page shows the story's maps a block at a time, in the widget (drawn from its data)
BARS_SHOWN = 40  # the name-mass bars show every head up to this many, else the strongest 40
WIDGET_BUDGET = 4 * 2**20  # bytes of the widget's embedded attention in report.html (8 bits past it)
GRID_DPI = 100  # the lesson quotes two previous-token figures on the first 100 quiz stories
SCORE_TITLES = {
    "name_mass": "Name mass (share of attention on the main character's name)",
    "name_ratio": "Name mass / even-spread baseline",
    "prev_token": "Attention on the previous token",
    "prev_argmax": "Share of queries whose top key is the previous token",
    "prev4": "Attention on the last four tokens",
    "marker": "Attention on the end-of-story marker",
    "duplicate_token": "Attention on earlier copies of the query's token (duplicate-token)",
    "induction": "Attention on the token after an earlier copy of the query's token (induction)",
}


@dataclass
class Report:
    out: Path
    summary: ReportSummary
    scores: object  # storylens.analysis.HeadScores
    leakage: object  # storylens.analysis.LeakageReport
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
    import torch

    before = torch.get_num_threads()
    if cond:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_writable(out: Path) -> Path:
    """Refuse a bad ``--out`` before any work (publish_folder checks again under its lock)."""

    out = Path(out)
    check_target_folder(out)
    return out


def _pick_story(quiz: list[str], scores_mains, shown: int | None = None) -> int:
    """The quiz story the figures and the widget show, of which they draw the first ``shown`` tokens
    (None: all): the first whose main character is mentioned early (before position 40) and at
    least three times within those tokens; else the first mentioning it there with a token after
    the mention; else the first with a main character at all (a long story whose mentions all fall
    past the tokens drawn: its name-head figure then has no name to box)."""
    limit = math.inf if shown is None else shown

    def drawn(m) -> list[int]:
        return [] if m is None or m.first_mention is None else [p for p in m.positions if p < limit]

    for i, m in enumerate(scores_mains):
        if drawn(m) and m.first_mention < 40 and len(drawn(m)) >= 3:
            return i
    for i, m in enumerate(scores_mains):  # else the first whose main character is drawn, a query after it
        if drawn(m) and m.first_mention < limit - 1:
            return i
    for i, m in enumerate(scores_mains):  # else the first story that has a main character at all
        if m is not None and m.positions:
            return i
    raise StorylensError("quiz: no story has a main character to show")


def build_report(
    out: str | os.PathLike = "report",
    *,
    model=None,
    model_source=None,
    stories=None,
    quiz=None,
    text_field: str = "text",
    word: str = LESSON_FIGURES.leakage_word,
    prev_limit: int = FIRST_STORIES,
    batch_size: int = 16,
    beyond: bool = False,
    detectors=(),
    progress: bool = True,
    check_stories: int = CHECK_STORIES,
    check_tokens: int = CHECK_TOKENS,
    examples: int = EXAMPLES,
    truth_stories: int | None = None,
    over_budget: bool = False,
) -> Report:
    """Run the lesson on ``model`` (default: the shipped one) and write the report into ``out``.

    An explicit ``truth_stories`` says its ablations' cost on stderr once the scoring pass has chosen
    their heads, and past :data:`~storylens.analysis.truth.ABLATION_LIMIT_FLOPS` is refused (a
    UsageError, nothing written) unless ``over_budget``.

    With ``progress`` and stderr not a terminal (no tqdm bar), the long loops print a line every
    ``$STORYLENS_PROGRESS_SECONDS`` (default 10) seconds: ``storylens: report: scoring 120/200
    stories, about 30 s left`` (:class:`storylens.lesson.ProgressLines`)."""

    with progress_command("report"):  # progress lines off a terminal say whose they are
        return _build_report(
            out,
            model=model,
            model_source=model_source,
            stories=stories,
            quiz=quiz,
            text_field=text_field,
            word=word,
            prev_limit=prev_limit,
            batch_size=batch_size,
            beyond=beyond,
            detectors=detectors,
            progress=progress,
            check_stories=check_stories,
            check_tokens=check_tokens,
            examples=examples,
            truth_stories=truth_stories,
            over_budget=over_budget,
        )


def _build_report(
    out,
    *,
    model,
    model_source,
    stories,
    quiz,
    text_field,
    word,
    prev_limit,
    batch_size,
    beyond,
    detectors,
    progress,
    check_stories,
    check_tokens,
    examples,
    truth_stories,
    over_budget,
) -> Report:

    timings: dict = {}
    t_start = time.perf_counter()
    check_examples(examples)
    if truth_stories is not None and (
        isinstance(truth_stories, bool) or not isinstance(truth_stories, int) or truth_stories < 0
    ):
        raise UsageError(f"--truth-stories: a whole number, 0 or more (got {truth_stories!r})")
    out = _check_writable(Path(out))
    # one lock and one temporary folder for the whole run: a second run into the same --out is
    # refused at once, and a kill at any moment leaves the old report (see storylens.core.publish)
    with publish_folder(out, "report") as tmp:
        with _timer(timings, "load"):
            lm = wrap(model) if model is not None else load_lm(model_source)
            check_examples(examples, lm.n_layer * lm.n_head, len(BUILTIN_DETECTORS) + len(detectors))
            data = lesson_data(_quiz_folder(lm), stories, quiz, quiz_option="--quiz", text_field=text_field)
            quiz_stories, quiz_source = data.quiz, data.quiz_source
        measures = _beyond_measures(lm) if beyond else ()
        with _timer(timings, "scoring"):  # the one recording pass: head scores (and --beyond's measures)
            encoded = encode_stories(lm, quiz_stories, name_vocabulary(quiz_stories))  # once, for every step
            lines = Counter(ProgressLines("scoring", len(encoded), enabled=progress).update)  # counts batches
            scores = score_heads(
                lm,
                encoded,
                batch_size=batch_size,
                measures=(*measures, lines),
                detectors=BUILTIN_DETECTORS + tuple(detectors),
                max_stories_prev=min(prev_limit, len(quiz_stories)),
                progress=progress,
                examples=examples,
            )
        if scores.n_name_scored == 0:
            raise StorylensError(
                f"{quiz if quiz is not None else 'quiz'}: no story has a main character "
                "(a capitalised name mentioned at least twice): nothing to score name heads on"
            )
        if truth_stories:  # asked for: its cost said (and past the budget refused) before the figures start
            cost = truth_cost(lm, scores, [len(e.ids) for e in encoded], truth_stories)
            check_ablation_budget(cost, "report: --truth-stories", over=over_budget)
        with _timer(timings, "figure data"):
            fig_data = _figure_data(lm, quiz_stories, encoded, scores)
            story_info = fig_data["info"]
        # the drawing and the leakage check (numpy, matplotlib and Python; no model) go to a child
        # process while this one runs the numerical checks and the widget: two cores, two jobs
        check_leakage = data.train is not None or (quiz is None and data.stored_leakage is not None)
        with (
            _timer(timings, "figures and leakage beside checks"),
            run_beside(_beside_model_work, fig_data, scores, tmp, data if check_leakage else None, word) as drawing,
        ):
            with _timer(timings, "check"), _one_thread_if(drawing.forked):  # one core each
                # the lesson's numerical checks are about storylens's own attention and KV cache
                checks = (
                    _numerics(lm.module, quiz_stories, check_stories, check_tokens) if isinstance(lm, NativeLM) else []
                )
            with _timer(timings, "widget"):
                widget = AttentionWidget.from_recording(
                    fig_data["text"],
                    fig_data["tokens"],
                    fig_data["att"],
                    fig_data["enc"],
                    block=story_info["block"],
                    head=story_info["head"],
                    budget=WIDGET_BUDGET,
                    mode="one" if fig_data["n_heads"] <= LESSON_GRID_HEADS else "maps",
                )
                (tmp / "widget.html").write_text(widget.to_html(), encoding="utf-8")
                toy = toy_widget()
        fig_names, leakage, timings["figures"], timings["leakage"] = drawing.result
        figs = _data_uris(tmp, fig_names)
        svgs = _svg_payloads(tmp, fig_names)
        past = None
        if beyond:
            with _timer(timings, "beyond"):
                past, beyond_figs = _beyond_section(lm, quiz_stories, encoded, scores, measures, tmp, progress=progress)
                figs.update(beyond_figs)
                svgs.update(_svg_payloads(tmp, list(beyond_figs)))
        truth, how = None, ""
        n_truth = truth_stories
        if n_truth is None:  # as many of the first stories as the ablations' budget allows
            n_truth = truth_budget_stories(lm, scores, [len(e.ids) for e in encoded])
        if n_truth:
            with _timer(timings, "faithfulness"):  # the top heads switched off, on the first quiz stories
                truth = truth_table(lm, scores, encoded, n_stories=n_truth, batch_size=batch_size, progress=progress)
            how = _truth_stories_note(lm, scores, encoded, truth.n_stories, asked=truth_stories)
        summary = _summary(lm, scores, leakage, quiz_source, data, story_info)
        summary.faithfulness = Faithfulness.of(truth, how) if truth is not None else None
        summary.numerics = [NumericRow.from_dict(c.to_dict()) for c in checks]
        summary.beyond = past
        scores.to_csv(tmp / "heads.csv")
        scores.to_json(tmp / "heads.json")
        if scores.examples is not None:
            write_examples(scores.examples, lm, tmp / "examples.json")
        meta = {
            "model": f"{summary.model.display_name} ({lm.n_layer} blocks x {lm.n_head} heads)",
            "stories": f"{len(quiz_stories):,} quiz stories ({quiz_source})",
            "examples": f"{examples} per head and detector"
            if scores.examples is not None
            else "not kept (--examples 0)",
        }
        write_explorer_for(tmp, title=f"storylens explorer: {summary.model.display_name}", meta=meta)
        timings["total_before_html"] = round(time.perf_counter() - t_start, 3)
        summary.timings_s = timings
        (tmp / "report.html").write_text(
            _html(summary, scores, figs, svgs, widget._repr_html_(), toy._repr_html_()), encoding="utf-8"
        )
        (tmp / "summary.json").write_text(summary.to_json(), encoding="utf-8")
    timings["total"] = round(time.perf_counter() - t_start, 3)
    return Report(out=out, summary=summary, scores=scores, leakage=leakage, timings=timings)


def _truth_stories_note(lm, scores, encoded, n: int, *, asked: int | None) -> str:
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


def _numerics(model, quiz, n_stories: int, n_tokens: int):

    ids = [encode_story(model.tokenizer, s, model.config.block_size).ids for s in quiz[:n_stories]]
    return run_checks(model, ids, gen_tokens=n_tokens)


def _quiz_folder(lm):
    """Where the model's own quiz may lie: its folder, or None for a transformers folder without one
    (:func:`storylens.lesson.lesson_data` then uses the lesson's quiz, shipped with storylens)."""

    folder = lm.source_folder
    if isinstance(lm, NativeLM) or (folder is not None and (folder / QUIZ_FILE).is_file()):
        return folder
    return None


def _beyond_measures(lm):
    """The measures ``--beyond`` feeds from the scoring pass: position control, pronouns."""

    return (PositionControlAccumulator(lm.n_layer, lm.n_head, lm.window), PronounAccumulator(lm.n_layer, lm.n_head))


def _figure_data(lm, quiz, encoded, scores) -> dict:
    """Everything the figures need, computed with the model (the drawing itself never runs it)."""

    mains = [e.main for e in encoded]
    index = _pick_story(quiz, mains, min(lm.window, figure_tokens(lm.n_layer, lm.n_head)))
    tokens, att, enc = story_attention(lm, quiz[index])  # recorded once: figures and widget
    top = scores.best("name_mass")
    main = mains[index]
    if main.positions and max(main.positions) >= len(tokens):  # the story shown is cut to fit the figures' budget
        kept = tuple(p for p in main.positions if p < len(tokens))
        main = replace(main, positions=kept, first_mention=kept[0] if kept else None)
    info = {"index": index, "name": main.name, "block": top.block - 1, "head": top.head - 1, "tokens": len(tokens)}
    return {
        "tokens": tokens,
        "att": att,
        "enc": enc,
        "text": quiz[index],
        "main": main,
        "info": info,
        "n_heads": lm.n_layer * lm.n_head,
    }


def _draw_figures(data: dict, scores, folder: Path) -> list[str]:
    """Draw every figure once and write it as ``NAME.png`` and ``NAME.svg`` into ``folder``; returns
    the names. Pure drawing (numpy and matplotlib), so it can run in a child process beside the
    model work."""

    names: list[str] = []

    def keep(name, fig, dpi=110):
        (folder / f"{name}.png").write_bytes(figure_png_bytes(fig, dpi=dpi))
        (folder / f"{name}.svg").write_bytes(figure_svg_bytes(fig))
        names.append(name)

    tokens, att, main, info = data["tokens"], data["att"], data["main"], data["info"]
    keep(
        "causal_mask", causal_mask_figure(tokens[:8], title="The causal mask: later words are -inf before the softmax")
    )
    if data["n_heads"] <= LESSON_GRID_HEADS:
        grid = all_heads_figure(
            att,
            tokens,
            max_tokens=GRID_TOKENS,
            max_labels=GRID_TOKENS,
            cell_inches=2.55,
            label_fontsize=GRID_LABEL_PT,
            title=f"All {data['n_heads']} heads on quiz story {info['index'] + 1} (first {GRID_TOKENS} tokens)",
        )
        keep("all_heads", grid, dpi=GRID_DPI)  # shown at its own size: labels GRID_LABEL_PT at GRID_DPI
    rows = [(h.label, h.name_mass) for h in scores.heads]
    title = f"Name mass per head over {scores.n_name_scored} quiz stories"
    if len(rows) > BARS_SHOWN:  # past that a bar per head is unreadable: the strongest, in order
        rows = sorted(rows, key=lambda r: -r[1])[:BARS_SHOWN]
        title = (
            f"Name mass: the {BARS_SHOWN} highest of {data['n_heads']} heads, over {scores.n_name_scored} quiz stories"
        )
    keep("name_mass", name_mass_bar_figure(rows, scores.name_baseline, title=title))
    b, h = info["block"], info["head"]
    label = scores.best("name_mass").label
    head_title = None
    if main.positions:
        weights, queries = name_attention_profile(att[b, h], list(main.positions), main.first_mention)
    else:  # a long story whose main character is mentioned only past the tokens drawn
        weights, queries = att[b, h][1:].mean(axis=0), None
        head_title = (
            f"{label}: where it looks in this story\n{main.name} is mentioned only past the {len(tokens)} "
            f"tokens drawn: mean over every query after the marker, no name to box"
        )
    keep(
        "top_name_head",
        name_head_figure(  # its ratio: this story's share over this story's even spread
            tokens,
            weights,
            list(main.positions),
            label=label,
            first_mention=main.first_mention,
            queries=queries,
            max_tokens=160,
            title=head_title,
        ),
    )
    return names


def _beside_model_work(fig_data: dict, scores, folder: Path, data, word: str):
    """What needs no model: the figures, then the leakage check (recomputed when the training
    stories are here; else the check stored with the model, for its own quiz; ``data=None``: a
    quiz of one's own without the corpus cannot be checked). Returns
    ``(figure names, leakage, seconds drawing, seconds checking leakage)``."""

    t = time.perf_counter()
    names = _draw_figures(fig_data, scores, folder)
    t_fig = time.perf_counter() - t
    t = time.perf_counter()
    leakage = leakage_for(data, word) if data is not None else None
    return names, leakage, round(t_fig, 3), round(time.perf_counter() - t, 3)


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _data_uris(folder: Path, names: list[str]) -> dict[str, str]:
    """The PNGs as data URIs for report.html: the same bytes as the files."""
    return {n: _data_uri((folder / f"{n}.png").read_bytes()) for n in names}


def _svg_payloads(folder: Path, names: list[str]) -> dict[str, str]:
    """Each figure's SVG, zlib-deflated and base64-encoded, for the page's SVG buttons."""
    return {n: base64.b64encode(zlib.compress((folder / f"{n}.svg").read_bytes(), 9)).decode("ascii") for n in names}


def _num(x, spec: str = ".3f") -> str:
    """A number as ``format(x, spec)``, or "n/a" for none (the report's Jinja filter ``num``)."""
    return "n/a" if x is None else format(x, spec)


def _f(x, nd=3) -> str:
    return _num(x, f".{nd}f")


def _leakage_summary(leakage, data) -> Leakage:
    if leakage is None:
        if getattr(data, "shipped_with_storylens", False):
            return Leakage(
                computed=False,
                source="not computed: the quiz is the lesson's, shipped with storylens, "
                "and no training stories are here to check it against (get "
                "TinyStories with storylens data download, or pass --stories)",
            )
        return Leakage(
            computed=False,
            source="not computed: no training stories here (get them with storylens data download, or pass --stories)",
        )
    src = (
        f"recomputed against the {leakage.n_train:,} training stories"
        if data.train is not None
        else f"stored with the model (computed against its {leakage.n_train:,} training stories when it was trained)"
    )
    return Leakage(
        computed=True, source=src, recomputed=data.train is not None, stats=LeakageStats.from_dict(leakage.summary())
    )


def _model_info(lm) -> ModelInfo:
    return ModelInfo(
        name=str(lm.name),
        parameters=sum(p.numel() for p in lm.module.parameters()),
        blocks=lm.n_layer,
        heads=lm.n_head,
        window=lm.window,
        display_name=_display_name(lm),
        # the lesson's figures are about Tiny Storyteller: compared only for storylens's own models
        lesson_comparison=isinstance(lm, NativeLM),
    )


def _quiz_info(scores, leakage, quiz_source, data) -> QuizInfo:
    return QuizInfo(
        source=quiz_source,
        stories=scores.n_stories,
        cut_to_window=scores.n_cut,
        with_main_character=scores.n_main_character,
        name_scored=scores.n_name_scored,
        skipped=scores.n_skipped_no_name,
        shipped_with_storylens=bool(getattr(data, "shipped_with_storylens", False)),
        train_stories=leakage.n_train if leakage is not None else None,
    )


def _previous_token(scores) -> PreviousToken:
    prev, prev_first = scores.best("prev_token"), scores.best("prev_token_first")
    argmax_first, argmax_all = scores.best("prev_argmax_first"), scores.best("prev_argmax")
    return PreviousToken(
        above_half=scores.count("prev_token", above=PREV_HEAD_LEVEL),
        highest=PrevHighest(prev.label, prev.prev_token),
        highest_first=PrevFirst(
            prev_first.label, prev_first.prev_token_first, prev_first.prev4_first, scores.n_prev_first
        ),
        best_argmax_first=ArgmaxFirst(argmax_first.label, argmax_first.prev_argmax_first, scores.n_prev_first),
        best_argmax_all=ArgmaxAll(argmax_all.label, argmax_all.prev_argmax),
    )


def _summary(lm, scores, leakage, quiz_source, data, story_info) -> ReportSummary:
    """The report's figures (without the numerical checks, ``--beyond`` and the timings: the caller adds them)."""

    top = scores.top("name_mass", TOP_HEADS)
    marker = scores.best("marker")
    return ReportSummary(
        model=_model_info(lm),
        quiz=_quiz_info(scores, leakage, quiz_source, data),
        leakage=_leakage_summary(leakage, data),
        name_heads=NameHeads(
            baseline=scores.name_baseline,
            top=[HeadMass(h.label, h.name_mass, h.name_ratio) for h in top],
            below_baseline=scores.count("name_mass", below=scores.name_baseline),
        ),
        previous_token=_previous_token(scores),
        marker=Marker(
            highest=MarkerHighest(marker.label, marker.marker),
            above_half=scores.count("marker", above=MARKER_HEAD_LEVEL),
            called=_marker_words(lm),
        ),
        story_shown=StoryShown(story_info["index"] + 1, story_info["name"], story_info["tokens"]),
        number_to_reproduce=NumberToReproduce(
            head=top[0].label,
            name_mass=top[0].name_mass,
            baseline=scores.name_baseline,
            ratio=top[0].name_ratio,
            stories=scores.n_name_scored,
            of=scores.n_stories,
        ),
    )


def _display_name(lm) -> str:
    """The model's name for people: a folder's own name (never the path to it), else the hub id."""
    if lm.source_folder is not None and Path(str(lm.name)) == Path(lm.source_folder):
        return Path(lm.source_folder).resolve().name or str(lm.name)
    name = str(lm.name)
    return Path(name).name if os.path.isabs(name) else name


def _marker_words(lm) -> str:
    """What the token that opens every sequence is, in this model's terms: Tiny Storyteller's
    end-of-story marker, or a transformers model's BOS token (its EOS where it has no BOS)."""

    if isinstance(lm, NativeLM):
        return "the end-of-story marker"
    cfg = getattr(lm.module, "config", None)
    bos, eos = getattr(cfg, "bos_token_id", None), getattr(cfg, "eos_token_id", None)
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    if bos is None and lm.marker_id in eos:
        return "the opening token (EOS, put before each story)"
    return "the opening token (BOS)"


# ---------------------------------------------------------------- the page (templates/report.html.j2)

_ENV = Environment(
    loader=PackageLoader("storylens.lesson", "templates"),
    autoescape=True,  # every value is escaped; trusted HTML fragments come in as Markup
    undefined=StrictUndefined,
    keep_trailing_newline=True,
)
_ENV.filters["num"] = _num


def _column_title(col: str, marker: str) -> str:
    if col.startswith("norm_"):
        return "Norm-weighted: " + _column_title(col[len("norm_") :], marker).lower()
    if col == "output_share":
        return "Output share: the head's part of its block's head-output sizes"
    return f"Attention on {marker}" if col == "marker" else SCORE_TITLES.get(col, f"Detector {col} (from --detector)")


def _overview(scores, marker: str) -> list[dict]:
    """The overview's grids: every detector raw, then norm-weighted, then the output share (the
    columns this run has values for), each a block x head table."""
    raw = [*SCORE_TITLES, *scores.extra_columns]
    cols = [*raw, *(f"norm_{c}" for c in raw), "output_share"]
    have = [c for c in cols if any(v is not None and v == v for v in scores.column(c))]
    return [{"col": c, "title": _column_title(c, marker), "heat": _heat(scores, c, marker)} for c in have]


def _heat(scores, col: str, marker: str) -> dict:
    """One score as a coloured block x head table (the best head boxed): HTML, not an image. Each
    table is coloured over its own range, and its caption says so."""

    title = _column_title(col, marker)
    values = [v for row in scores.grid(col) for v in row if v is not None and v == v]
    note = (
        f"Colours: this table's own range, {min(values):.3f} (black) to {max(values):.3f} (light yellow); "
        "compare tables by their numbers, not their colours."
        if values
        else "No values."
    )
    table = head_heatmap_html(scores.grid(col), title=title, highlight=scores.best(col).label)
    return {"table": Markup(table), "note": note}


def _numerics_rows(s: ReportSummary) -> list[list[str]]:
    return [
        [
            c.name,
            c.dtype,
            f"{c.measured:.2e}",
            f"{c.bound:.2e}",
            "" if c.lesson is None else f"{c.lesson:.0e}",
            "yes" if c.passed else "NO",
            c.lesson_note,
            c.detail,
        ]
        for c in s.numerics
    ]


def _leak_rows(s: ReportSummary) -> list[list]:
    lk = s.leakage.stats
    if lk is None:
        return [["leakage check", s.leakage.source]]
    return [
        ["identical to a training story", lk.n_duplicates],
        [f"mentioning “{lk.word}”", lk.n_mentioning],
        [f"mean share of {lk.run_words}-word runs found in training", _f(lk.run_share_mean)],
        [f"maximum share of {lk.run_words}-word runs", _f(lk.run_share_max)],
    ]


def _head_rows(scores) -> list[list[str]]:
    return [
        [
            h.label,
            _f(h.name_mass),
            f"{h.name_ratio:.2f}",
            _f(h.prev_token),
            _f(h.prev_argmax),
            _f(h.prev4),
            _f(h.marker),
            _f(h.norm_marker),
            "" if h.output_share is None else f"{h.output_share:.1%}",
            h.looks_without_moving,
        ]
        for h in scores.heads
    ]


def _beyond_rows(b: BeyondSummary | None) -> dict | None:
    """Section 8's tables, their cells as text."""
    if b is None:
        return None

    def f(x) -> str:
        return _num(x, "+.4f")

    a = b.ablation
    return {
        "ablation_rows": [
            [
                r.head,
                f"{r.name_mass:.3f}",
                f(r.zero_name_increase),
                f(r.zero_other_increase),
                f(r.mean_name_increase),
                f(r.mean_other_increase),
            ]
            for r in a.rows[:10]
        ],
        "group_rows": [[g.heads, g.mode, f(g.name_increase), f(g.other_increase)] for g in a.groups],
        "position_rows": [
            [r.head, f"{r.name_mass:.3f}", f"{r.control:.3f}", f"{r.excess:+.3f}"]
            for r in b.position_control.ranking_by_excess
        ],
        "pronoun_rows": [[r.head, f"{r.pronoun_mass:.3f}", f"{r.other_mass:.3f}"] for r in b.pronouns.ranking],
    }


def _page(
    s: ReportSummary, scores, figs: dict[str, str], svgs: dict[str, str], widget_html: str, toy_html: str
) -> dict:
    """What the template reads: the summary, the lesson's figures, and the page's tables and fragments."""

    lesson = s.model.lesson_comparison  # the lesson's figures are Tiny Storyteller's: only beside its kind
    example = LESSON_FIGURES.top_head if lesson else s.name_heads.top[0].head  # a head this model has
    ex_block, ex_head = parse_head_label(example)  # 0-based
    counter = next((c for c in s.numerics if c.name == "key/value computations" and c.dtype == "float32"), None)
    return {
        "s": s,
        "L": LESSON_FIGURES,
        "lesson": lesson,
        "n_heads": s.model.n_heads,
        "name": s.model.display_name,
        "example": example,
        "ex_block": ex_block,
        "ex_head": ex_head,
        "heatmap_css": Markup(HEATMAP_CSS),
        "toy_html": Markup(toy_html),
        "widget_html": Markup(widget_html),
        "figs": {k: Markup(v) for k, v in figs.items()},
        "svgs": svgs,
        "lesson_grid": s.model.n_heads <= LESSON_GRID_HEADS,
        "bars_shown": BARS_SHOWN,
        "overview": _overview(scores, s.marker.called),
        "page_js": Markup(page_script()),
        "explore": True,
        "label_px": GRID_LABEL_PT * GRID_DPI / 72,
        "check_stories": CHECK_STORIES,
        "check_tokens": CHECK_TOKENS,
        "counter": counter,
        "numerics_rows": _numerics_rows(s),
        "leak_rows": _leak_rows(s),
        "name_rows": [
            [h.head, _f(h.name_mass), _f(s.name_heads.baseline), f"{h.ratio:.1f}x"] for h in s.name_heads.top
        ],
        "heat": {c: _heat(scores, c, s.marker.called) for c in (*SCORE_TITLES, *scores.extra_columns)},
        "extra_columns": list(scores.extra_columns),
        "all_rows": _head_rows(scores),
        "beyond": _beyond_rows(s.beyond),
        "truth_rows": _truth_rows(s.faithfulness),
        "agreement_rows": _agreement_rows(s.faithfulness),
    }


def _signed(x: float | None) -> str:
    return "" if x is None else f"{x:+.4f}"


def _agreement_rows(t: Faithfulness | None) -> list[list[str]]:
    """Per detector: Spearman's rho between the raw and norm-weighted columns over every head, and the
    heads whose rank moves most (raw rank -> norm-weighted rank, 1 = strongest)."""
    if t is None:
        return []
    return [
        [
            a.detector,
            "" if a.rho is None else f"{a.rho:.3f}",
            ", ".join(f"{h} {r_raw:g} \u2192 {r_norm:g}" for h, r_raw, r_norm in a.moves),
        ]
        for a in t.agreements
    ]


def _truth_rows(t: Faithfulness | None) -> list[list[str]]:
    """The faithfulness table's cells: detector, head, raw, norm-weighted, output share, loss change
    switched off (zero, mean) and where, and the flag."""
    if t is None:
        return []
    return [
        [
            r.detector,
            r.head,
            _f(r.raw),
            _f(r.norm),
            "" if r.share is None else f"{r.share:.1%}",
            _signed(r.zero_increase),
            _signed(r.mean_increase),
            r.where,
            "looks without moving" if r.flagged else "",
        ]
        for r in t.rows
    ]


def _html(s: ReportSummary, scores, figs: dict[str, str], svgs: dict[str, str], widget_html: str, toy_html: str) -> str:
    """report.html: templates/report.html.j2 (and beyond.html.j2 with ``--beyond``), autoescaped."""
    return _ENV.get_template("report.html.j2").render(_page(s, scores, figs, svgs, widget_html, toy_html))


LESSON_TABLE = "lesson-table"  # README markers: <!-- lesson-table:start --> ... <!-- lesson-table:end -->


def _pct(x: float, nd: int = 1) -> str:
    return f"{100 * x:.{nd}f}%"


def lesson_table(s: ReportSummary) -> str:
    """The README's "ours against the lesson" table, from a report's summary (never typed in)."""
    L = LESSON_FIGURES
    q, lk, nh, pt, mk = s.quiz, s.leakage.stats, s.name_heads, s.previous_token, s.marker
    top, rest = nh.top[0], nh.top[1:]
    leak = (
        f"{lk.n_duplicates} / {lk.n_mentioning} / {_pct(lk.run_share_mean)}, {_pct(lk.run_share_max)}"
        if lk is not None
        else "not computed"
    )
    lesson_leak = (
        f"{L.leakage_identical} / {L.leakage_mentioning} / {_pct(L.run_share_mean)}, {_pct(L.run_share_max, 0)}"
    )
    first, argmax = pt.highest_first, pt.best_argmax_first
    rows = [
        (
            f"quiz stories cut to the {L.window}-token window",
            f"{L.cut_to_window} of {L.quiz_stories}",
            f"{q.cut_to_window} of {q.stories}",
        ),
        (f'leakage: identical / mention "{L.leakage_word}" / {L.run_words}-word runs mean, max', lesson_leak, leak),
        ("stories with a main character", f"{L.with_main_character}", f"{q.with_main_character}"),
        ("even-spread baseline", f"{L.baseline:.3f}", f"{nh.baseline:.3f}"),
        (
            "top name head (name mass, ratio)",
            f"{L.top_head} {L.top_name_mass:.3f} ({L.top_ratio:.1f}x)",
            f"**{top.head} {top.name_mass:.3f} ({top.ratio:.1f}x)**",
        ),
        ("next five", ", ".join((*L.close_behind, "...")), ", ".join(f"{h.head} {h.name_mass:.3f}" for h in rest)),
        ("heads below the baseline", f"{L.below_baseline} of {L.heads}", f"{nh.below_baseline} of {s.model.n_heads}"),
        (f"previous-token heads above {PREV_HEAD_LEVEL}", f"{L.prev_heads}", f"{pt.above_half}"),
        (
            "highest previous-token head",
            f"{L.prev_highest_head} {L.prev_highest:.3f}",
            f"{pt.highest.head} {pt.highest.prev_token:.3f}",
        ),
        (
            f"first {first.stories} stories: best prev-token / last four",
            f"{L.prev_first_head} {L.prev_first:.3f} / {L.prev4_first:.3f}",
            f"{first.head} {first.prev_token:.3f} / {first.prev4:.3f}",
        ),
        (
            f"best share of queries whose top key is the previous token (first {argmax.stories})",
            f"{L.prev_argmax_first:.3f}",
            f"{argmax.head} {argmax.share:.3f}",
        ),
        ("highest end-of-story-marker head", f"{L.marker_highest:.3f}", f"{mk.highest.head} {mk.highest.marker:.3f}"),
    ]
    lines = ["| measure | lesson | ours |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def _beyond_section(lm, stories, encoded, scores, measures, tmp, *, progress: bool = True):
    """(typed summary, {figure name: data URI}) for the report's section 8; its PNG and SVG written into ``tmp``."""

    position, pronouns = (m.result() for m in measures)  # fed by the scoring pass: no second recording
    b = run_beyond(lm, stories, scores, position=position, pronouns=pronouns, encoded=encoded, progress=progress)
    s = BeyondSummary.from_dict(beyond_summary(b, scores))
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
    return s, {"ablation_name_loss": _data_uri(png)}
