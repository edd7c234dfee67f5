"""The Ray driver's merge, without Ray: chunks that come back out of order wait for their turn, so
what is merged is always the first stories, and a chunk that comes back twice is refused."""

import json

import pytest

from storylens.core.errors import StorylensError
from storylens.corpus.ray_engine import _InOrder
from storylens.engine.record import RecordStats
from storylens.table.accumulator import HeadScoreAccumulator


def row(start: int, n: int, pid: int = 1, peak: float = 10.0) -> dict:
    """One chunk as an actor returns it: an empty accumulator's state, ``n`` stories, one cut."""
    state = json.dumps(HeadScoreAccumulator(2, 3).state())
    return {"start": start, "n": n, "cut": 1, "main": n - 1, "pid": pid, "state": state, "peak_mb": peak}


def _merging(acc):
    """What score_with_ray merges a chunk's row with: its state into ``acc``."""
    return lambda r: acc.merge(acc.like().load_state(json.loads(r["state"])))


def test_chunks_merge_in_story_order_whatever_order_they_come_back_in():
    merger = _InOrder(_merging(HeadScoreAccumulator(2, 3)), start=100)
    assert not merger.add(row(104, 4, pid=2, peak=30.0))  # story 100's chunk is not back: this one waits
    assert merger.next == 100 and merger.stats == RecordStats(0, 0, 0) and list(merger.waiting) == [104]
    assert merger.add(row(100, 4, pid=1, peak=20.0))  # now both, in order
    assert merger.next == 108 and merger.stats == RecordStats(8, 2, 6) and not merger.waiting
    assert merger.add(row(108, 2, pid=2, peak=25.0))
    assert merger.next == 110 and merger.stats == RecordStats(10, 3, 7)
    assert merger.actor_peaks == {1: 20.0, 2: 30.0}  # each actor's highest


@pytest.mark.parametrize("again", [100, 108])  # one merged already, one still waiting
def test_a_chunk_back_twice_is_refused(again):
    merger = _InOrder(_merging(HeadScoreAccumulator(2, 3)), start=100)
    assert merger.add(row(100, 4)) and not merger.add(row(108, 4))
    with pytest.raises(StorylensError, match=f"chunk at story {again} came back twice"):
        merger.add(row(again, 4))
