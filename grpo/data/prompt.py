"""What every prompt source gives the run: `Prompt`s, a `Tokenizer` and the `PromptSource`
interface (the built-in digit tasks, prompt files and reasoning-gym datasets all satisfy it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Prompt:
    """One prompt of the dataset: `index` is its stable id (keys sampling randomness); held-out
    prompts have negative indices. `token_ids` end with the tokens of `response_prefix`, the text
    the model's answer starts with (data.response_prefix; part of the prompt, so it carries no loss)."""

    index: int
    text: str
    answer: str
    token_ids: list[int]
    metadata: dict = field(default_factory=dict)
    response_prefix: str = ""


class Tokenizer(Protocol):
    """Text in and out, the vocabulary size and the ids that end a completion."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_ids(self) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def decode_batch(self, id_lists: list[list[int]]) -> list[str]: ...


class PromptSource(Protocol):
    """The prompts of a run: those of each RL step, and a held-out set that is never trained on.

    `train_prompts(step, count, round_index)` depends only on its arguments and the seed, so any
    rank can rebuild any step's batch (resume, async steps); `round_index` > 0 draws dynamic
    sampling's extra rounds, disjoint from every other step's and round's prompts.
    `max_prompt_tokens` bounds every prompt it gives, held-out ones included (the engine's KV slots
    are sized from it).
    """

    eval_prompts: list[Prompt]

    @property
    def max_prompt_tokens(self) -> int: ...

    def train_prompts(self, step: int, count: int, round_index: int = 0) -> list[Prompt]: ...
