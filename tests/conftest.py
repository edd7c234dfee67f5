"""Shared fixtures: the real shipped model and the real quiz (corpus from ../shared)."""

import os
from collections import Counter

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
    if hasattr(config.option, "loadscopereorder"):
        # xdist would send the files with the most tests first, so a long file of one test (the wheel, a
        # notebook) started last and the other worker sat idle; the order below is kept instead
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups to send whole files to one worker
def pytest_collection_modifyitems(config, items):
    """Marks each test slow (tests/tiers.py) and groups a file's tests on one worker; then orders the files for
    the two workers: the slow ones first, longest first as tiers.SLOW lists them, then the rest by their number
    of tests, most first, so that the run ends on short files on both workers."""
    rank = {prefix: i for i, prefix in enumerate(SLOW)}
    group_of, slow_rank = {}, {}
    for item in items:
        where = item.nodeid
        for prefix, why in SLOW.items():
            if where.startswith(prefix):
                item.add_marker(pytest.mark.slow(reason=why))
                slow_rank[item] = rank[prefix]
        path = where.split("::", 1)[0]
        group_of[item] = ONE_WORKER.get(path, path)
        item.add_marker(pytest.mark.xdist_group(group_of[item]))
    sizes = Counter(group_of.values())
    items.sort(key=lambda it: (0, slow_rank[it], 0) if it in slow_rank else (1, 0, -sizes[group_of[it]]))
