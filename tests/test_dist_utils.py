"""The multi-rank test helper: a rank that hangs outside any collective is reported with its stack."""

import time

import pytest

from tests.dist_utils import run_ranks


def _rank_1_waits_forever(rank: int, world_size: int) -> int:
    if rank == 1:
        _stuck_outside_any_collective()
    return rank


def _stuck_outside_any_collective() -> None:
    while True:
        time.sleep(0.05)


def _identity(rank: int, world_size: int) -> int:
    return rank


def test_a_rank_hung_past_the_deadline_is_reported_with_its_stack(tmp_path):
    with pytest.raises(RuntimeError) as caught:
        run_ranks(_rank_1_waits_forever, 2, tmp_path, timeout_s=8.0, collective_timeout_s=60.0)
    message = str(caught.value)
    assert "ranks still running after 8.0 s" in message
    assert "rank1's threads when it was stopped" in message
    assert "_stuck_outside_any_collective" in message


def test_a_rank_stopped_after_its_peers_timeout_is_reported_with_its_stack(tmp_path):
    with pytest.raises(RuntimeError) as caught:
        run_ranks(_rank_1_waits_forever, 2, tmp_path, timeout_s=60.0, collective_timeout_s=4.0)
    message = str(caught.value)
    assert "Timed out waiting" in message  # rank 0's closing barrier
    assert "_stuck_outside_any_collective" in message


def test_ranks_that_finish_return_their_results(tmp_path):
    assert run_ranks(_identity, 2, tmp_path) == [0, 1]
