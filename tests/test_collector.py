"""The run's garbage-collector policy: pauses are counted, frozen objects are skipped by passes and
given back to the collector when the block ends."""

import gc
import time
import weakref

from grpo.observe.collector import CollectorPauses


class _Node:
    def __init__(self) -> None:
        self.other = self


def _cycles(n: int) -> list[_Node]:
    return [_Node() for _ in range(n)]


def test_pauses_are_the_collector_passes_inside_the_block():
    with CollectorPauses() as pauses:
        garbage = _cycles(200_000)
        del garbage
        pauses.lap()  # the automatic passes that creating the cycles set off
        start = time.perf_counter()
        gc.collect()
        wall = time.perf_counter() - start
        inside = pauses.lap()
        assert 0.0 < inside <= wall
        assert pauses.lap() == 0.0
    gc.collect()
    assert pauses.lap() == 0.0  # the callback left with the block


def test_frozen_objects_survive_passes_until_the_block_ends():
    assert gc.get_freeze_count() == 0
    node = _Node()
    alive = weakref.ref(node)
    with CollectorPauses() as pauses:
        pauses.freeze_long_lived()
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # an unreachable cycle, but frozen: no pass looks at it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
