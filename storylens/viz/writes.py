"""Where heads look against what they write (``storylens writes``): each head's attention mass on the name
against the logit it writes toward the name from the name, and the name-loss increase when each ranking's top
``k`` heads are ablated, with two-standard-error bars. Drawn from writes.json's document; never runs a model."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from storylens.viz.figures import NAME_COLOR, _new_figure

WRITE_COLOR = "#1f77b4"
LABELLED = 3  # heads named on the scatter: the top of each ranking


def _scatter(ax, doc: dict) -> None:
    heads = [h for h in doc["heads"] if h["name_mass"] is not None and h["write_name"] is not None]
    x = np.array([h["name_mass"] for h in heads])
    y = np.array([h["write_name"] for h in heads])
    err = np.array([2 * (h["write_name_se"] or 0.0) for h in heads])
    ax.errorbar(x, y, yerr=err, fmt="o", ms=4, color="#555555", ecolor="#bbbbbb", elinewidth=1, capsize=0)
    named = set(np.argsort(-y, kind="stable")[:LABELLED]) | set(np.argsort(-x, kind="stable")[:LABELLED])
    for i in sorted(named):
        ax.annotate(heads[i]["head"], (x[i], y[i]), xytext=(4, 3), textcoords="offset points", fontsize=7)
    ax.axhline(0, color="#999999", linewidth=0.6)
    ax.set_xlabel("attention mass on the name (name_mass)")
    ax.set_ylabel("logit written toward the name, read from the name\n(write_name, ± 2 SE)")
    ax.set_title(f"Where heads look vs what they write (Spearman {doc['spearman']:+.2f})", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)


def _cuts(ax, doc: dict) -> None:
    ks = sorted({c["k"] for c in doc["cuts"]})
    pos = np.arange(len(ks))
    for shift, ranking, color, label in (
        (-0.2, "write", WRITE_COLOR, "top k by write_name"),
        (0.2, "mass", NAME_COLOR, "top k by name_mass"),
    ):
        cuts = {c["k"]: c for c in doc["cuts"] if c["ranking"] == ranking}
        v = np.array([cuts[k]["name_increase"] for k in ks])
        e = np.array([2 * (cuts[k]["name_increase_se"] or 0.0) for k in ks])
        ax.bar(pos + shift, v, 0.4, yerr=e, color=color, label=label, capsize=2, edgecolor="#333333", linewidth=0.5)
    ax.set_xticks(pos, [str(k) for k in ks])
    ax.set_xlabel(f"heads {doc['mode']}-ablated together (k)")
    ax.set_ylabel("increase in loss on the name (nats, ± 2 SE)")
    ax.set_title(f"What removing them costs on the name ({doc['name_positions']} name tokens)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.spines[["top", "right"]].set_visible(False)


def writes_figure(doc: dict, *, title: str | None = None) -> Figure:
    """Two panels from writes.json's document: the scatter and the ablation bars."""
    fig = _new_figure((11.0, 4.4))
    left, right = fig.subplots(1, 2)
    _scatter(left, doc)
    _cuts(right, doc)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig
