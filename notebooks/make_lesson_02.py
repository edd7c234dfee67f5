"""Writes lesson_02.ipynb (run: python notebooks/make_lesson_02.py).

The notebook follows the lesson's order in its own words. Cells that draw a figure carry the tag
``figure`` and cells that show a widget the tag ``widget``: tests/test_notebook.py checks that each
produced an image or an HTML output when the notebook runs.
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


def answer(question, text):
    """A check-yourself question whose answer stays folded until the reader opens it."""
    return md(f"**{question}**\n\n<details><summary>Show the answer</summary>\n\n{text.strip()}\n\n</details>")


cells = [
    md("""
# Lesson 02 in storylens: reading a small GPT's attention

Tiny Storyteller is a small language model: six blocks, four attention heads in each, about
5.9 million numbers in all, trained on short children's stories. In this notebook you open it
up and watch where each of its 24 heads looks while it reads a story. Nothing gets trained here;
we only read.

You will see every number computed on your own machine, from the model and the 200 quiz stories
that ship with storylens (stories the model never trained on). The lesson quotes its own
figures for a model trained elsewhere; where ours differ, ours are what this model does, and the
text says so rather than bending a definition.

**To run it**: on Colab, *Runtime → Run all* (the first cell installs storylens if it is
missing); on your own computer, install it from its repository,
`pip install "git+https://github.com/storylens/storylens"` (storylens is not on PyPI), and open
this file in Jupyter. No GPU and no corpus download are needed; everything takes well under a
minute on a laptop CPU.
"""),
    code("""
import importlib.util, shlex, subprocess, sys
REPOSITORY = "https://github.com/storylens/storylens"  # the one address: pyproject.toml's [project.urls]
if importlib.util.find_spec("storylens") is None:  # Colab or a fresh environment: install once
    install = f'{shlex.quote(sys.executable)} -m pip install -q "git+{REPOSITORY}"'
    print(install)
    done = subprocess.run(shlex.split(install))
    if done.returncode != 0:  # stop here: every later cell needs storylens
        raise RuntimeError(f"pip could not install storylens from {REPOSITORY} (exit {done.returncode}; "
                           "its message is above): check the address and the network, then run this cell again")
"""),
    code("""
%matplotlib inline
import torch
from IPython.display import display
from storylens.model.hub import load_model
from storylens.lesson import lesson_quiz

model = load_model()                 # the shipped Tiny Storyteller; no network
tok = model.tokenizer
quiz, quiz_source = lesson_quiz(model)
print(f"{model.num_parameters():,} parameters, {model.config.n_layer} blocks x {model.config.n_head} heads")
print(f"{len(quiz)} quiz stories ({quiz_source})")
"""),
    md("""
## 1. One head, in miniature

Picture the story read aloud in a circle: every word takes its seat in order, and when its turn
comes it may glance back at the words already seated, never forward. A **head** is one particular
way of glancing back. For that, every word is given three short lists of numbers (64 each in this
model):

* its **query**: what this word is looking for;
* its **key**: what this word offers to be found by;
* its **value**: what this word passes on if someone looks at it.

A word compares its query with the key of every earlier word by a dot product (multiply the
numbers pairwise, add them up). The softmax then turns those scores into shares that are all
positive and add up to one: raise *e* to each score, divide by the total. Finally the word takes
the share-weighted mix of the values. The shares are the **attention probabilities**; one row of
them per word, for a whole story, is an **attention map**.

The widget below is a toy with two numbers per query and key, set by hand so that "He" goes
looking for a name. Click a word to make it the one that looks back, and edit the numbers to watch
the shares move. These are not the model's numbers; the model's queries are 64 numbers produced
by a matrix multiply, and any "looking for a name" story we tell about them is our reading.

The toy sentence stars Momo the monkey, the lesson's own character: in the lesson's telling, Momo
*is* the model (his dials are its weights). He comes back in section 7, as the leakage check word.
"""),
    code(
        """
from storylens.viz import toy_widget
toy_widget()
""",
        "widget",
    ),
    md("""
## 2. A switch that keeps the shares

PyTorch computes attention with one fused routine that never hands back the shares. storylens's
model has a flag, `record_attention`, that makes every block do it the long way instead: scores,
mask, softmax, blend, keeping the probabilities as a tensor shaped
`[batch, head, query, key]`. Both ways are the same mathematics; they can only differ by the order
in which the computer rounds its sums.

The cell measures that on your CPU, in single precision (float32, how the model normally runs)
and in double precision (float64). Each number sits next to the largest difference rounding alone
could explain (the *bound*; see `storylens.lesson.checks` for the derivation). In float64 the gaps
shrink to around 1e-14: the two paths really compute the same thing.

First the flag itself, on one quiz story: the same model called twice, once as it normally runs
(the fused routine) and once with `record_attention=True`, which hands back one map per block.
"""),
    code("""
from storylens.model.tokenizer import encode_story

ids = torch.tensor([encode_story(tok, quiz[0]).ids])
with torch.no_grad():
    fused = model(ids)                             # the fast path: no attention kept
    recorded = model(ids, record_attention=True)   # the long way: every block's probabilities kept
print(f"fused path keeps patterns: {fused.patterns is not None}")
print(f"patterns: {len(recorded.patterns)} blocks, each {list(recorded.patterns[0].shape)} "
      "[batch, head, query, key]")
print(f"largest logit difference, fused vs recorded: {(fused.logits - recorded.logits).abs().max().item():.1e}")
print(f"every row sums to 1 within {(recorded.patterns[4].sum(-1) - 1).abs().max().item():.0e}")
"""),
    md("""
Now the same comparison measured properly, over twelve stories and in two precisions:
"""),
    code("""
from storylens.lesson.checks import run_checks
from storylens.model.tokenizer import encode_story

ids = [encode_story(tok, s).ids for s in quiz[:12]]
checks = run_checks(model, ids, gen_tokens=200)
for c in checks:
    print(f"{c.name:34} {c.dtype:8} measured {c.measured:9.2e}   bound {c.bound:9.2e}   {c.detail}")
"""),
    md("""
## 3. The triangle

While guessing the next word the model must not peek ahead. The rule that enforces it is the
**causal mask**: before the softmax, the score of every later word is set to minus infinity, and
*e* to the minus infinity is exactly zero. So every attention map is a lower triangle, and the
blank upper-right half of every picture below is that rule, not a choice a head made.
"""),
    code(
        """
from storylens.recording import story_attention  # runs the model; storylens.viz only draws
from storylens.viz import causal_mask_figure
tokens, att, enc = story_attention(model, quiz[0])
display(causal_mask_figure(tokens[:8]))
""",
        "figure",
    ),
    md("""
## 4. The shelf: why generation can be cheap

The triangle has a consequence. An earlier word can never see a later one, so once its key and
value are computed they never change. When the model writes a story token by token, it can file
each token's key and value on a shelf (the **KV cache**) and, for every new token, compute only
that token's own query, key and value, reading the rest from the shelf.

The check above already compared the two ways of generating (with the shelf and recomputing
everything each step): the same tokens, logits apart only by rounding. The counter is the saving:
200 tokens cost 200 key and value computations with the shelf, and 1 + 2 + ... + 200 = 20,100
without. The shelf is a speed-up, not a memory: what the model knows lives in its weights.
"""),
    code("""
counter = next(c for c in checks if c.name == "key/value computations" and c.dtype == "float32")
print(counter.detail)
"""),
    md("""
## 5. All 24 heads on one story

Here is the first quiz story through all six blocks and four heads, the first tokens of it. Each
small square is one head's attention map: row = the word looking back, column = the word looked
at. The colour map is viridis on a power scale: brighter (towards yellow) = a larger share, dark
purple = almost none, and every map uses the same scale, 0 to 1; the flat dark grey upper-right
triangle is the causal mask. Some heads spread their attention thinly; some fix on the very first
token (the end-of-story marker that opens every story); a few pick out particular words. Every
figure is a matplotlib figure: `save_figure(fig, "name")` writes it as PNG and SVG, and every
interactive view below has PNG and SVG buttons of its own.
"""),
    code(
        """
from storylens.viz import all_heads_figure, save_figure
fig = all_heads_figure(att, tokens, max_tokens=32)
save_figure(fig, "all_heads")  # all_heads.png and all_heads.svg beside the notebook, for slides or a paper
display(fig)
""",
        "figure",
    ),
    md("""
## 6. Click a token

The same story in an interactive view. Click any token to make it the query and the earlier
tokens light up by the share it gives them; pick a block and head, or show all 24 at once. Hover a
token for its exact share. (In an untrusted notebook, Jupyter may refuse to run the view's script:
trust the notebook, or open the report's HTML file instead.)
"""),
    code(
        """
from storylens.recording import attention_widget
attention_widget(model, quiz[0])
""",
        "widget",
    ),
    md("""
### Watch it write

The same view can replay generation. storylens records, at every step of KV-cached generation,
the new token's row of attention; press **Play** (or step through) and each token appears
together with where the model looked while choosing it.
"""),
    code(
        """
from storylens.lm.generate import record_generation
from storylens.viz import replay_widget
run = record_generation(model, "Once upon a time, there was a girl named Mia.", max_new_tokens=60,
                        temperature=0.8, top_k=40, seed=0)
replay_widget(run, tok)
""",
        "widget",
    ),
    md("""
## 7. Are the quiz stories really unseen?

A measurement on stories the model memorised would tell us little, so first a leakage check
between the quiz and the training stories: how many quiz stories are identical to a training
story, how many mention the word "Momo", and what share of each quiz story's eight-word runs also
occur somewhere in training. TinyStories are written from a small vocabulary and repeat many
phrases, so some overlap is expected; identical stories would be a problem. (Without the training
corpus at hand, storylens shows the check it ran when the model was trained.)

"Momo" is the lesson's leakage check word. The lesson tells its story with two characters: Momo
the monkey is the model (his dials, already set in Lesson 01, are its weights), and Ella the
elephant is the teacher who reads him the story and keeps the shelf of keys and values. The
check counts the quiz stories that mention Momo; the lesson found none.
"""),
    code("""
from storylens.lesson import lesson_leakage
leakage = lesson_leakage(model)   # a LeakageReport; leakage.shares holds every story's share
print(f"{leakage.n_quiz} quiz stories against {leakage.n_train:,} training stories")
print(f"identical to a training story: {leakage.n_duplicates}")
print(f'mentioning "{leakage.word}": {leakage.n_mentioning}')
print(f"share of a story's {leakage.run_words}-word runs also found in training: mean {leakage.run_share_mean:.1%}, "
      f"largest {leakage.run_share_max:.1%} (quiz story {leakage.run_share_argmax + 1})")
"""),
    md("""
## 8. Looking for the name-tracking head

Now a crude but precise question: which head looks most at the story's main character?

* A **name** is a capitalised word whose lowercase form appears nowhere in the 200 quiz stories
  (that rules out "She" and "The" but keeps "Lily" and "Tim").
* A story's **main character** is its most frequent name, if it is mentioned at least twice;
  stories without one are skipped.
* For each head, take every position after the name's first mention that is not itself part of
  the name, add up the attention it puts on the name's tokens, average over those positions, then
  over the stories. That is the head's **name mass**.
* The **baseline** is what an even spread would give: at each position, the number of name
  tokens it can see divided by the number of tokens it can see, averaged the same way.
"""),
    code("""
from storylens.analysis import score_heads
scores = score_heads(model, quiz, max_stories_prev=100, progress=False)
print(f"{scores.n_main_character} of {scores.n_stories} stories have a main character; "
      f"{scores.n_name_scored} are scored. Baseline {scores.name_baseline:.3f}.")
for h in scores.top("name_mass", 6):
    print(f"{h.label}  name mass {h.name_mass:.3f}  ({h.name_ratio:.1f} x the baseline)")
below = scores.count("name_mass", below=scores.name_baseline)
print(f"{below} of {len(scores.heads)} heads put less on the name than an even spread would")
"""),
    md("""
Below, the same scores as a bar chart against the baseline and as a block x head table. Each
table in this notebook is coloured over its own range (shown on its colour bar: black for its
smallest value, light yellow for its largest), so compare tables by their numbers, not their
colours.
"""),
    code(
        """
from storylens.viz import name_mass_bar_figure, head_heatmap_figure
display(name_mass_bar_figure([(h.label, h.name_mass) for h in scores.heads], scores.name_baseline))
display(head_heatmap_figure(scores.grid("name_mass"), title="Name mass, block x head",
                            highlight=scores.best("name_mass").label))
""",
        "figure",
    ),
    md("""
Here is the winning head on one story, after the name's first mention: each bar is the share of
attention that lands on a token, averaged over the positions that look back at it, with the
name's tokens marked.
"""),
    code(
        """
from storylens.analysis import find_main_characters
from storylens.viz import name_attention_profile, name_head_figure
top = scores.best("name_mass")
mains = find_main_characters(tok, quiz)
i = next(i for i, m in enumerate(mains) if m is not None and len(m.positions) >= 3)
tokens_i, att_i, _ = story_attention(model, quiz[i])
weights, queries = name_attention_profile(att_i[top.block - 1, top.head - 1], list(mains[i].positions),
                                          mains[i].first_mention)
display(name_head_figure(tokens_i, weights, list(mains[i].positions), label=top.label,
                         first_mention=mains[i].first_mention, queries=queries, max_tokens=120))
""",
        "figure",
    ),
    md("""
## 9. The heads that are not there

Small transformers often grow a **previous-token head**: one that sends most of its attention to
the word just before. Here we count heads with more than half their attention on the previous
token, and also how often the previous token is the single most-attended one. A last score asks
whether any head leans mostly on the end-of-story marker, the token that closes one story and
opens the next. The two tables after the numbers have their own colour ranges again (see their
colour bars), not the name-mass table's.
"""),
    code("""
prev = scores.best("prev_token")
print(f"heads with more than half on the previous token: {scores.count('prev_token', above=0.5)}")
print(f"highest: {prev.label} at {prev.prev_token:.3f}; on the last four tokens together: {prev.prev4:.3f}")
arg = scores.best("prev_argmax")
print(f"the previous token is the top key for {arg.prev_argmax:.3f} of queries at best ({arg.label})")
mk = scores.best("marker")
print(f"most attention on the end-of-story marker: {mk.label} at {mk.marker:.3f}")
"""),
    code(
        """
display(head_heatmap_figure(scores.grid("prev_token"), title="Attention on the previous token",
                            highlight=prev.label))
display(head_heatmap_figure(scores.grid("marker"), title="Attention on the end-of-story marker",
                            highlight=mk.label))
""",
        "figure",
    ),
    md("""
## 10. What this does and does not show

Three limits to keep in mind before telling a story about these heads:

1. The top head puts a fraction of its attention on the name, not all of it. It leans; it does
   not switch.
2. Attention says where a head looks. It does not say that the model's next word depends on what
   the head found there: to learn that you have to take the head away and watch what breaks.
3. Position is not controlled. A name that comes early is far back for most later words, and
   some heads simply like far-back tokens.

The lesson stopped there. The next two cells do the experiment it names: switch the top
name-mass head off (replace its output with zeros) and measure how much worse the model gets at
predicting the name's tokens, against every other token.
"""),
    code("""
from storylens.analysis import name_ablation_table
table = name_ablation_table(model, quiz, heads=[top.label], k=0, modes=["zero"], progress=False)
print(table.format())
"""),
    md("""
If the loss on the name's tokens rises much more than on other tokens when the head is switched
off, the model relies on that head for names, not just looks with it. `storylens report --beyond`
runs this for every head (and a position control and a pronoun test); the head that attends most
to the name is not always the one whose loss hurts most.

### Where a head looks, and what it moves

A head can put most of its attention on a token whose value vector is tiny, and then pass on
almost nothing: attention is where it looks, not what it moves. `score_heads` also scores every
detector on the **norm-weighted** map (each key's attention times the size of what that key
carries through the head's output projection, renormalised; Kobayashi et al. 2020) and measures
each head's **output share** of its block. The next cell puts the three side by side with the loss
change when each detector's strongest heads are switched off, and says in numbers where they
agree and where they part.
"""),
    code("""
from storylens.table.truth import truth_table
truth = truth_table(model, scores, quiz)
for r in truth.rows:
    print(f"{r.detector:16} {r.head}  raw {r.raw:.3f}  norm-weighted {r.norm:.3f}  "
          f"share {r.share:.0%}  loss {r.zero_increase:+.3f} (zero) on {r.where}")
print()
print("\\n".join(truth.sentences))
"""),
    md("""
## Check yourself

The number to reproduce with this notebook: the top name-mass head, its mass, the baseline and
their ratio (printed in section 8).
"""),
    answer(
        "1. Why is the upper-right half of every attention map exactly zero, not just small?",
        """Before the softmax the score of every later word is set to minus infinity, and the
exponential of minus infinity is exactly 0. It is the causal mask, applied on purpose, so no share
can go to a word that has not been written yet.""",
    ),
    answer(
        "2. Why can the KV cache keep keys and values without ever updating them?",
        """A token's key and value are computed only from itself and the tokens before it (the
mask again), so tokens that arrive later cannot change them. Each new token adds its own key and
value and reads the rest.""",
    ),
    answer(
        "3. A head puts a large share of its attention on the main character's name. Does that "
        "prove the model uses the name to write the next word? What would?",
        """No: it shows where the head looks, not what the output depends on. Switch the head off
(zero or mean ablation) and compare the loss on predicting the name against the loss elsewhere;
control for position too, since early tokens draw attention for being early.""",
    ),
]

nb = new_notebook(
    cells=cells,
    metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    },
)
out = Path(__file__).with_name("lesson_02.ipynb")
nbformat.write(nb, out)
print(f"wrote {out}")
