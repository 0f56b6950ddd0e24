"""The environment interface: what a multi-turn episode asks of the world the model talks to.

An environment starts from a prompt's record (`reset`) and answers each model turn (`step`) with
the tokens or text to append, whether the episode is over, and optionally a reward. The rollout
(conversation.py) appends the environment's tokens verbatim after the model's: nothing the model
sampled is decoded and re-encoded, so the trainer sees exactly the tokens the generator produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from grpo.data.prompt import Prompt


@dataclass
class EnvReply:
    """An environment's answer to one model turn.

    tokens: ids appended after the model's turn (chat-template markers included), or
    text: appended through the run's tokenizer when `tokens` is None;
    done: the episode ends here (no further model turn);
    reward: the episode's reward, when the environment decides it (read when done);
    tool_calls, tool_errors: the tool calls this reply answers, and how many of them failed
    (counted per episode for the metrics).
    """

    tokens: list[int] | None = None
    text: str = ""
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    """A multi-turn task. `name` appears in error lines; `max_turns` caps the model turns of one
    episode (the rollout ends an episode there, marked truncated)."""

    name: str
    max_turns: int

    def reset(self, prompt: Prompt) -> Any:
        """This episode's state, from the prompt it starts with."""
        ...

    def step(self, state: Any, turn: int, completion: str, completion_tokens: list[int]) -> EnvReply:
        """The reply to model turn `turn` (0-based): its decoded text and its token ids."""
        ...
