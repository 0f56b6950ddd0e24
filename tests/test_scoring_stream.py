"""Scoring during generation (grpo/scoring/stream.py, rewards.overlap): completions handed over in
pieces, as an engine's checks find them finished, get the rewards of scoring the whole batch at once."""

import random
import sys

import pytest
import torch

from grpo.data.prompt import Prompt
from grpo.engine import Completion, GenerationRequest
from grpo.rollout.generate import episodes_from_completions
from grpo.scoring.scorer import Scorer, score_episodes
from grpo.scoring.stream import STREAM_SWITCH_INTERVAL_S, ScoringStream

FIXTURES = "tests.fixtures.slow_rewards"
DIGITS = "0123456789"


def decode(ids: list[int]) -> str:
    return "".join(DIGITS[i % 10] if i < 100 else "bad" for i in ids)


def decode_batch(id_lists: list[list[int]]) -> list[str]:
    return [decode(ids) for ids in id_lists]


def batch(group_size: int = 4, prompts: int = 6, seed: int = 0) -> tuple[dict[int, Prompt], list[Completion]]:
    """Digit-reversal prompts and random completions, group by group (one bad completion: id 100)."""
    rng = random.Random(seed)
    by_index, completions = {}, []
    for index in range(prompts):
        digits = [rng.randrange(10) for _ in range(rng.randint(3, 6))]
        text = "".join(DIGITS[d] for d in digits)
        by_index[index] = Prompt(index, text, text[::-1], digits, metadata={"score": float(index)})
        for sample in range(group_size):
            tokens = [rng.randrange(10) for _ in range(rng.randint(1, 7))]
            request = GenerationRequest(digits, 0, index, sample)
            completions.append(Completion(request, tokens, [-0.5] * len(tokens), "eos", 0))
    completions[5].tokens[:], completions[5].logprobs[:] = [100], [-0.5]
    return by_index, completions


def pieces(completions: list[Completion], seed: int) -> list[list[Completion]]:
    """The completions in a shuffled finishing order, cut into checks of 1-7 each."""
    order = completions[:]
    random.Random(seed).shuffle(order)
    cuts, at = [], 0
    rng = random.Random(seed + 1)
    while at < len(order):
        size = rng.randint(1, 7)
        cuts.append(order[at : at + size])
        at += size
    return cuts


@pytest.mark.parametrize("seed", [0, 1])
def test_rewards_and_sums_equal_scoring_the_whole_batch(seed):
    prompts, completions = batch(seed=seed)
    functions, weights = ["digit_match", f"{FIXTURES}:from_metadata"], [1.0, -0.25]
    with Scorer(functions, weights, timeout_s=30, num_workers=2) as scorer:
        whole = episodes_from_completions(completions, pad_id=0)
        want_sums = score_episodes(scorer, whole, prompts, decode_batch)
        stream = ScoringStream(scorer, prompts, decode_batch, {}, pad_id=0)
        for piece in pieces(completions, seed):
            stream.add(piece)
        episodes = episodes_from_completions(completions, pad_id=0)
        sums, failure = stream.finish(episodes)
    assert failure is None
    assert torch.equal(episodes.rewards, whole.rewards) and whole.rewards.abs().sum() > 0
    assert sums.keys() == want_sums.keys()
    for name in sums:
        assert sums[name] == pytest.approx(want_sums[name], rel=1e-6)


def test_a_failing_reward_is_handed_back_not_raised():
    prompts, completions = batch()
    with Scorer([f"{FIXTURES}:boom"], [1.0], timeout_s=30, num_workers=1) as scorer:
        stream = ScoringStream(scorer, prompts, decode_batch, {}, pad_id=0)
        for piece in pieces(completions, 3):
            stream.add(piece)
        sums, failure = stream.finish(episodes_from_completions(completions, pad_id=0))
    assert sums == {} and failure is not None
    message = str(failure)
    assert "reward function 'boom' raised ValueError('boom') on episode" in message and "completion 'bad'" in message
    assert "numbers count the" in message and "scored together while generation ran" in message


def test_zeroed_episodes_are_reported_once_for_the_whole_batch(capsys):
    prompts, completions = batch()
    with Scorer([f"{FIXTURES}:boom"], [1.0], timeout_s=30, num_workers=1, on_error="zero") as scorer:
        stream = ScoringStream(scorer, prompts, decode_batch, {}, pad_id=0)
        for piece in pieces(completions, 4):
            stream.add(piece)
        episodes = episodes_from_completions(completions, pad_id=0)
        sums, failure = stream.finish(episodes)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert failure is None and sums == {"boom": len(completions) - 1.0}
    assert lines == [lines[0]] and f"failed on 1/{len(completions)} episodes" in lines[0]
    assert episodes.rewards[5] == 0.0 and episodes.rewards.sum() == len(completions) - 1


def test_an_episode_the_engine_never_reported_is_an_error():
    prompts, completions = batch()
    with Scorer(["digit_match"], [1.0], timeout_s=30, num_workers=1) as scorer:
        stream = ScoringStream(scorer, prompts, decode_batch, {}, pad_id=0)
        stream.add(completions[1:])
        expected = r"23 completions were scored for 24 episodes; unscored \(prompt, sample\): \[\(0, 0\)\]"
        with pytest.raises(RuntimeError, match=expected):
            stream.finish(episodes_from_completions(completions, pad_id=0))


def test_close_stops_without_scoring_what_is_left():
    prompts, completions = batch()
    with Scorer(["digit_match"], [1.0], timeout_s=30, num_workers=1) as scorer:
        stream = ScoringStream(scorer, prompts, decode_batch, {}, pad_id=0)
        stream.close()
        stream.add(completions)
        assert not stream._thread.is_alive() and stream._scored == 0


def test_the_gil_switches_often_while_a_stream_lives_and_as_before_after():
    prompts, completions = batch()
    before = sys.getswitchinterval()
    with Scorer(["digit_match"], [1.0], timeout_s=30, num_workers=1) as scorer:
        stream = ScoringStream(scorer, prompts, decode_batch, {}, pad_id=0)
        assert sys.getswitchinterval() == pytest.approx(STREAM_SWITCH_INTERVAL_S, rel=0.05) and STREAM_SWITCH_INTERVAL_S < before
        stream.add(completions)
        stream.finish(episodes_from_completions(completions, pad_id=0))
        stream.close()
    assert sys.getswitchinterval() == before
