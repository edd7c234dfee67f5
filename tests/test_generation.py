"""storylens.lm.generate: streamed text, and recorded generation on the model's device."""

import random

from storylens.lm.generate import record_generation, stream_text


def test_streamed_text_is_the_decoded_text_written_whole_characters_at_a_time(shipped_model):
    tok = shipped_model.tokenizer
    ids = tok.encode("Lily saw a \u2603 snowman and said \u4f60\u597d \U0001f642!").ids
    pieces = list(stream_text(tok, ids))
    assert "".join(pieces) == tok.decode(ids)
    assert "\u2603" in pieces and "\U0001f642" in pieces  # each split character comes out whole, once
    assert all("\ufffd" not in p for p in pieces)


def test_streamed_text_matches_decode_for_any_tokens(shipped_model):
    """Random ids (the marker, lone bytes, characters never finished) join to what decode gives."""
    tok = shipped_model.tokenizer
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(0, 20))]
        assert "".join(stream_text(tok, ids)) == tok.decode(ids)


def test_an_unfinished_character_at_the_end_is_written_as_decode_writes_it(shipped_model):
    tok = shipped_model.tokenizer
    ids = tok.encode("\U0001f642").ids
    assert len(ids) > 1  # byte-level: one emoji, several tokens
    assert "".join(stream_text(tok, ids[:-1])) == tok.decode(ids[:-1])


def test_recorded_generation_lives_on_the_models_device(shipped_model):
    run = record_generation(shipped_model, "Lily found a shiny stone.", 5, seed=2)
    assert run.patterns.device == next(shipped_model.parameters()).device
    assert len(run.ids) - run.prompt_len <= 5
