"""The whole lesson in one call: ``storylens report``.

:func:`build_report` loads the model and the stories, runs the leakage check, scores
all 24 heads over the quiz (streaming), draws the figures and the widget, and writes
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
from dataclasses import dataclass, field
from pathlib import Path

from .errors import StorylensError
from .publish import publish_folder

CHECK_STORIES = 16  # the report's numerical checks run on the first 16 quiz stories ...
CHECK_TOKENS = 100  # ... and 100 generated tokens (storylens check runs all 200 stories and 200 tokens)
PREV_LIMIT = 100  # the lesson quotes two previous-token figures on the first 100 quiz stories
SCORE_TITLES = {
    "name_mass": "Name mass (share of attention on the main character's name)",
    "name_ratio": "Name mass / even-spread baseline",
    "prev_token": "Attention on the previous token",
    "prev_argmax": "Share of queries whose top key is the previous token",
    "prev4": "Attention on the last four tokens",
    "marker": "Attention on the end-of-story marker",
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


def _check_writable(out: Path) -> Path:
    """Refuse a bad ``--out`` before any work (publish_folder checks again under its lock)."""
    from .publish import check_target_folder

    out = Path(out)
    check_target_folder(out)
    return out


def _read_quiz(quiz_path, split) -> tuple[list[str], str]:
    from .data import read_stories

    if quiz_path is None:
        return split.quiz, "the corpus's last 200 stories"
    stories = read_stories(quiz_path)
    if not stories:
        raise StorylensError(f"{quiz_path}: no stories")
    return stories, str(Path(quiz_path).name)


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
    word: str = "Momo",
    prev_limit: int = PREV_LIMIT,
    batch_size: int = 16,
    beyond: bool = False,
    progress: bool = True,
    check_stories: int = CHECK_STORIES,
    check_tokens: int = CHECK_TOKENS,
) -> Report:
    """Run the lesson on ``model`` (default: the shipped one) and write the report into ``out``."""
    from .analysis import check_leakage, score_heads
    from .data import load_split
    from .hub import load_model
    from .viz import AttentionWidget, toy_widget

    timings: dict = {}
    t_start = time.perf_counter()
    out = _check_writable(Path(out))
    # one lock and one temporary folder for the whole run: a second run into the same --out is
    # refused at once, and a kill at any moment leaves the old report (see storylens.publish)
    with publish_folder(out, "report") as tmp:
        with _timer(timings, "load"):
            model = model if model is not None else load_model(model_source)
            split = load_split(stories)
            quiz_stories, quiz_source = _read_quiz(quiz, split)
        with _timer(timings, "leakage"):
            leakage = check_leakage(quiz_stories, split.train, word=word)
        with _timer(timings, "scoring"):
            scores = score_heads(model, quiz_stories, batch_size=batch_size,
                                 max_stories_prev=min(prev_limit, len(quiz_stories)), progress=progress)
        if scores.n_name_scored == 0:
            raise StorylensError(
                f"{quiz if quiz is not None else 'quiz'}: no story has a main character "
                "(a capitalised name mentioned at least twice): nothing to score name heads on"
            )
        with _timer(timings, "check"):
            checks = _numerics(model, quiz_stories, check_stories, check_tokens)

        with _timer(timings, "figures"):
            figs, story_info = _figures(model, quiz_stories, scores, tmp)
        with _timer(timings, "widget"):
            widget = AttentionWidget.from_model(model, quiz_stories[story_info["index"]],
                                                block=story_info["block"], head=story_info["head"])
            (tmp / "widget.html").write_text(widget.to_html(), encoding="utf-8")
            toy = toy_widget()
        beyond_html = ""
        beyond_summary = None
        if beyond:
            with _timer(timings, "beyond"):
                from .analysis.beyond import beyond_section

                beyond_summary, beyond_html, beyond_figs = beyond_section(
                    model, quiz_stories, scores, tmp, progress=progress)
                figs.update(beyond_figs)
        summary = _summary(model, scores, leakage, quiz_source, split, word, story_info)
        summary["numerics"] = [c.to_dict() for c in checks]
        if beyond_summary is not None:
            summary["beyond"] = beyond_summary
        scores.to_csv(tmp / "heads.csv")
        scores.to_json(tmp / "heads.json")
        timings["total_before_html"] = round(time.perf_counter() - t_start, 3)
        summary["timings_s"] = timings
        (tmp / "report.html").write_text(
            _html(summary, scores, figs, widget._repr_html_(), toy._repr_html_(), beyond_html), encoding="utf-8")
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    timings["total"] = round(time.perf_counter() - t_start, 3)
    return Report(out=out, summary=summary, scores=scores, leakage=leakage, timings=timings)


def _numerics(model, quiz, n_stories: int, n_tokens: int):
    from .numerics import run_checks
    from .tokenizer import encode_story

    ids = [encode_story(model.tokenizer, s, model.config.block_size).ids for s in quiz[:n_stories]]
    return run_checks(model, ids, gen_tokens=n_tokens)


def _numerics_html(checks: list[dict]) -> str:
    rows = [[c["name"], c["dtype"], f"{c['measured']:.2e}", f"{c['bound']:.2e}",
             "" if c["lesson"] is None else f"{c['lesson']:.0e}", "yes" if c["passed"] else "NO", c["detail"]]
            for c in checks]
    return _table(["check", "dtype", "measured here", "rounding bound", "lesson", "within", "detail"], rows)


def _figures(model, quiz, scores, tmp) -> tuple[dict[str, str], dict]:
    """Draw every figure once; write it as PNG and keep its data URI for report.html."""
    import base64

    from .analysis import find_main_characters
    from .viz import (all_heads_figure, causal_mask_figure, head_heatmap_figure, name_attention_profile,
                      name_head_figure, name_mass_bar_figure, story_attention)
    from .viz.figures import figure_png_bytes

    figs: dict[str, str] = {}

    def keep(name, fig, dpi=110):  # render once: the PNG file and the report's embedded copy are the same bytes
        png = figure_png_bytes(fig, dpi=dpi)
        (tmp / f"{name}.png").write_bytes(png)
        figs[name] = "data:image/png;base64," + base64.b64encode(png).decode("ascii")

    mains = find_main_characters(model.tokenizer, quiz, window=model.config.block_size)
    index = _pick_story(quiz, mains)
    tokens, att, enc = story_attention(model, quiz[index])
    keep("causal_mask", causal_mask_figure(tokens[:8], title="The causal mask: later words are -inf before the softmax"))
    keep("all_heads", all_heads_figure(att, tokens, max_tokens=32,
                                       title=f"All 24 heads on quiz story {index + 1} (first 32 tokens)"),
         dpi=72)  # a 16 x 23 inch grid: 72 dpi keeps it sharp on screen and halves the render time
    rows = [(h.label, h.name_mass) for h in scores.heads]
    keep("name_mass", name_mass_bar_figure(rows, scores.name_baseline,
                                           title=f"Name mass per head over {scores.n_name_scored} quiz stories"))
    for col in ("name_mass", "name_ratio", "prev_token", "prev_argmax", "prev4", "marker"):
        best = scores.best(col).label
        keep(f"heatmap_{col}", head_heatmap_figure(scores.grid(col), title=SCORE_TITLES[col], highlight=best))
    top = scores.best("name_mass")
    b, h = top.block - 1, top.head - 1
    main = mains[index]
    weights, _ = name_attention_profile(att[b, h], list(main.positions), main.first_mention)
    keep("top_name_head", name_head_figure(tokens, weights, list(main.positions), label=top.label,
                                           first_mention=main.first_mention, baseline=scores.name_baseline,
                                           max_tokens=160))
    info = {"index": index, "name": main.name, "block": b, "head": h, "tokens": len(tokens)}
    return figs, info


def _f(x, nd=3):
    return "n/a" if x is None else f"{x:.{nd}f}"


def _summary(model, scores, leakage, quiz_source, split, word, story_info) -> dict:
    top6 = scores.top("name_mass", 6)
    prev = scores.best("prev_token")
    prev_first = scores.best("prev_token_first")
    argmax_first = scores.best("prev_argmax_first")
    argmax_all = scores.best("prev_argmax")
    marker = scores.best("marker")
    return {
        "model": {"parameters": model.num_parameters(), "blocks": model.config.n_layer,
                  "heads": model.config.n_head, "window": model.config.block_size},
        "quiz": {"source": quiz_source, "stories": scores.n_stories, "cut_to_window": scores.n_cut,
                 "with_main_character": scores.n_main_character, "name_scored": scores.n_name_scored,
                 "skipped": scores.n_skipped_no_name, "train_stories": len(split.train)},
        "leakage": leakage.summary(),
        "name_heads": {
            "baseline": scores.name_baseline,
            "top": [{"head": h.label, "name_mass": h.name_mass, "ratio": h.name_ratio} for h in top6],
            "below_baseline": scores.count("name_mass", below=scores.name_baseline),
        },
        "previous_token": {
            "above_half": scores.count("prev_token", above=0.5),
            "highest": {"head": prev.label, "prev_token": prev.prev_token},
            "highest_first": {"head": prev_first.label, "prev_token": prev_first.prev_token_first,
                              "prev4": prev_first.prev4_first, "stories": scores.n_prev_first},
            "best_argmax_first": {"head": argmax_first.label, "share": argmax_first.prev_argmax_first,
                                  "stories": scores.n_prev_first},
            "best_argmax_all": {"head": argmax_all.label, "share": argmax_all.prev_argmax},
        },
        "marker": {"highest": {"head": marker.label, "marker": marker.marker},
                   "above_half": scores.count("marker", above=0.5)},
        "story_shown": {"quiz_index": story_info["index"] + 1, "main_character": story_info["name"]},
        "number_to_reproduce": {"head": top6[0].label, "name_mass": top6[0].name_mass,
                                "baseline": scores.name_baseline, "ratio": top6[0].name_ratio,
                                "stories": scores.n_name_scored, "of": scores.n_stories},
    }


def _table(header, rows) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _img(figs, name, alt) -> str:
    return f'<figure><img src="{figs[name]}" alt="{html.escape(alt)}"><figcaption>{html.escape(alt)}</figcaption></figure>'


def _html(s, scores, figs, widget_html, toy_html, beyond_html) -> str:
    q, lk, nh, pt, mk, nr = s["quiz"], s["leakage"], s["name_heads"], s["previous_token"], s["marker"], s["number_to_reproduce"]
    top = nh["top"][0]
    e = html.escape
    leak_rows = [
        ["identical to a training story", lk["n_duplicates"]],
        [f"mentioning “{lk['word']}”", lk["n_mentioning"]],
        [f"mean share of {lk['run_words']}-word runs found in training", _f(lk["run_share_mean"])],
        [f"maximum share of {lk['run_words']}-word runs", _f(lk["run_share_max"])],
    ]
    name_rows = [[h["head"], _f(h["name_mass"]), _f(nh["baseline"]), f"{h['ratio']:.1f}x"] for h in nh["top"]]
    all_rows = [[h.label, _f(h.name_mass), f"{h.name_ratio:.2f}", _f(h.prev_token), _f(h.prev_argmax), _f(h.prev4),
                 _f(h.marker)] for h in scores.heads]
    css = """body{font:15px/1.55 system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.7em}h2{margin-top:2em;border-bottom:1px solid #ddd}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 9px;text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{color:#666;font-size:.9em}
.num{font-size:1.25em;background:#f7f7ff;border-left:4px solid #66c;padding:.6em 1em}"""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>storylens: Tiny Storyteller's attention</title>
<style>{css}</style></head><body>
<h1>Reading Tiny Storyteller's attention</h1>
<p>Every number on this page was computed by storylens on the shipped model
({s['model']['parameters']:,} parameters, {s['model']['blocks']} blocks x {s['model']['heads']} heads,
{s['model']['window']}-token window) over {q['stories']} quiz stories ({e(q['source'])}).
{q['cut_to_window']} of them were cut to the {s['model']['window']}-token window (the lesson had 5 of 200).
Heads are labelled as the lesson does: <b>L5H3</b> is block 5, head 3, counting from 1.</p>

<h2>1. Leakage check</h2>
<p>Quiz stories against the {q['train_stories']:,} training stories
(the lesson: none identical, none mentioning Momo, 8-word runs 8.7% on average, 30% at most).</p>
{_table(["check", "ours"], leak_rows)}

<h2>2. The triangle</h2>
<p>Before the softmax every score for a later word is set to minus infinity, so its share is exactly zero:
the upper right of every map is the mask, not a choice the head made.</p>
{_img(figs, "causal_mask", "The causal mask")}

<h2>3. All 24 heads on one story</h2>
{_img(figs, "all_heads", "All 24 heads, one quiz story")}
<h3>Click a token</h3>
<p>The same story in the widget: click a token to see where it looks; pick a block and head, or all 24.</p>
{widget_html}
<h3>Toy mode (hand-set numbers, not the model's)</h3>
{toy_html}

<h2>4. The name-tracking head</h2>
<p>A name is a capitalised word whose lowercase form appears nowhere in the {q['stories']} quiz stories; the
main character is a story's most frequent name with at least two mentions. {q['with_main_character']} of
{q['stories']} stories have one; {q['name_scored']} are scored, {q['skipped']} skipped
(the lesson: 159 of 200). Even-spread baseline: <b>{_f(nh['baseline'])}</b> (lesson: 0.052).</p>
{_table(["head", "name mass", "baseline", "ratio"], name_rows)}
<p>{nh['below_baseline']} of 24 heads put less on the name than an even spread would (lesson: 17).</p>
{_img(figs, "name_mass", "Name mass per head against the baseline")}
{_img(figs, "heatmap_name_mass", "Name mass, block x head")}
{_img(figs, "top_name_head", f"{top['head']} on one story: where it looks after the first mention")}

<h2>5. Previous-token and end-of-story heads</h2>
<p>Heads with more than half their attention on the word just before: <b>{pt['above_half']} of 24</b>
(lesson: 0). Highest: {pt['highest']['head']} at {_f(pt['highest']['prev_token'])} over all stories;
on the first {pt['highest_first']['stories']} stories {pt['highest_first']['head']} puts
{_f(pt['highest_first']['prev_token'])} on the previous word and {_f(pt['highest_first']['prev4'])} on the last four
(lesson: L1H1, 0.140 and 0.389). The previous word is the single most-attended one for
{_f(pt['best_argmax_first']['share'])} of queries at best ({pt['best_argmax_first']['head']}, first
{pt['best_argmax_first']['stories']} stories; {_f(pt['best_argmax_all']['share'])} over all, {pt['best_argmax_all']['head']};
lesson: 0.369).</p>
{_img(figs, "heatmap_prev_token", "Attention on the previous token")}
{_img(figs, "heatmap_prev_argmax", "Share of queries whose top key is the previous token")}
{_img(figs, "heatmap_prev4", "Attention on the last four tokens")}
<p>End-of-story marker: the highest head is {mk['highest']['head']} at {_f(mk['highest']['marker'])}
(lesson: 0.065); {mk['above_half']} heads lean mostly on it.</p>
{_img(figs, "heatmap_marker", "Attention on the end-of-story marker")}

<h2>6. Three honest limits</h2>
<ol><li>{top['head']} puts about {100 * top['name_mass']:.0f}% of its attention on the name, not all of it:
a tendency, not a switch.</li>
<li>Attention is where a head looks, not proof of what the model relies on; the lesson switched no head off
(section 8, when run with <code>--beyond</code>, does).</li>
<li>Name position is not controlled: a name early in a story may draw attention partly for being early.</li></ol>

<h2>7. The number to reproduce</h2>
<p class="num">The most name-attending head is <b>{nr['head']}</b>, with mean name mass <b>{_f(nr['name_mass'])}</b>
over {nr['stories']} of the {nr['of']} stories, against an even-spread baseline of {_f(nr['baseline'])}
({nr['ratio']:.1f} times). The lesson's model: L5H3, 0.221 over 159 of 200, baseline 0.052 (4.3 times).</p>

<h2>The lesson's numbers on this machine</h2>
<p>The lesson promises that the fused kernel and the explicit softmax agree, that rows sum to 1, that
the upper triangle is exactly zero, and that the KV cache changes the cost and not the answer. These
are this computer's own measurements (first {CHECK_STORIES} quiz stories, {CHECK_TOKENS} generated tokens;
<code>storylens check</code> runs the full set), each beside the bound that rounding alone allows
(float32 and float64; derived in <code>storylens.numerics</code>).</p>
{_numerics_html(s["numerics"])}

<h2>Every head</h2>
{_table(["head", "name mass", "ratio", "prev token", "prev = top key", "last four", "marker"], all_rows)}
{beyond_html}
<p style="color:#888">Made by storylens. TinyStories (Eldan &amp; Li 2023), CDLA-Sharing-1.0.</p>
</body></html>
"""


def print_summary(report: Report, file=None) -> None:
    import sys

    file = file or sys.stdout
    s = report.summary
    q, lk, nh, pt, mk = s["quiz"], s["leakage"], s["name_heads"], s["previous_token"], s["marker"]
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p(f"quiz: {q['stories']} stories ({q['cut_to_window']} cut to the window), "
      f"{q['with_main_character']} with a main character, {q['name_scored']} scored")
    p(f"leakage: {lk['n_duplicates']} identical, {lk['n_mentioning']} mention {lk['word']!r}, "
      f"{lk['run_words']}-word runs in training: mean {_f(lk['run_share_mean'])}, max {_f(lk['run_share_max'])}")
    p("")
    p(f"{'head':6} {'name mass':>10} {'baseline':>9} {'ratio':>6}")
    for h in nh["top"]:
        p(f"{h['head']:6} {h['name_mass']:10.3f} {nh['baseline']:9.3f} {h['ratio']:5.1f}x")
    p(f"{nh['below_baseline']} of 24 heads below the baseline")
    p("")
    p(f"previous-token heads above 0.5: {pt['above_half']}; highest {pt['highest']['head']} "
      f"{_f(pt['highest']['prev_token'])}; first {pt['highest_first']['stories']} stories: "
      f"{pt['highest_first']['head']} {_f(pt['highest_first']['prev_token'])} (last four "
      f"{_f(pt['highest_first']['prev4'])}), best top-key share {pt['best_argmax_first']['head']} "
      f"{_f(pt['best_argmax_first']['share'])}")
    p(f"end-of-story marker: highest {mk['highest']['head']} {_f(mk['highest']['marker'])}")
    nr = s["number_to_reproduce"]
    p("")
    p(f"top name head: {nr['head']}  name mass {nr['name_mass']:.3f} vs baseline {nr['baseline']:.3f} "
      f"({nr['ratio']:.1f}x) over {nr['stories']} of {nr['of']} stories")
    p(f"report written to {report.out / 'report.html'} in {report.timings['total']:.1f} s")


def add_report_parser(sub) -> None:
    r = sub.add_parser("report", help="run the whole lesson and write report.html, heads.csv/json and figures")
    r.add_argument("--model", default=None, help="model folder or hub id (default: the shipped model)")
    r.add_argument("--allow-download", action="store_true")
    r.add_argument("--stories", default=None, help="the corpus (split: last 200 stories = quiz)")
    r.add_argument("--quiz", default=None, help="score every story of this file instead of the corpus's quiz")
    r.add_argument("--out", default="report", help="output folder (default: report)")
    r.add_argument("--word", default="Momo", help="leakage check: count quiz stories mentioning this word")
    r.add_argument("--prev-limit", type=int, default=PREV_LIMIT,
                   help="previous-token figures also over the first N stories (lesson: 100)")
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--beyond", action="store_true",
                   help="also switch heads off, control for position, and measure pronouns (slower)")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=_cmd_report)


def _cmd_report(args) -> int:
    from .hub import load_model

    if args.batch_size < 1:
        raise StorylensError(f"--batch-size: must be at least 1 (got {args.batch_size})")
    if args.prev_limit < 0:
        raise StorylensError(f"--prev-limit: must be 0 or more (got {args.prev_limit})")
    _check_writable(Path(args.out))
    model = load_model(args.model, allow_download=args.allow_download)
    report = build_report(args.out, model=model, stories=args.stories, quiz=args.quiz, word=args.word,
                          prev_limit=args.prev_limit, batch_size=args.batch_size, beyond=args.beyond,
                          progress=not args.no_progress)
    print_summary(report)
    return 0
