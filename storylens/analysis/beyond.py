"""Past the lesson: switch heads off, control for position, follow pronouns.

:func:`run_beyond` computes the three experiments the lesson names but did not run;
:func:`beyond_section` turns them into the report's section 8 (HTML, figures, summary);
:func:`add_ablate_parser` is the ``storylens ablate`` command.
"""

from __future__ import annotations

import html
import sys
from dataclasses import dataclass

from ..errors import StorylensError
from ..model import head_label

DIVERGENCE_PROMPT = "Once upon a time, there was a little girl named Lily. Lily"


@dataclass
class Beyond:
    ablation: object  # AblationTable
    position: object  # PositionControl
    pronouns: object  # PronounAttention
    divergence: object  # Divergence
    top_heads: list[str]


def run_beyond(model, stories, scores, *, k: int = 3, seed: int = 0, batch_size: int = 16, progress: bool = True) -> Beyond:
    from .ablation import generation_divergence, name_ablation_table
    from .position import position_control_scores
    from .pronouns import pronoun_attention

    top = [h.label for h in scores.top("name_mass", k)]
    ablation = name_ablation_table(model, stories, name_heads=top, batch_size=batch_size, progress=progress)
    position = position_control_scores(model, stories, batch_size=batch_size)
    pronouns = pronoun_attention(model, stories, batch_size=batch_size)
    divergence = generation_divergence(model, DIVERGENCE_PROMPT, [top[0]], seed=seed, max_new_tokens=80,
                                       temperature=0.8, top_k=40)
    return Beyond(ablation, position, pronouns, divergence, top)


def _rank(values: dict[str, float]) -> list[str]:
    return sorted(values, key=lambda k: -values[k])


def beyond_summary(b: Beyond, scores) -> dict:
    name_mass = {h.label: h.name_mass for h in scores.heads}
    abl = {r.label: r for r in b.ablation.rows if r.mode == "zero" and len(r.heads) == 1}
    abl_mean = {r.label: r for r in b.ablation.rows if r.mode == "mean" and len(r.heads) == 1}
    name_loss_rank = _rank({k: r.name_increase for k, r in abl.items()})
    pos_rows = {r["label"]: r for r in b.position.to_rows()}
    excess_rank = _rank({k: r["excess"] for k, r in pos_rows.items()})
    pron_rows = {r["label"]: r for r in b.pronouns.to_rows()}
    pron_rank = _rank({k: r["pronoun_mass"] for k, r in pron_rows.items()})
    group = [r for r in b.ablation.rows if len(r.heads) > 1]
    top_mass = _rank(name_mass)[0]
    return {
        "ablation": {
            "stories": b.ablation.n_stories,
            "name_positions": b.ablation.n_name_positions,
            "other_positions": b.ablation.n_other_positions,
            "baseline_name_loss": b.ablation.baseline_name_loss,
            "baseline_other_loss": b.ablation.baseline_other_loss,
            "rows": [{"head": k, "name_mass": name_mass[k], "zero_name_increase": abl[k].name_increase,
                      "zero_other_increase": abl[k].other_increase,
                      "mean_name_increase": abl_mean[k].name_increase if k in abl_mean else None,
                      "mean_other_increase": abl_mean[k].other_increase if k in abl_mean else None}
                     for k in name_loss_rank],
            "groups": [{"heads": r.label, "mode": r.mode, "name_increase": r.name_increase,
                        "other_increase": r.other_increase} for r in group],
            "top_name_mass_head": top_mass,
            "top_name_loss_head": name_loss_rank[0],
            "same_head": top_mass == name_loss_rank[0],
            "rank_of_top_name_mass_head_by_name_loss": name_loss_rank.index(top_mass) + 1,
        },
        "position_control": {
            "unmatched_share": b.position.unmatched_share,
            "ranking_by_excess": [{"head": k, "name_mass": pos_rows[k]["name_mass"], "control": pos_rows[k]["control"],
                                   "excess": pos_rows[k]["excess"]} for k in excess_rank[:6]],
            "top_name_heads_still_top6": [h for h in b.top_heads if h in excess_rank[:6]],
        },
        "pronouns": {
            "stories": b.pronouns.n_stories,
            "queries": b.pronouns.n_pronoun_queries,
            "ranking": [{"head": k, "pronoun_mass": pron_rows[k]["pronoun_mass"],
                         "other_mass": pron_rows[k]["other_mass"]} for k in pron_rank[:6]],
            "overlap_with_name_mass_top6": sorted(set(pron_rank[:6]) & set(_rank(name_mass)[:6])),
        },
        "divergence": {"prompt": b.divergence.prompt, "head": b.top_heads[0],
                       "first_difference": b.divergence.first_difference,
                       "baseline": b.divergence.baseline_text, "ablated": b.divergence.ablated_text},
    }


def _table(header, rows) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def beyond_section(model, stories, scores, tmp, *, progress: bool = True):
    """(summary dict, HTML, {figure name: data URI}) for the report; PNGs written into ``tmp``."""
    import base64

    from ..viz.figures import figure_png_bytes, head_heatmap_figure

    b = run_beyond(model, stories, scores, progress=progress)
    s = beyond_summary(b, scores)
    figs = {}
    fig = head_heatmap_figure({r["head"]: r["zero_name_increase"] for r in s["ablation"]["rows"]},
                              title="Name-loss increase with each head zero-ablated (nats)",
                              colorbar_label="loss increase on the name", fmt="{:+.3f}",
                              highlight=s["ablation"]["top_name_loss_head"])
    png = figure_png_bytes(fig)
    (tmp / "ablation_name_loss.png").write_bytes(png)
    figs["ablation_name_loss"] = "data:image/png;base64," + base64.b64encode(png).decode()
    a, p, pr, d = s["ablation"], s["position_control"], s["pronouns"], s["divergence"]
    f = lambda x: "n/a" if x is None else f"{x:+.4f}"  # noqa: E731
    abl_rows = [[r["head"], f"{r['name_mass']:.3f}", f(r["zero_name_increase"]), f(r["zero_other_increase"]),
                 f(r["mean_name_increase"]), f(r["mean_other_increase"])] for r in a["rows"][:10]]
    grp = [[g["heads"], g["mode"], f(g["name_increase"]), f(g["other_increase"])] for g in a["groups"]]
    pos_rows = [[r["head"], f"{r['name_mass']:.3f}", f"{r['control']:.3f}", f"{r['excess']:+.3f}"] for r in p["ranking_by_excess"]]
    pron_rows = [[r["head"], f"{r['pronoun_mass']:.3f}", f"{r['other_mass']:.3f}"] for r in pr["ranking"]]
    verdict = ("is also" if a["same_head"] else "is not") + " the head whose removal hurts the name most"
    body = f"""
<h2>8. Past the lesson</h2>
<h3>Switching heads off</h3>
<p>Each head's output is replaced (through the model's <code>head_hook</code>, weights untouched) by zero, or by
its mean over the quiz; the change in next-token loss is measured where the next token is the first token of the
main character's name ({a['name_positions']} positions in {a['stories']} stories; baseline loss
{a['baseline_name_loss']:.3f} nats) and on all other positions ({a['other_positions']}; baseline
{a['baseline_other_loss']:.3f}). The top name-mass head, {a['top_name_mass_head']}, {verdict}
(that is {a['top_name_loss_head']}; {a['top_name_mass_head']} ranks {a['rank_of_top_name_mass_head_by_name_loss']}
of 24 by name-loss increase). Ten heads with the largest name-loss increase:</p>
{_table(["head", "name mass", "name loss + (zero)", "other loss + (zero)", "name loss + (mean)", "other loss + (mean)"], abl_rows)}
<p>The top name-mass heads switched off together:</p>
{_table(["heads", "mode", "name loss +", "other loss +"], grp)}
<figure><img src="{figs['ablation_name_loss']}" alt="name-loss increase per head"><figcaption>Name-loss increase per head (zero ablation)</figcaption></figure>
<p>This shows which heads the model <i>needs</i> for the name on this quiz, not what they compute; a head can
matter for the name while looking elsewhere, and zero or mean ablation pushes the model off its usual inputs.</p>
<h3>Same prompt, same seed, {html.escape(d['head'])} switched off</h3>
<p>First differing new token: {d['first_difference'] if d['first_difference'] is not None else 'none (identical)'}.</p>
{_table(["", "text"], [["all heads", d["baseline"]], [f"{d['head']} off", d["ablated"]]])}
<h3>Controlling for position</h3>
<p>For every query, the attention on the name is set against the attention the same query puts on non-name tokens
at the same distances (the name's distances; {100 * p['unmatched_share']:.1f}% of name weight had no matched control).
Heads ranked by excess over the control:</p>
{_table(["head", "name mass", "matched-distance control", "excess"], pos_rows)}
<p>Top name-mass heads still in the top six after the control: {html.escape(', '.join(p['top_name_heads_still_top6']) or 'none')}.</p>
<h3>Pronouns</h3>
<p>Attention from he, she, him, her, his and they to the main character's name tokens ({pr['queries']} pronoun
queries in {pr['stories']} stories), against the same head's name attention from other queries:</p>
{_table(["head", "from pronouns", "from other tokens"], pron_rows)}
<p>Heads in both the pronoun top six and the name-mass top six: {html.escape(', '.join(pr['overlap_with_name_mass_top6']) or 'none')}.</p>
"""
    return s, body, figs


def add_ablate_parser(sub) -> None:
    a = sub.add_parser("ablate", help="switch heads off and measure the loss on the main character's name")
    a.add_argument("--heads", nargs="*", default=None, help="heads to switch off together, e.g. L4H2 L5H1 "
                   "(default: every head alone, plus the top three name heads together)")
    a.add_argument("--mode", choices=["zero", "mean"], default=None,
                   help="replace a head's output by zeros or by its mean output (default: both)")
    a.add_argument("--model", default=None, help="model folder or hub id (default: the shipped Tiny Storyteller)")
    a.add_argument("--allow-download", action="store_true", help="let --model fetch a hub id over the network")
    a.add_argument("--stories", default=None, help="corpus whose last 200 stories are the quiz "
                   "(default: the shared corpus, else the quiz shipped with the model)")
    a.add_argument("--quiz", default=None, help="measure on every story of this file instead")
    a.add_argument("--prompt", default=DIVERGENCE_PROMPT, help="prompt for the generation side-by-side")
    a.add_argument("--seed", type=int, default=0, help="sampling seed for the side-by-side generation")
    a.set_defaults(func=_cmd_ablate)


def _cmd_ablate(args) -> int:
    from ..hub import load_model
    from ..lesson import lesson_data
    from ..model import parse_head_label
    from .ablation import generation_divergence, name_ablation_table

    model = load_model(args.model, allow_download=args.allow_download)
    stories = lesson_data(getattr(model, "source_folder", None), args.stories, args.quiz).quiz
    modes = (args.mode,) if args.mode else ("zero", "mean")
    heads = None
    if args.heads:
        try:
            heads = [head_label(*parse_head_label(h)) for h in args.heads]
        except ValueError as e:
            raise StorylensError(f"--heads: {e}") from None
    table = name_ablation_table(model, stories, name_heads=heads, modes=modes, progress=True)
    print(table.format())
    first = heads[0] if heads else table.rows[-1].label.split("+")[0]
    d = generation_divergence(model, args.prompt, heads or [first], seed=args.seed, max_new_tokens=80,
                              mode=modes[0], temperature=0.8, top_k=40)
    print()
    print(d.format())
    sys.stdout.flush()
    return 0
