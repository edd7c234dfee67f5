"""The report's figures: the story shown, what the figures need from the model, and their drawing.

:func:`figure_data` runs the model (one recorded story); :func:`draw_figures` and
:func:`beside_model_work` are pure drawing and the leakage check, run in a child process beside the
model's work; the PNGs become data URIs and the SVGs deflated payloads for the page.
"""

from __future__ import annotations

import base64
import math
import time
import zlib
from dataclasses import replace
from pathlib import Path

from storylens.core.errors import StorylensError
from storylens.lesson.inputs import LessonData, leakage_for
from storylens.lm import AttentionLM
from storylens.recording import figure_tokens, story_attention
from storylens.table.scores import HeadScores
from storylens.viz import (
    all_heads_figure,
    causal_mask_figure,
    name_attention_profile,
    name_head_figure,
    name_mass_bar_figure,
)
from storylens.viz.figures import figure_png_bytes, figure_svg_bytes

GRID_TOKENS = 24  # the 24-head grid shows the first 24 tokens, every one labelled ...
GRID_LABEL_PT = 8.5  # ... in 8.5-point type at 100 dpi (about 12 pixels), shown unscaled in the page
LESSON_GRID_HEADS = 24  # up to this many heads, "all heads on one story" is the lesson's one picture;
# past it the page shows the story's maps a block at a time, in the widget (drawn from its data)
BARS_SHOWN = 40  # the name-mass bars show every head up to this many, else the strongest 40
GRID_DPI = 100  # the lesson quotes two previous-token figures on the first 100 quiz stories


def pick_story(quiz: list[str], scores_mains, shown: int | None = None) -> int:
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


def figure_data(lm: AttentionLM, quiz: list[str], encoded, scores: HeadScores) -> dict:
    """Everything the figures need, computed with the model (the drawing itself never runs it)."""

    mains = [e.main for e in encoded]
    index = pick_story(quiz, mains, min(lm.window, figure_tokens(lm.n_layer, lm.n_head)))
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


def draw_figures(data: dict, scores: HeadScores, folder: Path) -> list[str]:
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
    rows = [(h.label, h.value("name_mass")) for h in scores.heads]
    title = f"Name mass per head over {scores.n_name_scored} quiz stories"
    if len(rows) > BARS_SHOWN:  # past that a bar per head is unreadable: the strongest, in order
        rows = sorted(rows, key=lambda r: -r[1])[:BARS_SHOWN]
        title = (
            f"Name mass: the {BARS_SHOWN} highest of {data['n_heads']} heads, over {scores.n_name_scored} quiz stories"
        )
    keep("name_mass", name_mass_bar_figure(rows, scores.heads[0].value("name_baseline"), title=title))
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


def beside_model_work(fig_data: dict, scores: HeadScores, folder: Path, data: LessonData | None, word: str):
    """What needs no model: the figures, then the leakage check (recomputed when the training
    stories are here; else the check stored with the model, for its own quiz; ``data=None``: a
    quiz of one's own without the corpus cannot be checked). Returns
    ``(figure names, leakage, seconds drawing, seconds checking leakage)``."""

    t = time.perf_counter()
    names = draw_figures(fig_data, scores, folder)
    t_fig = time.perf_counter() - t
    t = time.perf_counter()
    leakage = leakage_for(data, word) if data is not None else None
    return names, leakage, round(t_fig, 3), round(time.perf_counter() - t, 3)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def data_uris(folder: Path, names: list[str]) -> dict[str, str]:
    """The PNGs as data URIs for report.html: the same bytes as the files."""
    return {n: data_uri((folder / f"{n}.png").read_bytes()) for n in names}


def svg_payloads(folder: Path, names: list[str]) -> dict[str, str]:
    """Each figure's SVG, zlib-deflated and base64-encoded, for the page's SVG buttons."""
    return {n: base64.b64encode(zlib.compress((folder / f"{n}.svg").read_bytes(), 9)).decode("ascii") for n in names}
