"""Writes lesson_02.ipynb (run: python notebooks/make_lesson_02.py). Cells follow the lesson's order."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

cells = [
    new_markdown_cell("""# Lesson 02: read Tiny Storyteller's own attention maps

Every number below is computed here, on storylens's shipped Tiny Storyteller and the 200 held-out
quiz stories. The lesson's figures are quoted next to ours; where they differ, ours is what this
model does."""),
    new_code_cell("""import torch
from storylens.hub import load_model
from storylens.data import load_split
from storylens.tokenizer import encode_story

model = load_model()              # the shipped model, no network
tok = model.tokenizer
split = load_split()              # last 200 stories = the quiz
quiz = split.quiz
print(f"{model.num_parameters():,} parameters; {len(split.train):,} training stories, {len(quiz)} quiz stories")"""),
    new_markdown_cell("""## The flag: fused kernel or the long way

`record_attention=True` makes every block compute query·key / 8, mask the future with minus
infinity, softmax, and keep the probabilities as `[batch, head, query, key]`."""),
    new_code_cell("""worst_logit, worst_row, cut = 0.0, 0.0, 0
with torch.no_grad():
    for story in quiz:
        enc = encode_story(tok, story)
        cut += enc.cut
        idx = torch.tensor([enc.ids])
        fused, explicit = model(idx), model(idx, record_attention=True)
        worst_logit = max(worst_logit, (fused.logits - explicit.logits).abs().max().item())
        worst_row = max(worst_row, max((a.sum(-1) - 1).abs().max().item() for a in explicit.attentions))
print(f"fused vs explicit, max |logit difference|: {worst_logit:.2e} (lesson: within 2e-5)")
print(f"max |row sum - 1|: {worst_row:.1e}; stories cut to the window: {cut} (lesson: 5)")"""),
    new_markdown_cell("## The triangle, and Ella's shelf"),
    new_code_cell("""from storylens.viz import causal_mask_figure, story_attention
tokens, att, enc = story_attention(model, quiz[0])
causal_mask_figure(tokens[:8]);"""),
    new_code_cell("""from storylens.model import KVCache
g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
start = torch.tensor([[0]])
cached = list(model.generate_stream(start, 200, generator=g1))
full = list(model.generate_stream(start, 200, generator=g2, use_kv_cache=False))
print("same tokens:", [s.token for s in cached] == [s.token for s in full])
print(f"max |logit difference|: {max((a.logits - b.logits).abs().max().item() for a, b in zip(cached, full)):.1e} (lesson: 3e-7)")
print("key/value computations:", cached[-1].kv_computed, "with the shelf,", full[-1].kv_computed, "without")
print(tok.decode([s.token for s in cached])[:300])"""),
    new_markdown_cell("## All 24 heads on one story"),
    new_code_cell("""from storylens.viz import all_heads_figure
all_heads_figure(att, tokens, max_tokens=32);"""),
    new_markdown_cell("## Click a token (the toy first: hand-set numbers, not Momo's weights)"),
    new_code_cell("""from storylens.viz import toy_widget, AttentionWidget
toy_widget()"""),
    new_code_cell("""AttentionWidget.from_model(model, quiz[0])"""),
    new_markdown_cell("## Leakage check"),
    new_code_cell("""from storylens.analysis import check_leakage
leak = check_leakage(quiz, split.train, word="Momo")
leak.summary()"""),
    new_markdown_cell("## Finding the name-tracking head"),
    new_code_cell("""from storylens.analysis import score_heads
scores = score_heads(model, quiz, max_stories_prev=100, progress=False)
print(f"{scores.n_main_character} of {scores.n_stories} stories have a main character (lesson: 159); "
      f"{scores.n_name_scored} scored; baseline {scores.name_baseline:.3f} (lesson: 0.052)")
for h in scores.top("name_mass", 6):
    print(f"{h.label}  name mass {h.name_mass:.3f}  ratio {h.name_ratio:.1f}x")
print(scores.count("name_mass", below=scores.name_baseline), "of 24 heads below the baseline (lesson: 17)")"""),
    new_code_cell("""from storylens.viz import name_mass_bar_figure, head_heatmap_figure
name_mass_bar_figure([(h.label, h.name_mass) for h in scores.heads], scores.name_baseline);
head_heatmap_figure(scores.grid("name_mass"), title="Name mass", highlight=scores.best("name_mass").label);"""),
    new_code_cell("""from storylens.analysis import find_main_characters
from storylens.viz import name_attention_profile, name_head_figure
top = scores.best("name_mass")
mains = find_main_characters(tok, quiz)
i = next(i for i, m in enumerate(mains) if m is not None and len(m.positions) >= 3)
tokens, att, _ = story_attention(model, quiz[i])
w, _ = name_attention_profile(att[top.block - 1, top.head - 1], list(mains[i].positions), mains[i].first_mention)
name_head_figure(tokens, w, list(mains[i].positions), label=top.label, first_mention=mains[i].first_mention,
                 baseline=scores.name_baseline, max_tokens=160);"""),
    new_markdown_cell("## Previous-token heads and the end-of-story marker"),
    new_code_cell("""p, pf, af = scores.best("prev_token"), scores.best("prev_token_first"), scores.best("prev_argmax_first")
print("heads above 0.5 on the previous token:", scores.count("prev_token", above=0.5), "(lesson: 0)")
print(f"highest: {p.label} {p.prev_token:.3f} (lesson: L1H1 0.146)")
print(f"first 100 stories: {pf.label} {pf.prev_token_first:.3f} on the previous token, "
      f"{pf.prev4_first:.3f} on the last four (lesson: 0.140 and 0.389)")
print(f"previous token is the top key: best {af.label} {af.prev_argmax_first:.3f} of queries (lesson: 0.369)")
m = scores.best("marker")
print(f"end-of-story marker: highest {m.label} {m.marker:.3f} (lesson: 0.065)")"""),
    new_markdown_cell("## Check yourself, with our numbers"),
    new_code_cell("""top = scores.best("name_mass")
print(f"The number to reproduce: {top.label}, name mass {top.name_mass:.3f} over {scores.n_name_scored} of "
      f"{scores.n_stories} stories, baseline {scores.name_baseline:.3f} ({top.name_ratio:.1f}x).")
print("1. The upper right is exactly zero:", all(bool((a[0].triu(1) == 0).all())
      for a in model(torch.tensor([encode_story(tok, quiz[0]).ids]), record_attention=True).attentions))
print("2. The shelf never needs updating: a prefix's keys and values equal the full run's (see the cache cell).")
print("3. Attention is not reliance: switching heads off (storylens ablate / report --beyond) tests it.")"""),
]

nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbformat.write(nb, Path(__file__).with_name("lesson_02.ipynb"))
