"""A story longer than the figures draw: the report cuts it to the figures' budget and finishes,
whichever quiz story it shows (issue 42: a long story's main character mentioned only past the
tokens drawn ended the report with ``ValueError: no name positions given``)."""

import json

import pytest
import torch

from storylens.data.names import name_vocabulary
from storylens.data.stories import EOT
from storylens.engine.encode import encode_stories
from storylens.lm import wrap
from storylens.recording import figure_tokens

transformers = pytest.importorskip("transformers")
LAYERS, HEADS = 2, 6  # the figures draw figure_tokens(2, 6) = 1,365 tokens of a story


@pytest.fixture(scope="module")
def lm():
    from storylens.model.hub import load_model

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=load_model().tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=4096, vocab_size=tok.vocab_size,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return wrap(transformers.AutoModelForCausalLM.from_config(cfg).eval(), tok)


@pytest.fixture(scope="module")
def late_story(lm, corpus_split):
    """Real quiz stories joined into one text of more tokens than the figures draw, then a quiz story
    told again until its main character is the text's: that name is mentioned only past the cut.
    Returns ``(text, main character, short story whose main character is mentioned early)``."""
    shown = figure_tokens(LAYERS, HEADS)
    quiz = corpus_split.quiz
    names = name_vocabulary(quiz)
    mains = [(s, e.main) for s, e in zip(quiz, encode_stories(lm, quiz, names)) if e.main is not None]
    story, main = next((s, m) for s, m in mains if len(m.positions) >= 3 and m.first_mention < 40)
    early = ""
    for s in quiz:
        if main.name not in s:
            early = f"{early} {s}" if early else s
            if len(lm.encode(early)) > shown + 50:
                break
    text = early
    for _ in range(40):
        text = f"{text} {story}"
        got = encode_stories(lm, [text], name_vocabulary([*quiz, text]))[0].main
        if got is not None and got.name == main.name:
            break
    assert got is not None and got.name == main.name and got.first_mention > shown
    assert len(lm.encode(text)) < lm.window  # the model sees the whole story; only the figures cut it
    return text, main.name, story


def test_the_story_shown_is_one_whose_name_is_drawn(lm, late_story):
    """Of a long story whose main character comes past the tokens drawn and a short one with an early
    name, the figures show the short one; alone, the long one is shown (never refused)."""
    from storylens.lesson.drawing import pick_story

    long_text, _, short = late_story
    shown = figure_tokens(LAYERS, HEADS)
    both = [long_text, short]
    mains = [e.main for e in encode_stories(lm, both, name_vocabulary(both))]
    assert all(m is not None for m in mains)
    assert pick_story(both, mains, shown) == 1
    assert pick_story([long_text], mains[:1], shown) == 0


def test_a_report_on_a_long_story_finishes_with_its_story_cut(lm, late_story, tmp_path):
    """``storylens report`` on a quiz of one story longer than the figures draw, its main character
    mentioned only past them: the report finishes, the story shown is cut to the figures' budget,
    and the name-head figure is drawn with no name to box."""
    from storylens.lesson.report import build_report

    text, name, _ = late_story
    quiz = tmp_path / "quiz.txt"
    quiz.write_text(f"{text}\n{EOT}\n", encoding="utf-8")
    report = build_report(tmp_path / "r", model=lm, quiz=str(quiz), progress=False, truth_stories=0)
    shown = json.loads((tmp_path / "r" / "summary.json").read_text())["story_shown"]
    assert shown == {"quiz_index": 1, "main_character": name, "tokens": figure_tokens(LAYERS, HEADS)}
    assert report.scores.n_stories == 1 and report.scores.n_name_scored == 1
    figure = (tmp_path / "r" / "top_name_head.svg").read_text(encoding="utf-8")
    assert f"{name} is mentioned only past the {shown['tokens']}" in figure  # says why no name is boxed
