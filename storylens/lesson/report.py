"""The whole lesson in one call: ``storylens report``.

:func:`build_report` loads the model and the stories, runs the leakage check, scores
every head over the quiz (streaming), draws the figures and the widget, and writes
``report.html`` (one self-contained file), ``heads.csv``, ``heads.json``,
``summary.json`` and the PNG figures into ``out``. Everything is first written to a
temporary folder beside ``out`` and moved in only when complete, so a failure leaves
nothing half-written.
"""

from __future__ import annotations

import html
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from storylens.analysis.detectors import BUILTIN_DETECTORS
from storylens.analysis.encode import encode_stories
from storylens.analysis.names import name_vocabulary
from storylens.analysis.position import PositionControlAccumulator
from storylens.analysis.pronouns import PronounAccumulator
from storylens.analysis.scores import score_heads
from storylens.core.background import run_beside
from storylens.core.errors import StorylensError
from storylens.core.heads import parse_head_label
from storylens.core.progress import ProgressLines, progress_command
from storylens.core.publish import check_target_folder, publish_folder
from storylens.data.stories import QUIZ_FILE
from storylens.lesson.beyond import beyond_summary, run_beyond
from storylens.lesson.checks import run_checks
from storylens.lesson.inputs import leakage_for, lesson_data
from storylens.lm import NativeLM, load_lm, wrap
from storylens.model.tokenizer import encode_story
from storylens.recording import story_attention
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
from storylens.viz.figures import figure_png_bytes, head_heatmap_figure

CHECK_STORIES = 4  # the report's numerical checks run on the first 4 quiz stories ...
CHECK_TOKENS = 32  # ... and 32 generated tokens (storylens check runs all 200 stories and 200 tokens)
from storylens.lesson.figures import FIRST_STORIES as PREV_LIMIT  # noqa: E402

GRID_TOKENS = 24  # the 24-head grid shows the first 24 tokens, every one labelled ...
GRID_LABEL_PT = 8.5  # ... in 8.5-point type at 100 dpi (about 12 pixels), shown unscaled in the page
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
    summary: dict
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


def _pick_story(quiz: list[str], scores_mains) -> int:
    """The first quiz story with a main character mentioned early and at least 60 tokens."""
    for i, m in enumerate(scores_mains):
        if m is not None and m.first_mention is not None and m.first_mention < 40 and len(m.positions) >= 3:
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
    word: str = "Momo",
    prev_limit: int = PREV_LIMIT,
    batch_size: int = 16,
    beyond: bool = False,
    detectors=(),
    progress: bool = True,
    check_stories: int = CHECK_STORIES,
    check_tokens: int = CHECK_TOKENS,
) -> Report:
    """Run the lesson on ``model`` (default: the shipped one) and write the report into ``out``.

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
) -> Report:

    timings: dict = {}
    t_start = time.perf_counter()
    out = _check_writable(Path(out))
    # one lock and one temporary folder for the whole run: a second run into the same --out is
    # refused at once, and a kill at any moment leaves the old report (see storylens.core.publish)
    with publish_folder(out, "report") as tmp:
        with _timer(timings, "load"):
            lm = wrap(model) if model is not None else load_lm(model_source)
            data = lesson_data(_quiz_folder(lm), stories, quiz, quiz_option="--quiz", text_field=text_field)
            quiz_stories, quiz_source = data.quiz, data.quiz_source
        measures = _beyond_measures(lm) if beyond else ()
        with _timer(timings, "scoring"):  # the one recording pass: head scores (and --beyond's measures)
            encoded = encode_stories(lm, quiz_stories, name_vocabulary(quiz_stories))  # once, for every step
            lines = ProgressLines("scoring", len(encoded), enabled=progress)  # a measure that only counts
            scores = score_heads(
                lm,
                encoded,
                batch_size=batch_size,
                measures=(*measures, lines),
                detectors=BUILTIN_DETECTORS + tuple(detectors),
                max_stories_prev=min(prev_limit, len(quiz_stories)),
                progress=progress,
            )
        if scores.n_name_scored == 0:
            raise StorylensError(
                f"{quiz if quiz is not None else 'quiz'}: no story has a main character "
                "(a capitalised name mentioned at least twice): nothing to score name heads on"
            )
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
                )
                (tmp / "widget.html").write_text(widget.to_html(), encoding="utf-8")
                toy = toy_widget()
        fig_names, leakage, timings["figures"], timings["leakage"] = drawing.result
        figs = _data_uris(tmp, fig_names)
        beyond_html = ""
        beyond_summary = None
        if beyond:
            with _timer(timings, "beyond"):
                beyond_summary, beyond_html, beyond_figs = _beyond_section(
                    lm, quiz_stories, encoded, scores, measures, tmp, progress=progress
                )
                figs.update(beyond_figs)
        summary = _summary(lm, scores, leakage, quiz_source, data, story_info)
        summary["numerics"] = [c.to_dict() for c in checks]
        if beyond_summary is not None:
            summary["beyond"] = beyond_summary
        scores.to_csv(tmp / "heads.csv")
        scores.to_json(tmp / "heads.json")
        timings["total_before_html"] = round(time.perf_counter() - t_start, 3)
        summary["timings_s"] = timings
        (tmp / "report.html").write_text(
            _html(summary, scores, figs, widget._repr_html_(), toy._repr_html_(), beyond_html), encoding="utf-8"
        )
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    timings["total"] = round(time.perf_counter() - t_start, 3)
    return Report(out=out, summary=summary, scores=scores, leakage=leakage, timings=timings)


def _numerics(model, quiz, n_stories: int, n_tokens: int):

    ids = [encode_story(model.tokenizer, s, model.config.block_size).ids for s in quiz[:n_stories]]
    return run_checks(model, ids, gen_tokens=n_tokens)


def _numerics_html(checks: list[dict]) -> str:
    if not checks:
        return (
            "<p><i>Not run for this model: the checks measure storylens's own attention switch and KV "
            "cache (run the report on a storylens model to see them).</i></p>"
        )
    rows = [
        [
            c["name"],
            c["dtype"],
            f"{c['measured']:.2e}",
            f"{c['bound']:.2e}",
            "" if c["lesson"] is None else f"{c['lesson']:.0e}",
            "yes" if c["passed"] else "NO",
            c["detail"],
        ]
        for c in checks
    ]
    return _table(["check", "dtype", "measured here", "rounding bound", "lesson", "within", "detail"], rows)


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
    index = _pick_story(quiz, mains)
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
    """Draw every figure once and write it as ``NAME.png`` into ``folder``; returns the names.
    Pure drawing (numpy and matplotlib), so it can run in a child process beside the model work."""

    names: list[str] = []

    def keep(name, fig, dpi=110):
        (folder / f"{name}.png").write_bytes(figure_png_bytes(fig, dpi=dpi))
        names.append(name)

    tokens, att, main, info = data["tokens"], data["att"], data["main"], data["info"]
    keep(
        "causal_mask", causal_mask_figure(tokens[:8], title="The causal mask: later words are -inf before the softmax")
    )
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
    keep(
        "name_mass",
        name_mass_bar_figure(
            rows, scores.name_baseline, title=f"Name mass per head over {scores.n_name_scored} quiz stories"
        ),
    )
    b, h = info["block"], info["head"]
    weights, _ = name_attention_profile(att[b, h], list(main.positions), main.first_mention)
    keep(
        "top_name_head",
        name_head_figure(
            tokens,
            weights,
            list(main.positions),
            label=scores.best("name_mass").label,
            first_mention=main.first_mention,
            baseline=scores.name_baseline,
            max_tokens=160,
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


def _data_uris(folder: Path, names: list[str]) -> dict[str, str]:
    """The PNGs as data URIs for report.html: the same bytes as the files."""
    import base64

    return {
        n: "data:image/png;base64," + base64.b64encode((folder / f"{n}.png").read_bytes()).decode("ascii")
        for n in names
    }


def _f(x, nd=3):
    return "n/a" if x is None else f"{x:.{nd}f}"


def _leakage_summary(leakage, data) -> dict:
    if leakage is None:
        if getattr(data, "shipped_with_storylens", False):
            return {
                "computed": False,
                "source": "not computed: the quiz is the lesson's, shipped with storylens, "
                "and no training stories are here to check it against (get "
                "TinyStories with storylens data download, or pass --stories)",
            }
        return {
            "computed": False,
            "source": "not computed: no training stories here (get them with "
            "storylens data download, or pass --stories)",
        }
    src = (
        f"recomputed against the {leakage.n_train:,} training stories"
        if data.train is not None
        else f"stored with the model (computed against its {leakage.n_train:,} training stories when it was trained)"
    )
    return {"computed": True, "recomputed": data.train is not None, "source": src, **leakage.summary()}


def _summary(lm, scores, leakage, quiz_source, data, story_info) -> dict:

    top6 = scores.top("name_mass", 6)
    prev = scores.best("prev_token")
    prev_first = scores.best("prev_token_first")
    argmax_first = scores.best("prev_argmax_first")
    argmax_all = scores.best("prev_argmax")
    marker = scores.best("marker")
    return {
        "model": {
            "name": str(lm.name),
            "parameters": sum(p.numel() for p in lm.module.parameters()),
            "blocks": lm.n_layer,
            "heads": lm.n_head,
            "window": lm.window,
            "display_name": _display_name(lm),
            # the lesson's figures are about Tiny Storyteller: compared only for storylens's own models
            "lesson_comparison": isinstance(lm, NativeLM),
        },
        "quiz": {
            "source": quiz_source,
            "stories": scores.n_stories,
            "cut_to_window": scores.n_cut,
            "with_main_character": scores.n_main_character,
            "name_scored": scores.n_name_scored,
            "skipped": scores.n_skipped_no_name,
            "shipped_with_storylens": bool(getattr(data, "shipped_with_storylens", False)),
            "train_stories": leakage.n_train if leakage is not None else None,
        },
        "leakage": _leakage_summary(leakage, data),
        "name_heads": {
            "baseline": scores.name_baseline,
            "top": [{"head": h.label, "name_mass": h.name_mass, "ratio": h.name_ratio} for h in top6],
            "below_baseline": scores.count("name_mass", below=scores.name_baseline),
        },
        "previous_token": {
            "above_half": scores.count("prev_token", above=0.5),
            "highest": {"head": prev.label, "prev_token": prev.prev_token},
            "highest_first": {
                "head": prev_first.label,
                "prev_token": prev_first.prev_token_first,
                "prev4": prev_first.prev4_first,
                "stories": scores.n_prev_first,
            },
            "best_argmax_first": {
                "head": argmax_first.label,
                "share": argmax_first.prev_argmax_first,
                "stories": scores.n_prev_first,
            },
            "best_argmax_all": {"head": argmax_all.label, "share": argmax_all.prev_argmax},
        },
        "marker": {
            "highest": {"head": marker.label, "marker": marker.marker},
            "above_half": scores.count("marker", above=0.5),
            "called": _marker_words(lm),
        },
        "story_shown": {
            "quiz_index": story_info["index"] + 1,
            "main_character": story_info["name"],
            "tokens": story_info["tokens"],
        },
        "number_to_reproduce": {
            "head": top6[0].label,
            "name_mass": top6[0].name_mass,
            "baseline": scores.name_baseline,
            "ratio": top6[0].name_ratio,
            "stories": scores.n_name_scored,
            "of": scores.n_stories,
        },
    }


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


def _table(header, rows) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _heat(scores, col: str, marker: str = "the end-of-story marker") -> str:
    """One score as a coloured block x head table (the best head boxed): HTML, not an image. Each
    table is coloured over its own range, and its caption says so."""

    title = f"Attention on {marker}" if col == "marker" else SCORE_TITLES.get(col, f"Detector {col} (from --detector)")
    values = [v for row in scores.grid(col) for v in row if v is not None and v == v]
    note = (
        f"Colours: this table's own range, {min(values):.3f} (black) to {max(values):.3f} (light yellow); "
        "compare tables by their numbers, not their colours."
        if values
        else "No values."
    )
    return (
        f"<figure>{head_heatmap_html(scores.grid(col), title=title, highlight=scores.best(col).label)}"
        f"<figcaption>{html.escape(note)}</figcaption></figure>"
    )


def _img(figs, name, alt, cls="", attrs="") -> str:
    c = f' class="{cls}"' if cls else ""
    return (
        f'<figure{c}><img src="{figs[name]}" alt="{html.escape(alt)}"{attrs}>'
        f"<figcaption>{html.escape(alt)}</figcaption></figure>"
    )


def _html(s, scores, figs, widget_html, toy_html, beyond_html) -> str:

    q, lk, nh, pt, mk, nr = (
        s["quiz"],
        s["leakage"],
        s["name_heads"],
        s["previous_token"],
        s["marker"],
        s["number_to_reproduce"],
    )
    top = nh["top"][0]
    e = html.escape
    leak_rows = (
        [
            ["identical to a training story", lk["n_duplicates"]],
            [f"mentioning “{lk['word']}”", lk["n_mentioning"]],
            [f"mean share of {lk['run_words']}-word runs found in training", _f(lk["run_share_mean"])],
            [f"maximum share of {lk['run_words']}-word runs", _f(lk["run_share_max"])],
        ]
        if lk["computed"]
        else [["leakage check", lk["source"]]]
    )
    name_rows = [[h["head"], _f(h["name_mass"]), _f(nh["baseline"]), f"{h['ratio']:.1f}x"] for h in nh["top"]]
    all_rows = [
        [
            h.label,
            _f(h.name_mass),
            f"{h.name_ratio:.2f}",
            _f(h.prev_token),
            _f(h.prev_argmax),
            _f(h.prev4),
            _f(h.marker),
        ]
        for h in scores.heads
    ]
    counter = next(
        (c for c in s["numerics"] if c["name"] == "key/value computations" and c["dtype"] == "float32"), None
    )
    label_px = GRID_LABEL_PT * GRID_DPI / 72
    css = (
        """body{font:15px/1.55 system-ui,-apple-system,Segoe UI,sans-serif;max-width:1180px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.7em}h2{margin-top:2em;border-bottom:1px solid #ddd}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 9px;text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{color:#666;font-size:.9em}
figure.wide{overflow-x:auto}figure.wide img{max-width:none}
.pair{display:grid;grid-template-columns:repeat(auto-fit,minmax(460px,1fr));gap:0 1.5em;align-items:start}
.num{font-size:1.25em;background:#f7f7ff;border-left:4px solid #66c;padding:.6em 1em}"""
        + HEATMAP_CSS
    )
    n_heads = s["model"]["blocks"] * s["model"]["heads"]
    name = e(s["model"]["display_name"])
    lesson = s["model"]["lesson_comparison"]  # the lesson's figures are Tiny Storyteller's: only beside its kind

    def vs(text: str) -> str:
        """A comparison with the lesson's figure, shown for storylens's own models only."""
        return text if lesson else ""

    example = "L5H3" if lesson else top["head"]  # a head this model has
    ex_block, ex_head = parse_head_label(example)  # 0-based
    called = mk.get("called", "the end-of-story marker")
    Called = called[0].upper() + called[1:]
    heat = lambda col: _heat(scores, col, called)  # noqa: E731
    if lk["computed"] and lk["word"] == "Momo":
        momo = (
            "“Momo” is the lesson's leakage check word. In the lesson's story Momo the monkey is the model "
            "(his dials are its weights) and Ella the elephant the teacher; the check counts the quiz stories "
            "that mention him."
        )
    else:
        momo = ""
    lesson_leak = (
        vs(" (the lesson: none identical, none mentioning Momo, 8-word runs 8.7% on average, 30% at most)") + "."
    )
    if not lesson and lk["computed"] and lk["recomputed"]:
        lesson_leak += (
            " These are the lesson corpus's training stories, not necessarily the ones this model was trained on."
        )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>storylens: {name}'s attention</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'">
<style>{css}</style></head><body>
<h1>Reading {name}'s attention</h1>
<p>Every number on this page was computed by storylens on this machine, with {name}
({s["model"]["parameters"]:,} parameters, {s["model"]["blocks"]} blocks x {s["model"]["heads"]} heads,
{s["model"]["window"]}-token window) and {q["stories"]} quiz stories ({e(q["source"])}).
{q["cut_to_window"]} of them were cut to the {s["model"]["window"]}-token window{vs(" (the lesson had 5 of 200)")}.
Heads are labelled as the lesson does: <b>{example}</b> is block {ex_block + 1}, head {
        ex_head + 1
    }, counting from 1.</p>

<h2>1. How attention works</h2>
<p>Each word of a story gets, from each head, three short lists of numbers: a <b>query</b> (what it is
looking for), a <b>key</b> (what it offers) and a <b>value</b> (what it passes on). A word scores every
earlier word by the dot product of its query with their keys, turns the scores into shares that add up
to one with a softmax, and takes the share-weighted blend of their values. The shares are the attention
probabilities. The toy below uses two hand-set numbers per query and key (not the model's): click a word,
edit the numbers, watch the shares move.</p>
{toy_html}
<h3>The triangle</h3>
<p>Before the softmax every score for a later word is set to minus infinity, so its share is exactly zero:
the upper right of every map is this causal mask, not a choice the head made.</p>
{_img(figs, "causal_mask", "The causal mask")}
<h3>The switch and the shelf, measured here</h3>
<p>storylens's model has one flag, <code>record_attention</code>: off, each block runs PyTorch's fused
attention kernel; on, it computes the scores, mask and softmax explicitly and keeps the probabilities as
<code>[batch, head, query, key]</code>. Because earlier words never see later ones, their keys and values
never change, so generation can keep them on a shelf (the KV cache) and compute only the newest token's.
The table is this computer's own measurement of both promises (first {CHECK_STORIES} quiz stories,
{CHECK_TOKENS} generated tokens; <code>storylens check</code> runs all of them), each beside the bound that
rounding alone allows, in float32 and float64 (derived in <code>storylens.lesson.checks</code>).
{"Key/value computations: " + e(counter["detail"]) + "." if counter else ""}</p>
{_numerics_html(s["numerics"])}

<h2>2. All {n_heads} heads on one story</h2>
<p>Row: the token looking back (query); column: the token looked at (key); brighter (towards yellow): a larger
share, dark purple: almost none (viridis on a power scale, so small shares still show; every map uses the same
scale, 0 to 1). The flat dark grey upper right of each map is the causal mask.</p>
{_img(figs, "all_heads", f"All {n_heads} heads, one quiz story", cls="wide", attrs=f' data-label-px="{label_px:.1f}"')}
<h3>Click a token</h3>
<p>The same story in the widget: click a token to see where it looks; pick a block and head, or all {n_heads}.</p>
{widget_html}

<h2>3. Leakage check</h2>
<p>Quiz stories against the training stories: {e(lk["source"])}{e(lesson_leak)}</p>
{"<p>" + e(momo) + "</p>" if momo else ""}
{_table(["check", "ours"], leak_rows)}

<h2>4. The name-tracking head</h2>
<p>A name is a capitalised word whose lowercase form appears nowhere in the {q["stories"]} quiz stories; the
main character is a story's most frequent name with at least two mentions. {q["with_main_character"]} of
{q["stories"]} stories have one; {q["name_scored"]} are scored, {q["skipped"]} skipped{vs(" (the lesson: 159 of 200)")}.
Even-spread baseline: <b>{_f(nh["baseline"])}</b>{vs(" (lesson: 0.052)")}.</p>
{_table(["head", "name mass", "baseline", "ratio"], name_rows)}
<p>{nh["below_baseline"]} of {n_heads} heads put less on the name than an even spread would{vs(" (lesson: 17)")}.</p>
{_img(figs, "name_mass", "Name mass per head against the baseline")}
<div class="pair">{heat("name_mass")}
{heat("name_ratio")}</div>
{_img(figs, "top_name_head", f"{top['head']} on one story: where it looks after the first mention")}

<h2>5. Three honest limits</h2>
<ol><li>{top["head"]} puts about {100 * top["name_mass"]:.0f}% of its attention on the name, not all of it:
a tendency, not a switch.</li>
<li>Attention is where a head looks, not proof of what the model relies on; the lesson switched no head off
(section 8, when run with <code>--beyond</code>, does).</li>
<li>Name position is not controlled: a name early in a story may draw attention partly for being early.</li></ol>

<h2>6. Previous-token heads, and heads on {e(called)}</h2>
<p>Heads with more than half their attention on the word just before: <b>{pt["above_half"]} of {n_heads}</b>{
        vs(" (lesson: 0)")
    }.
Highest: {pt["highest"]["head"]} at {_f(pt["highest"]["prev_token"])} over all stories;
on the first {pt["highest_first"]["stories"]} stories {pt["highest_first"]["head"]} puts
{_f(pt["highest_first"]["prev_token"])} on the previous word and {_f(pt["highest_first"]["prev4"])} on the last four{
        vs(" (lesson: L1H1, 0.140 and 0.389)")
    }.
The previous word is the single most-attended one for
{_f(pt["best_argmax_first"]["share"])} of queries at best ({pt["best_argmax_first"]["head"]}, first
{pt["best_argmax_first"]["stories"]} stories; {_f(pt["best_argmax_all"]["share"])} over all, {
        pt["best_argmax_all"]["head"]
    }{vs("; lesson: 0.369")}).
{e(Called)}: the highest head is {mk["highest"]["head"]} at {_f(mk["highest"]["marker"])}{vs(" (lesson: 0.065)")}; {
        mk["above_half"]
    } heads lean mostly on it.</p>
<div class="pair">{heat("prev_token")}
{heat("prev_argmax")}
{heat("prev4")}
{heat("marker")}</div>

<h3>More detectors</h3>
<p>TransformerLens's two token patterns, as attention masses over the queries they apply to
(<code>storylens.analysis.detectors</code>){
        ", and the detectors given with --detector" if scores.extra_columns else ""
    }:</p>
<div class="pair">{"".join(heat(c) for c in ("duplicate_token", "induction") + scores.extra_columns)}</div>

<h2>7. The number to reproduce</h2>
<p class="num">The most name-attending head is <b>{nr["head"]}</b>, with mean name mass <b>{_f(nr["name_mass"])}</b>
over {nr["stories"]} of the {nr["of"]} stories, against an even-spread baseline of {_f(nr["baseline"])}
({nr["ratio"]:.1f} times).{vs(" The lesson's model: L5H3, 0.221 over 159 of 200, baseline 0.052 (4.3 times).")}</p>

<h2>Every head</h2>
{
        _table(
            [
                "head",
                "name mass",
                "ratio",
                "prev token",
                "prev = top key",
                "last four",
                "marker" if lesson else "opening token",
            ],
            all_rows,
        )
    }
{beyond_html}
<p style="color:#888">Made by storylens. TinyStories (Eldan &amp; Li 2023), CDLA-Sharing-1.0.</p>
</body></html>
"""


LESSON_TABLE = "lesson-table"  # README markers: <!-- lesson-table:start --> ... <!-- lesson-table:end -->


def lesson_table(s: dict) -> str:
    """The README's "ours against the lesson" table, from a report's summary.json (never typed in)."""
    q, lk, nh, pt, mk = s["quiz"], s["leakage"], s["name_heads"], s["previous_token"], s["marker"]
    top, rest = nh["top"][0], nh["top"][1:]
    n_heads = s["model"]["blocks"] * s["model"]["heads"]
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    leak = (
        f"{lk['n_duplicates']} / {lk['n_mentioning']} / {pct(lk['run_share_mean'])}, {pct(lk['run_share_max'])}"
        if lk["computed"]
        else "not computed"
    )
    rows = [
        ("quiz stories cut to the 256-token window", "5 of 200", f"{q['cut_to_window']} of {q['stories']}"),
        ('leakage: identical / mention "Momo" / 8-word runs mean, max', "0 / 0 / 8.7%, 30%", leak),
        ("stories with a main character", "159", f"{q['with_main_character']}"),
        ("even-spread baseline", "0.052", f"{nh['baseline']:.3f}"),
        (
            "top name head (name mass, ratio)",
            "L5H3 0.221 (4.3x)",
            f"**{top['head']} {top['name_mass']:.3f} ({top['ratio']:.1f}x)**",
        ),
        ("next five", "L4H4, L6H2, ...", ", ".join(f"{h['head']} {h['name_mass']:.3f}" for h in rest)),
        ("heads below the baseline", "17 of 24", f"{nh['below_baseline']} of {n_heads}"),
        ("previous-token heads above 0.5", "0", f"{pt['above_half']}"),
        ("highest previous-token head", "L1H1 0.146", f"{pt['highest']['head']} {pt['highest']['prev_token']:.3f}"),
        (
            f"first {pt['highest_first']['stories']} stories: best prev-token / last four",
            "L1H1 0.140 / 0.389",
            f"{pt['highest_first']['head']} {pt['highest_first']['prev_token']:.3f} / {pt['highest_first']['prev4']:.3f}",
        ),
        (
            f"best share of queries whose top key is the previous token (first {pt['best_argmax_first']['stories']})",
            "0.369",
            f"{pt['best_argmax_first']['head']} {pt['best_argmax_first']['share']:.3f}",
        ),
        ("highest end-of-story-marker head", "0.065", f"{mk['highest']['head']} {mk['highest']['marker']:.3f}"),
    ]
    lines = ["| measure | lesson | ours |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def _beyond_section(lm, stories, encoded, scores, measures, tmp, *, progress: bool = True):
    """(summary dict, HTML, {figure name: data URI}) for the report; PNGs written into ``tmp``."""
    import base64

    position, pronouns = (m.result() for m in measures)  # fed by the scoring pass: no second recording
    b = run_beyond(lm, stories, scores, position=position, pronouns=pronouns, encoded=encoded, progress=progress)
    s = beyond_summary(b, scores)
    figs = {}
    fig = head_heatmap_figure(
        {r["head"]: r["zero_name_increase"] for r in s["ablation"]["rows"]},
        title="Name-loss increase with each head zero-ablated (nats)",
        colorbar_label="loss increase on the name",
        fmt="{:+.3f}",
        highlight=s["ablation"]["top_name_loss_head"],
    )
    png = figure_png_bytes(fig)
    (tmp / "ablation_name_loss.png").write_bytes(png)
    figs["ablation_name_loss"] = "data:image/png;base64," + base64.b64encode(png).decode()
    a, p, pr, d = s["ablation"], s["position_control"], s["pronouns"], s["divergence"]
    f = lambda x: "n/a" if x is None else f"{x:+.4f}"  # noqa: E731
    abl_rows = [
        [
            r["head"],
            f"{r['name_mass']:.3f}",
            f(r["zero_name_increase"]),
            f(r["zero_other_increase"]),
            f(r["mean_name_increase"]),
            f(r["mean_other_increase"]),
        ]
        for r in a["rows"][:10]
    ]
    grp = [[g["heads"], g["mode"], f(g["name_increase"]), f(g["other_increase"])] for g in a["groups"]]
    pos_rows = [
        [r["head"], f"{r['name_mass']:.3f}", f"{r['control']:.3f}", f"{r['excess']:+.3f}"]
        for r in p["ranking_by_excess"]
    ]
    pron_rows = [[r["head"], f"{r['pronoun_mass']:.3f}", f"{r['other_mass']:.3f}"] for r in pr["ranking"]]
    verdict = ("is also" if a["same_head"] else "is not") + " the head whose removal hurts the name most"
    body = f"""
<h2>8. Past the lesson</h2>
<h3>Switching heads off</h3>
<p>Each head's output is replaced (through the hook point <code>blocks.{{l}}.attn.hook_z</code>, weights untouched) by zero, or by
its mean over the quiz; the change in next-token loss is measured where the next token is the first token of the
main character's name ({a["name_positions"]} positions in {a["stories"]} stories; baseline loss
{a["baseline_name_loss"]:.3f} nats) and on all other positions ({a["other_positions"]}; baseline
{a["baseline_other_loss"]:.3f}). The top name-mass head, {a["top_name_mass_head"]}, {verdict}
(that is {a["top_name_loss_head"]}; {a["top_name_mass_head"]} ranks {a["rank_of_top_name_mass_head_by_name_loss"]}
of {lm.n_layer * lm.n_head} by name-loss increase). Ten heads with the largest name-loss increase:</p>
{_table(["head", "name mass", "name loss + (zero)", "other loss + (zero)", "name loss + (mean)", "other loss + (mean)"], abl_rows)}
<p>The top name-mass heads switched off together:</p>
{_table(["heads", "mode", "name loss +", "other loss +"], grp)}
<figure><img src="{figs["ablation_name_loss"]}" alt="name-loss increase per head"><figcaption>Name-loss increase per head (zero ablation); the colours span this figure's own range, shown on its bar</figcaption></figure>
<p>This shows which heads the model <i>needs</i> for the name on this quiz, not what they compute; a head can
matter for the name while looking elsewhere, and zero or mean ablation pushes the model off its usual inputs.</p>
<h3>Same prompt, same seed, {html.escape(d["head"])} switched off</h3>
<p>First differing new token: {d["first_difference"] if d["first_difference"] is not None else "none (identical)"}.</p>
{_table(["", "text"], [["all heads", d["baseline"]], [f"{d['head']} off", d["ablated"]]])}
<h3>Controlling for position</h3>
<p>For every query, the attention on the name is set against the attention the same query puts on non-name tokens
at the same distances (the name's distances; {100 * p["unmatched_share"]:.1f}% of name weight had no matched control).
Heads ranked by excess over the control:</p>
{_table(["head", "name mass", "matched-distance control", "excess"], pos_rows)}
<p>Top name-mass heads still in the top six after the control: {html.escape(", ".join(p["top_name_heads_still_top6"]) or "none")}.</p>
<h3>Pronouns</h3>
<p>Attention from he, she, him, her, his and they to the main character's name tokens ({pr["queries"]} pronoun
queries in {pr["stories"]} stories), against the same head's name attention from other queries:</p>
{_table(["head", "from pronouns", "from other tokens"], pron_rows)}
<p>Heads in both the pronoun top six and the name-mass top six: {html.escape(", ".join(pr["overlap_with_name_mass_top6"]) or "none")}.</p>
"""
    return s, body, figs
