"""The report's numbers: its typed summary built from the scores, and the tables the page, the
printout and the README show from it (cells as text)."""

from __future__ import annotations

from storylens.data.leakage import LeakageReport
from storylens.effects.audit import Audit, Effect
from storylens.effects.cost import effect_text
from storylens.lesson.beyond import BeyondSummary
from storylens.lesson.checks import lesson_note
from storylens.lesson.figures import LESSON_FIGURES, MARKER_HEAD_LEVEL, PREV_HEAD_LEVEL, TOP_HEADS
from storylens.lesson.inputs import LessonData
from storylens.lesson.summary import (
    ArgmaxAll,
    ArgmaxFirst,
    HeadMass,
    Leakage,
    Marker,
    MarkerHighest,
    NameHeads,
    NumberToReproduce,
    PrevFirst,
    PrevHighest,
    PreviousToken,
    QuizInfo,
    ReportSummary,
    StoryShown,
)
from storylens.lm import AttentionLM, NativeLM
from storylens.table.run_info import model_info
from storylens.table.scores import HeadScores
from storylens.table.truth import Truth


def num(x, spec: str = ".3f") -> str:
    """A number as ``format(x, spec)``, or "n/a" for none (the report's Jinja filter ``num``)."""
    return "n/a" if x is None else format(x, spec)


def f3(x, nd=3) -> str:
    return num(x, f".{nd}f")


def _leakage_summary(leakage: LeakageReport | None, data: LessonData) -> Leakage:
    if leakage is None:
        if data.shipped_with_storylens:
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
    return Leakage(computed=True, source=src, recomputed=data.train is not None, stats=leakage.summary())


def _quiz_info(scores: HeadScores, leakage: LeakageReport | None, quiz_source: str, data: LessonData) -> QuizInfo:
    return QuizInfo(
        source=quiz_source,
        stories=scores.n_stories,
        cut_to_window=scores.n_cut,
        with_main_character=scores.n_main_character,
        name_scored=scores.n_name_scored,
        skipped=scores.n_skipped_no_name,
        shipped_with_storylens=bool(data.shipped_with_storylens),
        train_stories=leakage.n_train if leakage is not None else None,
    )


def _previous_token(scores: HeadScores) -> PreviousToken:
    prev, prev_first = scores.best("prev_token"), scores.best("prev_token_first")
    argmax_first, argmax_all = scores.best("prev_argmax_first"), scores.best("prev_argmax")
    return PreviousToken(
        above_half=scores.count("prev_token", above=PREV_HEAD_LEVEL),
        highest=PrevHighest(prev.label, prev.value("prev_token")),
        highest_first=PrevFirst(
            prev_first.label, prev_first.prev_token_first, prev_first.prev4_first, scores.n_prev_first
        ),
        best_argmax_first=ArgmaxFirst(argmax_first.label, argmax_first.prev_argmax_first, scores.n_prev_first),
        best_argmax_all=ArgmaxAll(argmax_all.label, argmax_all.value("prev_argmax")),
    )


def report_summary(
    lm: AttentionLM, scores: HeadScores, leakage: LeakageReport | None, data: LessonData, story_info: dict
) -> ReportSummary:
    """The report's figures (without the numerical checks, ``--beyond`` and the timings: the caller adds them)."""

    top = scores.top("name_mass", TOP_HEADS)
    baseline = top[0].value("name_baseline")  # computed wherever name_mass is (top() refuses a column with gaps)
    marker = scores.best("marker")
    return ReportSummary(
        model=model_info(lm),
        quiz=_quiz_info(scores, leakage, data.quiz_source, data),
        leakage=_leakage_summary(leakage, data),
        name_heads=NameHeads(
            baseline=baseline,
            top=[HeadMass(h.label, h.value("name_mass"), h.value("name_ratio")) for h in top],
            below_baseline=scores.count("name_mass", below=baseline),
        ),
        previous_token=_previous_token(scores),
        marker=Marker(
            highest=MarkerHighest(marker.label, marker.value("marker")),
            above_half=scores.count("marker", above=MARKER_HEAD_LEVEL),
            called=marker_words(lm),
        ),
        story_shown=StoryShown(story_info["index"] + 1, story_info["name"], story_info["tokens"]),
        number_to_reproduce=NumberToReproduce(
            head=top[0].label,
            name_mass=top[0].value("name_mass"),
            baseline=baseline,
            ratio=top[0].value("name_ratio"),
            stories=scores.n_name_scored,
            of=scores.n_stories,
        ),
    )


def marker_words(lm: AttentionLM) -> str:
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


def numerics_rows(s: ReportSummary) -> list[list[str]]:
    return [
        [
            c.name,
            c.dtype,
            f"{c.measured:.2e}",
            f"{c.bound:.2e}",
            "" if c.lesson is None else f"{c.lesson:.0e}",
            "yes" if c.passed else "NO",
            lesson_note(c),
            c.detail,
        ]
        for c in s.numerics or []
    ]


def leak_rows(s: ReportSummary) -> list[list]:
    if s.leakage is None:  # the lesson's section not run
        return []
    lk = s.leakage.stats
    if lk is None:
        return [["leakage check", s.leakage.source]]
    return [
        ["identical to a training story", lk.n_duplicates],
        [f"mentioning “{lk.word}”", lk.n_mentioning],
        [f"mean share of {lk.run_words}-word runs found in training", f3(lk.run_share_mean)],
        [f"maximum share of {lk.run_words}-word runs", f3(lk.run_share_max)],
    ]


def head_rows(scores: HeadScores) -> list[list[str]]:
    return [
        [
            h.label,
            f3(h.name_mass),
            f"{h.name_ratio:.2f}",
            f3(h.prev_token),
            f3(h.prev_argmax),
            f3(h.prev4),
            f3(h.marker),
            f3(h.norm_marker),
            "" if h.output_share is None else f"{h.output_share:.1%}",
            f3(h["first_mass"]) if "first_mass" in h.scores else "",
            "" if h["context_share"] is None else f"{h['context_share']:.1%}",
            "dormant" if h.dormant else "",
        ]
        for h in scores.heads
    ]


def beyond_rows(b: BeyondSummary | None) -> dict | None:
    """Section 8's tables, their cells as text."""
    if b is None:
        return None

    def f(x) -> str:
        return num(x, "+.4f")

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


def _signed(x: float | None) -> str:
    return "" if x is None else f"{x:+.4f}"


def agreement_rows(t: Truth | None) -> list[list[str]]:
    """Per detector: Spearman's rho between the raw and norm-weighted columns over every head, and the
    heads whose rank moves most (raw rank -> norm-weighted rank, 1 = strongest); with ``--causal``,
    also rho between the raw column and AtP (mean ablation) over every head."""
    if t is None:
        return []
    rho = dict(t.causal.rho) if t.causal is not None else {}
    return [
        [
            a.detector,
            "" if a.rho is None else f"{a.rho:.3f}",
            ", ".join(f"{h} {r_raw:g} \u2192 {r_norm:g}" for h, r_raw, r_norm in a.moves),
            *([num(rho.get(a.detector))] if t.causal is not None else []),
        ]
        for a in t.agreements
    ]


def truth_rows(t: Truth | None) -> list[list[str]]:
    """The faithfulness table's cells: detector, head, raw, norm-weighted, output share, loss change
    switched off (zero, mean) and where, and the flag; with ``--causal``, AtP (mean ablation, every
    quiz story) and the exact effect where audited, each with its error and a sign only beyond two
    errors, in place of the ablations' loss changes (which have none)."""
    if t is None:
        return []
    if t.causal is not None:
        return [
            [r.detector, r.head, f3(r.raw), f3(r.norm), "" if r.share is None else f"{r.share:.1%}",
             effect_text(e.atp, e.atp_se), effect_text(e.exact, e.exact_se), "dormant" if r.dormant else ""]
            for r, e in zip(t.rows, t.causal.rows)
        ]  # fmt: skip
    return [
        [
            r.detector,
            r.head,
            f3(r.raw),
            f3(r.norm),
            "" if r.share is None else f"{r.share:.1%}",
            _signed(r.zero_increase),
            _signed(r.mean_increase),
            r.where,
            "dormant" if r.dormant else "",
        ]
        for r in t.rows
    ]


LESSON_TABLE = "lesson-table"  # README markers: <!-- lesson-table:start --> ... <!-- lesson-table:end -->


def _pct(x: float | None, nd: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{nd}f}%"


def lesson_table(s: ReportSummary) -> str:
    """The README's "ours against the lesson" table, from a report's summary (never typed in)."""
    L = LESSON_FIGURES
    if s.leakage is None or s.name_heads is None or s.previous_token is None:
        raise ValueError("lesson_table: the report ran without its lesson section (--sections lesson)")
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


def audit_rows(a: Audit | None) -> list[list[str]]:
    """The audit's table: each audited head, why it was chosen, AtP beside the exact effect (mean and
    zero ablation), each with its error in nats; in brackets where it is within two standard errors of zero
    (no sign claimed), and no error where it rests on one story."""
    if a is None:
        return []

    def cell(e: Effect | None) -> str:
        if e is None:
            return ""
        if not e.se == e.se:
            return f"{e.nats:+.4f} (one story: no error)"
        text = f"{e.nats:+.4f} ± {e.se:.4f}"
        return f"({text})" if abs(e.nats) <= 2 * e.se else text

    if a.rows and a.rows[0].why == "every":  # every head measured (mean ablation), in the scoring pass
        return [[r.head, cell(r.exact_mean), cell(r.atp_mean), cell(r.atp_zero)] for r in a.rows]
    return [[r.head, r.why, cell(r.atp_mean), cell(r.exact_mean), cell(r.atp_zero), cell(r.exact_zero)] for r in a.rows]
