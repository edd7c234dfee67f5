"""Writes any_model.ipynb (run: python notebooks/make_any_model.py).

The practitioner's notebook: a transformers causal LM from a folder (``$STORYLENS_MODEL``), every
head scored over stories, the table as a data frame and a grid, the sink and causal columns, the
explorer inline, top examples, attribution patching checked against exact ablation, and a
``patch`` run on the example pairs. Cells that draw figures carry the tag ``figure`` (one picture
per ``display(`` in the cell), cells that show a storylens view the tag ``widget`` and cells that
show an HTML table the tag ``table``: tests/test_any_model_notebook.py executes the notebook on a
small Llama it saves and counts them from these tags.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def md(text):
    return new_markdown_cell(text.strip())


def code(text, *tags):
    cell = new_code_cell(text.strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


cells = [
    md("""
# storylens on any model: every head, what it looks at and what it does

This notebook reads a causal language model of your own, head by head. It loads the model from a
folder, scores every attention head over a few stories, and shows the results as data frames and
grids: where each head looks (the detectors), whether it is an attention sink or dormant, its
effect on the loss by attribution patching (checked against the exact ablation), and every head's
effect on a task of clean/corrupt prompt pairs.

**The model**: set the environment variable `STORYLENS_MODEL` to a transformers model folder
(GPT-2, GPT-Neo, Llama-style, ...; weights in safetensors) before starting Jupyter, e.g.
`STORYLENS_MODEL=path/to/model jupyter lab`, or in the next cell. Without it the notebook reads the
Tiny Storyteller shipped with storylens, so it runs anywhere. Nothing is downloaded, and it runs on
a CPU in a minute or two for a small model (set `DEVICE = "cuda"` for a large one).

**To run it**: on Colab, *Runtime → Run all* (the first cell installs storylens if it is missing);
elsewhere `pip install "git+https://github.com/storylens/storylens"` with the `pandas` extra.
"""),
    code("""
import importlib.util, shlex, subprocess, sys
REPOSITORY = "https://github.com/storylens/storylens"  # the one address: pyproject.toml's [project.urls]
if importlib.util.find_spec("storylens") is None:  # Colab or a fresh environment: install once
    install = f'{shlex.quote(sys.executable)} -m pip install -q "storylens[pandas] @ git+{REPOSITORY}"'
    print(install)
    done = subprocess.run(shlex.split(install))
    if done.returncode != 0:  # stop here: every later cell needs storylens
        raise RuntimeError(f"pip could not install storylens from {REPOSITORY} (exit {done.returncode}; "
                           "its message is above): check the address and the network, then run this cell again")
"""),
    md("""
## 1. Load the model

`storylens.load_lm` opens a storylens or transformers folder as an `AttentionLM`: one interface
(its heads, its window, its tokenizer, TransformerLens-style hook points) whatever the family. It
refuses in one line what it cannot read faithfully: pickled weights, custom code, weights that do
not match the config. `dtype="float64"` makes every number exact to rounding; `device="cuda"` runs
it on a GPU.
"""),
    code("""
%matplotlib inline
import os
import pandas as pd
from IPython.display import display
import storylens

MODEL = os.environ.get("STORYLENS_MODEL")   # a model folder; unset: storylens's own Tiny Storyteller
DEVICE = "cpu"
if MODEL:
    lm = storylens.load_lm(MODEL, device=DEVICE)
else:
    print("STORYLENS_MODEL is not set, so this reads the Tiny Storyteller shipped with storylens; "
          "set it to a transformers model folder to read your own model")
    lm = storylens.load_lm(device=DEVICE)
print(f"{lm.name}: {lm.n_layer} blocks x {lm.n_head} heads, a {lm.window}-token window")
"""),
    md("""
## 2. Score every head over stories

The stories are the lesson's 200 quiz stories (TinyStories that Tiny Storyteller never trained on),
shipped with storylens; any list of strings will do, e.g.
`storylens.data.stories.read_stories("stories.txt.gz", limit=500)`. A story longer than the window
is cut to it. One pass records every block's attention and scores it as it goes:

* the **detectors**: where each head looks (the main character's name, the previous token, the
  opening token, an earlier copy of the token, the token after it: induction), raw and
  norm-weighted (attention times the size of what each key passes on);
* the **sink** columns: how much and how often a head parks its attention on the opening token, and
  whether what it writes depends on the story at all;
* with `causal=True`, every head's **effect on the loss**, estimated by attribution patching, and its
  direct push on the next token's logit;
* with `examples=K`, the K queries where each head fires most, per detector.
"""),
    code("""
from storylens.lesson import lesson_quiz

N_STORIES = 24    # more stories: smaller standard errors, a longer run
quiz, source = lesson_quiz()
stories = quiz[:N_STORIES]
scores = storylens.score_heads(lm, stories, examples=3, causal=True, progress=False)
print(f"{scores.n_stories} stories ({source}), {scores.n_cut} cut to the window")
"""),
    md("""
`to_pandas()` gives the table as a data frame, one row per head (`label` `L{block}H{head}`, blocks
and heads counted from 1), every column, and the `dormant` flag: the same table `storylens score`
writes as heads.csv, read back by `pandas.read_csv` to the very float.
"""),
    code(
        """
frame = scores.to_pandas()
print(f"{len(frame)} heads x {len(frame.columns)} columns")
frame.head()
""",
        "table",
    ),
    md("""
What each column means is declared once in storylens (`scores.columns`), and the same words reach
heads.json, the explorer and the docs:
"""),
    code("""
for c in scores.columns[:6]:
    print(f"{c.name:16} {c.meaning}")
print(f"... and {len(scores.columns) - 6} more")
"""),
    md("""
In Jupyter a scored table shows itself as a block x head grid (of `name_mass`: attention on the
story's main character); `grid_html(column)` is the same grid of any other column, as HTML text.
"""),
    code(
        """
scores
""",
        "table",
    ),
    code(
        """
from IPython.display import HTML

HTML(scores.grid_html("prev_token"))   # grid_html gives the HTML as text; HTML(...) shows it
""",
        "table",
    ),
    md("""
## 3. Sinks and dormant heads

Many heads send most of their attention to the first token and write almost nothing from it: a
place to park attention when there is nothing to find (an *attention sink*). `first_mass` is the
attention on position 0, `sink_rate` the share of stories where it passes 0.3, `first_value_ratio`
the size of what the first token passes on against the other keys'; `context_share` and
`active_rate` say how much of what the head writes depends on the story. A head is **dormant**
when switching it to its mean output would move nothing: almost none of its output depends on the
story and, where attribution patching ran, its effect on the loss is within noise of zero.
"""),
    code(
        """
sinks = ["label", "first_mass", "sink_rate", "first_value_ratio", "context_share", "context_norm",
         "active_rate", "dormant"]
print(f"dormant heads: {int(frame['dormant'].sum())} of {len(frame)}")
frame[sinks].sort_values("sink_rate", ascending=False).head(8)
""",
        "table",
    ),
    code(
        """
from storylens.viz import head_heatmap_figure
display(head_heatmap_figure(scores.grid("first_mass"), title="Attention on the opening token"))
display(head_heatmap_figure(scores.grid("context_share"), title="Context share: what depends on the story"))
""",
        "figure",
    ),
    md("""
## 4. The explorer, inline

Every head with every column: sort by any column, filter with expressions such as
`prev_token > 0.5 and output_share < 0.02` or `dormant`, draw a grid of any column, and click a head
for its top examples, the query outlined and the earlier tokens shaded by its attention. It is the
same view `storylens score` writes as explore.html (`.to_html()` here gives the page). In an
untrusted notebook Jupyter may refuse its script: trust the notebook.
"""),
    code(
        """
scores.explorer(lm.tokenizer, title=f"storylens explorer: {lm.name}")
""",
        "widget",
    ),
    md("""
## 5. Top examples

The examples behind the explorer, as a data frame: per head and detector, the queries where the
head fires most (`rank` 0 first), the story and positions, the score there (`value`), the most
attended key and the tokens around the query.
"""),
    code(
        """
from storylens.viz import token_text

examples = scores.examples.to_pandas(lambda i: token_text(lm.tokenizer, i))
best = scores.best("prev_token")
mine = examples[(examples.label == best.label) & (examples.detector == "prev_token")]
print(f"{best.label} attends most to the previous token ({best.prev_token:.3f}); where it fires most:")
for _, e in mine.iterrows():   # the query is tokens[query_at], shown in brackets
    text = "".join(f"[{t}]" if j == e["query_at"] else t for j, t in enumerate(e["tokens"]))
    print(f"  story {e['story']}, query {e['query']}, score {e['value']:.3f}: ...{text}...")
mine[["label", "detector", "rank", "story", "query", "value", "key", "key_weight"]]
""",
        "table",
    ),
    md("""
## 6. What each head does to the loss

Attention says where a head looks, not whether the model needs what it finds. Attribution patching
(AtP, Nanda 2023; Kramár et al. 2024) estimates, for every head at once from one forward and one
backward pass a batch, how much the stories' mean next-token loss (nats, pooled over predicted
tokens) would change if the head's output were replaced by its mean (`atp_mean`) or by zero
(`atp_zero`), each with its standard error over stories (`_se`). `dla` is the head's direct push on
the correct next token's logit. Positive `atp_*`: the model needs the head.
"""),
    code(
        """
causal = ["label", "atp_mean", "atp_mean_se", "atp_zero", "atp_zero_se", "dla", "dla_se"]
frame[causal].reindex(frame["atp_mean"].abs().sort_values(ascending=False).index).head(8)
""",
        "table",
    ),
    code(
        """
edge = frame["atp_mean"].abs().max() or 1.0   # a symmetric scale: white is no effect
display(head_heatmap_figure(scores.grid("atp_mean"), title="AtP, mean ablation (nats; in parentheses: within 2 se of 0)",
                            cmap="RdBu_r", vmin=-edge, vmax=edge, fmt="{:+.3f}", colorbar_label="nats",
                            errors=scores.grid("atp_mean_se")))
""",
        "figure",
    ),
    md("""
### The exact audit

AtP is a first-order estimate: it can miss where a head's attention saturates or where heads
cancel. `storylens.effects.audit` checks it where a reader would look: the heads with the largest
|AtP| in each mode and as many drawn at random from the rest, each ablated for real (one forward
pass per head and mode), with Spearman's rho between estimate and measurement and the heads where
they disagree in sign beyond two standard errors. Both sides replace a head's output by the same
mean, taken over the same stories.
"""),
    code(
        """
from storylens.effects.audit import Effect, attribution, audit
from storylens.engine.encode import encode_stories
from storylens.core.heads import Head

chosen = encode_stories(lm, stories[:8], names=frozenset())   # ids cut to the window, as scored
cols, acc = attribution(lm, chosen)
estimates = {mode: {h: Effect(float(cols[f"atp_{mode}"][h]), float(cols[f"atp_{mode}_se"][h]))
                    for h in Head.every(lm.n_layer, lm.n_head)} for mode in ("mean", "zero")}
checked = audit(lm, [e.ids for e in chosen], estimates, k=4, means=acc.z_means())
rows = pd.DataFrame([{"head": r.head, "why": r.why,
                      "atp_mean": r.atp_mean.nats, "atp_mean_se": r.atp_mean.se,
                      "exact_mean": r.exact_mean.nats, "exact_mean_se": r.exact_mean.se,
                      "atp_zero": r.atp_zero.nats, "exact_zero": r.exact_zero.nats} for r in checked.rows])
print(f"{len(rows)} heads audited on {checked.n_stories} stories ({checked.n_tokens:,} tokens); "
      f"Spearman rho, AtP vs exact: mean {checked.rho_mean:.3f}, zero {checked.rho_zero:.3f}")
print(f"sign disagreements beyond two standard errors: {list(checked.disagree) or 'none'}")
rows
""",
        "table",
    ),
    code(
        """
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(4.6, 4.0))
ax.errorbar(rows.exact_mean, rows.atp_mean, xerr=2 * rows.exact_mean_se, yerr=2 * rows.atp_mean_se,
            fmt="o", ms=4, capsize=2, color="#1f5f8b")
lim = max(rows.exact_mean.abs().max(), rows.atp_mean.abs().max()) * 1.1 or 1.0
ax.plot([-lim, lim], [-lim, lim], color="0.6", lw=1, ls="--")   # AtP = exact
ax.set(xlabel="exact change in loss (nats)", ylabel="AtP estimate (nats)", title="AtP against exact, mean ablation")
fig.tight_layout()
plt.close(fig)
display(fig)
""",
        "figure",
    ),
    md("""
## 7. A task of your own: `patch`

The loss says what a head does on average. A task asks a sharper question: write pairs of prompts,
a **clean** one the model should get right and a **corrupt** one with what matters changed, and the
metric `logit(answer) - logit(wrong)` at the last position. Each head's effect is the clean run
with that head's output taken from the corrupt run (exact, one patched pass per head) and its AtP
estimate; `gap_fraction` is the exact effect as a share of the whole clean-to-corrupt gap.
storylens ships two tasks as templates: 20 indirect-object pairs in the stories' style (used here) and
40 pairs of the lesson's own behaviour, the main character's name (`NAME_PAIRS`, the command's default);
on a tokenizer where a name is two tokens a line is refused, and you write your own (see the docs' Patch
page). The run says first whether the model does the task at all. `storylens patch --model DIR --out
FOLDER` is the same run from the command line.
"""),
    code(
        """
from storylens.effects.patching import EXAMPLE_PAIRS, encode_pairs, patch_heads, read_pairs, summary_lines

pairs = encode_pairs(lm, read_pairs(EXAMPLE_PAIRS))
patched = patch_heads(lm, pairs, exact="all")
print("\\n".join(summary_lines(patched, top=6)))
effects = patched.to_pandas()          # one row per head: patch.csv's columns
effects.reindex(effects["exact"].abs().sort_values(ascending=False).index).head(6)
""",
        "table",
    ),
    code(
        """
span = max(max(abs(h.exact), abs(h.atp)) for h in patched.heads) or 1.0   # one colour scale for both


def effect_grid(what):
    return head_heatmap_figure({h.head: getattr(h, what) for h in patched.heads}, cmap="RdBu_r", vmin=-span,
                               vmax=span, fmt="{:+.2f}", colorbar_label="logit difference",
                               errors={h.head: getattr(h, f"{what}_se") for h in patched.heads},
                               title=f"{what}: effect on logit(answer) - logit(wrong), {patched.pairs} pairs")


display(effect_grid("exact"))
display(effect_grid("atp"))
""",
        "figure",
    ),
    md("""
The run writes and reads back like the command's: `write_patch` publishes patch.csv, patch.json
(versioned, with a JSON Schema in the package: `storylens.core.schema.schema("patch")`) and
patch.html (the two grids, a click on a head showing its attention on a pair), and
`storylens.load_patch` reads patch.json back as the same result.
"""),
    code("""
from storylens.effects.patching import write_patch

folder = write_patch("patch-run", patched, lm, pairs)
again = storylens.load_patch(folder)
print(sorted(p.name for p in folder.iterdir()), "read back equal:", again == patched)
"""),
    md("""
## 8. How the heads work together: `circuit`

A head's effect says what it carries; an **edge** says from whom it gets it. Every edge from the input,
a head or an MLP to a later head's query, key or value input, an MLP or the logits is scored by edge
attribution patching; the circuits of the top edges are then run exactly, every other edge carrying the
corrupt prompt's value, and their faithfulness `f` (1: the circuit does what the model does) is measured
at growing sizes. Grouped key/value heads are native: a key or value edge goes to the group. The
`storylens circuit` command adds an exact audit of sampled edges, the circuit's stability over resamples of
the pairs, and circuit.html (see the docs' Circuits page).
"""),
    code(
        """
from storylens.circuits.run import circuit_lines, run_circuit
from storylens.effects.patching import NAME_PAIRS

task = encode_pairs(lm, read_pairs(NAME_PAIRS)[:8])
circuit = run_circuit(lm, task, oracle=0, resamples=0)
print("\\n".join(circuit_lines(circuit, top=8)))
edges = circuit.to_pandas()            # one row per edge: circuit.csv's columns
edges.reindex(edges["score"].abs().sort_values(ascending=False).index).head(8)
""",
        "table",
    ),
    md("""
## From the command line

The same readings, written to folders with every number and an offline page:

```bash
storylens score  --model path/to/model --stories stories.txt.gz --causal --out scores   # heads.csv/json, examples, explore.html
storylens report --model path/to/model --causal --out report                           # the report: every head at a glance, the audit
storylens patch  --model path/to/model --pairs pairs.jsonl --out patch-run              # patch.csv/json/html
storylens circuit --model path/to/model --pairs pairs.jsonl --out circuit-run           # circuit.csv/json/html
```

`storylens.load_heads("scores", as_pandas=True)` reads a score or report run back as data frames.
"""),
]

for i, cell in enumerate(cells):  # fixed ids (nbformat draws random ones): the same script, the same file
    cell.id = f"cell-{i:02d}"

nb = new_notebook(
    cells=cells,
    metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    },
)
out = Path(__file__).with_name("any_model.ipynb")
nbformat.write(nb, out)
print(f"wrote {out}")
