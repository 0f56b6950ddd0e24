"""`digit_relay`, the built-in multi-turn task: the environment speaks after the model's first
turn, and only what it says gives the answer.

Turn 0: the model answers the prompt (`d1 .. dn =`) any way it likes. The environment then says
two digits and `=`, drawn from the episode's prompt index (so every sample of a group hears the
same digits). Turn 1: the model should repeat them; the reward is rewards.digit_match of that turn
against them. A policy that ignores the environment scores 0.1 in expectation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import rewards
from grpo.data.prompt import Prompt
from grpo.envs.base import EnvReply


@dataclass
class RelayState:
    secret: str


class DigitRelay:
    name = "digit_relay"
    max_turns = 2

    def __init__(self, seed: int = 0, digits: int = 2):
        self.seed, self.digits = seed, digits

    def reset(self, prompt: Prompt) -> RelayState:
        rng = random.Random(f"relay-{self.seed}-{prompt.index}")
        return RelayState("".join(rng.choice("0123456789") for _ in range(self.digits)))

    def step(self, state: RelayState, turn: int, completion: str, completion_tokens: list[int]) -> EnvReply:
        if turn == 0:
            return EnvReply(text=state.secret + "=")
        return EnvReply(done=True, reward=rewards.digit_match("", completion, state.secret, {}))
