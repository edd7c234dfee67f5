"""Pictures of attention: matplotlib figures and a self-contained interactive HTML view.

* :mod:`storylens.viz.figures` - the causal-mask triangle, all heads on one story; PNG, SVG and
  data-URI output of any figure.
* :mod:`storylens.viz.score_figures` - per-head score bars and heatmaps.
* :mod:`storylens.viz.name_head` - the name head on one story (and the profile and even share it reports).
* :mod:`storylens.viz.widget` - :class:`AttentionWidget` (click a token, see its
  attention) and :func:`toy_widget` (hand-set queries and keys, score, softmax).
* :mod:`storylens.viz.explorer` - explore.html: every head of a scoring run, sortable and
  filterable, with where each fires (its top examples) and the examples' attention.
* :mod:`storylens.viz.tokens` - token display text and the model-to-array step.
* Every view has PNG and SVG buttons (``static/export.js``); :func:`save_figure` writes a
  matplotlib figure as both.
"""

from storylens.viz.explorer import explorer_html, write_explorer
from storylens.viz.figures import (
    all_heads_figure,
    causal_mask_figure,
    figure_data_uri,
    figure_png_bytes,
    figure_svg_bytes,
    save_figure,
    save_png,
    save_svg,
)
from storylens.viz.name_head import name_attention_profile, name_even_share, name_head_figure
from storylens.viz.score_figures import head_heatmap_figure, name_mass_bar_figure
from storylens.viz.tables import HEATMAP_CSS, head_heatmap_html
from storylens.viz.tokens import tick_label, to_numpy_attention, token_text, token_texts
from storylens.viz.widget import AttentionWidget, ToyWidget, replay_widget, toy_widget

__all__ = [
    "AttentionWidget",
    "ToyWidget",
    "toy_widget",
    "replay_widget",
    "all_heads_figure",
    "causal_mask_figure",
    "figure_data_uri",
    "figure_png_bytes",
    "figure_svg_bytes",
    "head_heatmap_figure",
    "head_heatmap_html",
    "explorer_html",
    "write_explorer",
    "HEATMAP_CSS",
    "name_attention_profile",
    "name_even_share",
    "name_head_figure",
    "name_mass_bar_figure",
    "save_figure",
    "save_png",
    "save_svg",
    "tick_label",
    "to_numpy_attention",
    "token_text",
    "token_texts",
]
