"""Pronoun-to-name attention, on hand-built offsets and attention maps."""

import math

import pytest
import torch

from storylens.data.names import pronoun_positions, pronoun_spans, story_pronoun_positions
from storylens.looking.pronouns import PronounAccumulator, story_pronoun_mass

TEXT = "Tom saw her. He and they ran. Where?"
# hand-made tokens with byte-level style leading spaces; "they" split in two
TOKENS = ["Tom", " saw", " her", ".", " He", " and", " th", "ey", " ran", ".", " Where", "?"]


def offsets_of(tokens):
    out, i = [], 0
    for t in tokens:
        out.append((i, i + len(t)))
        i += len(t)
    return out


def test_pronoun_words_whole_and_case_insensitive():
    words = pronoun_spans(TEXT)
    assert [w for w, _ in words] == ["her", "He", "they"]  # not "Where" (holds "here")
    assert [s for _, s in words] == [(8, 11), (13, 15), (20, 24)]
    assert [w for w, _ in pronoun_spans("He's here; HIS hat, Sheila, them, theirs. she")] == ["He", "HIS", "she"]


def test_positions_last_token_of_the_word_marker_is_zero():
    offs = offsets_of(TOKENS)
    assert "".join(TOKENS) == TEXT
    spans = [s for _, s in pronoun_spans(TEXT)]
    # tokens: Tom 1, saw 2, her 3, . 4, He 5, and 6, th 7, ey 8 (marker is 0)
    assert pronoun_positions(offs, spans) == [3, 5, 8]
    assert pronoun_positions(offs, spans, window=8) == [3, 5]


def test_positions_with_the_real_tokenizer(shipped_model):
    from storylens.model.tokenizer import eot_id

    tok = shipped_model.tokenizer
    text = "Lily saw her dog. She smiled, and he's happy. They went home. There!"
    pos = story_pronoun_positions(tok, text)
    ids = [eot_id(tok)] + tok.encode(text).ids
    words = [tok.decode([ids[p]]).strip().lower() for p in pos]
    assert len(pos) == 4
    for w, want in zip(words, ["her", "she", "he", "they"]):
        assert want.endswith(w) and w  # the word's last token


def causal(rows, heads=1):
    T = len(rows)
    a = torch.zeros(heads, T, T, dtype=torch.float64)
    for q, r in enumerate(rows):
        assert len(r) == q + 1 and math.isclose(sum(r), 1.0)
        a[0, q, : q + 1] = torch.tensor(r, dtype=torch.float64)
        for h in range(1, heads):
            a[h, q, : q + 1] = 1.0 / (q + 1)  # even spread
    return a


# name token at 2; pronoun queries at 1 (before the name: not counted) and 4
MAP = causal(
    [
        [1.0],
        [0.5, 0.5],
        [0.2, 0.3, 0.5],
        [0.1, 0.2, 0.3, 0.4],  # other query: name gets 0.3
        [0.1, 0.1, 0.6, 0.1, 0.1],  # pronoun: 0.6
        [0.1, 0.1, 0.2, 0.2, 0.2, 0.2],  # other query: 0.2
    ],
    heads=2,
)


def test_story_by_hand():
    s = story_pronoun_mass(MAP, [2], [1, 4])
    assert s.n_pronoun_queries == 1 and s.n_other_queries == 2
    assert s.pronoun_mass[0].tolist() == pytest.approx([0.6, 1 / 5])  # head 2 spreads evenly
    assert s.other_mass[0].tolist() == pytest.approx([(0.3 + 0.2) / 2, (1 / 4 + 1 / 6) / 2])
    assert s.pronoun_even == pytest.approx(1 / 5)
    assert s.other_even == pytest.approx((1 / 4 + 1 / 6) / 2)


def test_story_needs_a_counted_pronoun():
    assert story_pronoun_mass(MAP, [2], [1]) is None  # its only pronoun precedes the name
    assert story_pronoun_mass(MAP, [], [4]) is None
    # two name tokens: both before the pronoun count
    s = story_pronoun_mass(MAP, [1, 2], [4])
    assert s.pronoun_mass[0, 0].item() == pytest.approx(0.7)
    # padding cut by length
    padded = torch.nn.functional.pad(MAP, (0, 3, 0, 3))
    t = story_pronoun_mass(padded, [2], [1, 4], length=6)
    assert torch.equal(t.pronoun_mass, story_pronoun_mass(MAP, [2], [1, 4]).pronoun_mass)


def test_accumulator_mean_of_story_means():
    acc = PronounAccumulator(1, 2)
    assert acc.add(MAP, [2], [1, 4])
    assert acc.add(MAP, [1, 2], [4])  # pronoun 0.7; other queries 3 and 5: 0.5 and 0.3
    assert not acc.add(MAP, [2], [1])
    r = acc.result()
    assert r.n_stories == 2 and r.n_pronoun_queries == 2
    assert r.pronoun_mass[0, 0].item() == pytest.approx((0.6 + 0.7) / 2)
    assert r.other_mass[0, 0].item() == pytest.approx((0.25 + 0.4) / 2)
    assert r.ratio[0, 0].item() == pytest.approx(0.65 / 0.325)
    assert r.to_rows()[1]["label"] == "L1H2"
    assert "L1H1" in r.format()


def test_add_batch_slices_each_story():
    acc = PronounAccumulator(2, 2)
    batch = torch.stack([torch.nn.functional.pad(MAP, (0, 2, 0, 2)), torch.nn.functional.pad(MAP, (0, 2, 0, 2))])
    n = acc.add_batch([batch, batch], [6, 6], [[2], None], [[1, 4], [4]])
    assert n == 1
    assert acc.result().pronoun_mass[:, 0].tolist() == pytest.approx([0.6, 0.6])
