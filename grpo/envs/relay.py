"""`digit_relay`, the built-in multi-turn task: half of the reward needs what the environment says.

Turn 0: the model answers the prompt (`d1 .. dn =`) as in copy_digits. The environment then says
n fresh digits and `=`, drawn from the episode's prompt index (every sample of a group hears the
same ones). Turn 1: the model should repeat them. The reward is the mean of rewards.digit_match of
turn 0 against the prompt's answer and of turn 1 against the environment's digits, so both turns
use one skill (repeat the digits before the last `=`), and a policy that ignores the
environment's reply scores at most 0.5 + 0.05 in expectation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import rewards
from grpo.data.prompt import Prompt
from grpo.envs.base import EnvReply


@dataclass
class RelayState:
    answer: str  # turn 0's reference: the prompt's own answer
    secret: str  # turn 1's reference: what the environment says
    first: float = 0.0  # turn 0's digit_match


class DigitRelay:
    name = "digit_relay"
    max_turns = 2

    def __init__(self, seed: int = 0):
        self.seed = seed

    def reset(self, prompt: Prompt) -> RelayState:
        rng = random.Random(f"relay-{self.seed}-{prompt.index}")
        return RelayState(prompt.answer, "".join(rng.choice("0123456789") for _ in prompt.answer))

    def step(self, state: RelayState, turn: int, completion: str, completion_tokens: list[int]) -> EnvReply:
        if turn == 0:
            state.first = rewards.digit_match("", completion, state.answer, {})
            return EnvReply(text=state.secret + "=")
        second = rewards.digit_match("", completion, state.secret, {})
        return EnvReply(done=True, reward=(state.first + second) / 2)
