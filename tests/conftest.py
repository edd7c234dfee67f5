"""Shared fixtures: the real shipped model and the real quiz (corpus from ../shared)."""

import pytest


@pytest.fixture(scope="session")
def shipped_model():
    from storylens.model.hub import load_model

    return load_model()


@pytest.fixture(scope="session")
def corpus_split():
    from storylens.data.stories import load_split

    return load_split()


@pytest.fixture(scope="session")
def quiz_ids(shipped_model, corpus_split):
    """Every quiz story as [marker] + tokens, cut to the window."""
    from storylens.model.tokenizer import encode_story

    return [encode_story(shipped_model.tokenizer, s, shipped_model.config.block_size).ids for s in corpus_split.quiz]
