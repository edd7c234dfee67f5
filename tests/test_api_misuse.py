"""Issue 61, class 8: the Python API's misuse is refused with the CLI's words. A table of the measuring API's entry
points (storylens.analysis) against what a careless caller hands them where stories belong (None, one string, a
dict, bytes, numbers, nothing, only empty stories) and a model of 0 blocks: each is one StorylensError line, never
a raw TypeError, KeyError or IndexError from deep inside, and never a result computed from a dict's keys or a
string's characters."""

import pytest
import torch

import storylens.analysis as A
from storylens.core.errors import StorylensError
from storylens.core.heads import Head
from storylens.lm import NativeLM, wrap
from storylens.model.gpt import GPT, GPTConfig

BAD = [  # (what is passed, the words the one line holds)
    (None, "a list of stories (each a str), got NoneType"),
    ("Once upon a time.", "a list of stories, not one string"),
    ({"Once upon a time.": 1}, "a list of stories (each a str), got dict"),
    ([b"Once upon a time."], "must be text (a str), got bytes"),
    ([1, 2], "must be text (a str), got int"),
    ([], "nothing to score (empty list)"),
    (["", "   "], "no stories (all 2 are empty)"),
]


@pytest.fixture(scope="module")
def lm(shipped_model):
    return NativeLM(shipped_model)


ENTRIES = {  # name -> call(lm, stories)
    "score_heads": lambda lm, s: A.score_heads(lm, s, progress=False),
    "perplexity": lambda lm, s: A.perplexity(lm, s),
    "name_ablation_table": lambda lm, s: A.name_ablation_table(lm, s, name_heads=[Head(0, 0)], heads=[Head(0, 0)]),
    "position_control_scores": lambda lm, s: A.position_control_scores(lm, s),
    "pronoun_attention": lambda lm, s: A.pronoun_attention(lm, s),
    "check_leakage": lambda lm, s: A.check_leakage(s, ["A story to train on."]),
    "find_main_characters": lambda lm, s: A.find_main_characters(lm.tokenizer, s),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("given, words", BAD, ids=[repr(b[0])[:20] for b in BAD])
def test_stories_that_are_not_stories_are_one_line(lm, entry, given, words):
    if entry == "find_main_characters" and given == []:
        pytest.skip("no stories, no main characters: an empty list is an empty answer there")
    with pytest.raises(StorylensError) as e:
        ENTRIES[entry](lm, given)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("given", [None, "text", {"a": [1]}, [["a", "b"]], ["abc"]])
def test_head_means_refuse_what_is_not_token_ids(lm, given):
    with pytest.raises(StorylensError, match="token ids|a list of stories' token ids|nothing to run"):
        A.head_output_means(lm, given)


def test_a_model_of_no_blocks_is_one_line(shipped_model):
    empty = GPT(GPTConfig(n_layer=0))
    with pytest.raises(StorylensError, match="0 blocks; a model needs at least 1"):
        wrap(empty, shipped_model.tokenizer)
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=0, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(StorylensError, match="0 blocks; a model needs at least 1"):
        A.score_heads(wrap(hf, object()), ["Once upon a time."], progress=False)
    assert torch.is_grad_enabled()  # nothing half-run left behind
