"""Shared fixtures: the real shipped model and the real quiz (corpus from ../shared)."""

import os

import pytest
from tiers import ONE_WORKER, SLOW


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


# ---------------------------------------------------------------- the fast tier and the workers
# What is slow and why, and which files share a worker: tests/tiers.py.


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each, no oversubscription
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # and for the storylens processes the tests start
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups to send whole files to one worker
def pytest_collection_modifyitems(config, items):
    for item in items:
        where = item.nodeid
        for prefix, why in SLOW.items():
            if where.startswith(prefix):
                item.add_marker(pytest.mark.slow(reason=why))
        path = where.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(ONE_WORKER.get(path, path)))
