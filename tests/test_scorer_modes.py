"""Batched and async reward functions, and on_error="zero"."""

import re

import pytest
import torch

from grpo.scoring.scorer import Scorer
from rewards import RewardError, batched

FIXTURES = "tests.fixtures.slow_rewards"

PROMPTS = ["12345", "12345", "12345", "123", "123"]
COMPLETIONS = ["54321", "54320", "543210", "", "3x1"]
ANSWERS = ["54321", "54321", "54321", "321", "321"]
METADATA = [{}] * 5
EXPECTED_DIGITS = torch.tensor([1.0, 0.8, 5 / 6, 0.0, 2 / 3])


def test_batched_decorator_sets_attribute():
    def f(prompts, completions, answers, metadata):
        return []

    assert batched(f) is f and f.batched is True


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_batched_and_async_equal_per_episode(num_workers):
    names = ["batched_digit_match", "async_digit_match", "async_batched_digit_match"]
    functions = ["digit_match"] + [f"{FIXTURES}:{name}" for name in names]
    with Scorer(functions, [1.0] * 4, timeout_s=30.0, num_workers=num_workers) as scorer:
        scored = scorer.score(PROMPTS, COMPLETIONS, ANSWERS, METADATA)
    torch.testing.assert_close(scored.per_function["digit_match"], EXPECTED_DIGITS)
    for name in names:
        assert torch.equal(scored.per_function[name], scored.per_function["digit_match"]), name
    torch.testing.assert_close(scored.total, 4 * EXPECTED_DIGITS)
    assert scored.errors == {name: 0 for name in ["digit_match", *names]}


@pytest.mark.parametrize("on_error", ["stop", "zero"])
def test_batched_wrong_length_names_function(on_error):
    with Scorer([f"{FIXTURES}:batched_wrong_length"], [1.0], timeout_s=30.0, num_workers=0, on_error=on_error) as s:
        wrong = "batched reward function 'batched_wrong_length' returned 6 rewards for 5 episodes"
        with pytest.raises(RewardError, match=re.escape(wrong)):
            s.score(PROMPTS, COMPLETIONS, ANSWERS, METADATA)


def test_invalid_on_error():
    with pytest.raises(ValueError, match="'stop', 'zero'"):
        Scorer(["digit_match"], [1.0], timeout_s=1.0, num_workers=0, on_error="skip")


def test_async_raising_stops_by_default():
    with Scorer([f"{FIXTURES}:async_boom"], [1.0], timeout_s=30.0, num_workers=0) as scorer:
        with pytest.raises(RewardError) as error:
            scorer.score(["0", "1", "2"], ["a", "bad", "c"], [""] * 3, [{}] * 3)
    assert str(error.value) == (
        "reward function 'async_boom' raised ValueError('async boom') on episode 1 (prompt '1', completion 'bad')"
    )


def test_on_error_zero_raising_and_non_finite(capsys):
    functions = [f"{FIXTURES}:boom", f"{FIXTURES}:async_boom", f"{FIXTURES}:nan_on_bad", f"{FIXTURES}:not_a_number"]
    completions = ["a", "bad", "c", "bad", "d"]
    with Scorer(functions, [1.0, 1.0, 1.0, 1.0], timeout_s=30.0, num_workers=0, on_error="zero") as scorer:
        scored = scorer.score(["0", "1", "2", "3", "4"], completions, [""] * 5, [{}] * 5)
    expected = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    for name in ["boom", "async_boom", "nan_on_bad"]:
        assert torch.equal(scored.per_function[name], expected), name
    assert torch.equal(scored.per_function["not_a_number"], torch.zeros(5))
    torch.testing.assert_close(scored.total, 3 * expected)
    assert scored.errors == {"boom": 2, "async_boom": 2, "nan_on_bad": 2, "not_a_number": 5}
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("warning: reward function 'boom' failed on 2/5 episodes, scored 0.0")
    assert "first: reward function 'boom' raised ValueError('boom') on episode 1 (prompt '1'" in lines[0]
    assert "returned nan (float) on episode 1" in lines[2]


def test_on_error_zero_in_pool_and_timeout(capsys):
    functions = [f"{FIXTURES}:hang_on_hang", f"{FIXTURES}:boom"]
    with Scorer(functions, [1.0, 10.0], timeout_s=0.5, num_workers=2, on_error="zero") as scorer:
        # episodes 0-1 are one chunk; episode 1 hangs, so both score 0.0
        scored = scorer.score(["0", "1", "2", "3"], ["a", "hang", "bad", "c"], [""] * 4, [{}] * 4)
        assert torch.equal(scored.per_function["hang_on_hang"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        assert scored.errors["hang_on_hang"] == 2
        assert "reward function 'hang_on_hang' timed out after 0.5 s on episodes 0-1" in capsys.readouterr().err
        # the pool was recreated: the next call works
        scored = scorer.score(["0", "1", "2", "3"], ["a", "b", "bad", "c"], [""] * 4, [{}] * 4)
    assert torch.equal(scored.per_function["hang_on_hang"], torch.ones(4))
    assert torch.equal(scored.per_function["boom"], torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert scored.errors == {"hang_on_hang": 0, "boom": 1}
    torch.testing.assert_close(scored.total, torch.tensor([11.0, 11.0, 1.0, 11.0]))
