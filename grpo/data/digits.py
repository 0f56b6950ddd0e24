"""The built-in tasks on random digit strings and their character tokenizer: no files, no downloads."""

from __future__ import annotations

import random
import typing

from grpo.config.sections import DigitTaskName
from grpo.data.prompt import Prompt


class CharTokenizer:
    """A fixed character vocabulary for the built-in task: no files, no downloads.

    Id 0 is EOS (and padding); every character of `alphabet` gets its own id after it. There is no
    other special token: every token a policy emits before EOS is a visible character that the
    reward sees, so no token can pad a completion for free.
    """

    eos_id = pad_id = 0

    def __init__(self, alphabet: str = "0123456789="):
        self.alphabet = alphabet
        self._ids = {ch: i + 1 for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 1

    @property
    def eos_ids(self) -> list[int]:
        return [self.eos_id]

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self._ids))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the built-in tokenizer's alphabet {self.alphabet!r}")
        return [self._ids[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        """Text of the ids, EOS dropped."""
        return "".join(self.alphabet[i - 1] for i in ids if i != self.eos_id)

    def decode_batch(self, id_lists: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in id_lists]


class DigitTask:
    """Built-in verifiable tasks on random digit strings: `copy_digits` answers the digits,
    `reverse_digits` their reversal; rewards.digit_match scores either.

    Prompts are `d1 .. dn =`. The held-out set is drawn first from its own seed and every
    training prompt equal to a held-out one is redrawn, so held-out prompts are never trained on.
    Training prompts for step s depend only on (seed, s), so any rank can rebuild any step's batch.
    """

    KINDS = typing.get_args(DigitTaskName)
    # Prompt indices key sampling noise as 32-bit values: rounds sit 2**27 apart below 2**32
    # (room for 2**27 prompts per round: steps * prompts_per_step).
    EXTRA_ROUND_OFFSET = 2**27

    def __init__(self, kind: str, tokenizer: CharTokenizer, digits_min: int, digits_max: int, seed: int, num_eval: int):
        if kind not in self.KINDS:
            raise ValueError(f"unknown built-in task {kind!r}; expected one of {', '.join(self.KINDS)}")
        self.kind, self.tokenizer = kind, tokenizer
        self.digits_min, self.digits_max, self.seed = digits_min, digits_max, seed
        eval_rng = random.Random(f"eval-{seed}")
        eval_texts: list[str] = []
        while len(eval_texts) < num_eval:
            text = self._draw(eval_rng)
            if text not in eval_texts:
                eval_texts.append(text)
        self._held_out = set(eval_texts)
        self.eval_prompts = [self._prompt(-(i + 1), text) for i, text in enumerate(eval_texts)]

    @property
    def max_prompt_tokens(self) -> int:
        """Tokens in the longest prompt this task can draw."""
        return len(self.tokenizer.encode("0" * self.digits_max + "="))

    def _draw(self, rng: random.Random) -> str:
        length = rng.randint(self.digits_min, self.digits_max)
        return "".join(rng.choice("0123456789") for _ in range(length))

    def _prompt(self, index: int, digits: str) -> Prompt:
        token_ids = self.tokenizer.encode(digits + "=")
        answer = digits if self.kind == "copy_digits" else digits[::-1]
        return Prompt(index=index, text=digits, answer=answer, token_ids=token_ids)

    def train_prompts(self, step: int, count: int, round_index: int = 0) -> list[Prompt]:
        """The `count` training prompts of RL step `step`, indices step * count + i.

        Round r > 0 (dynamic sampling's extra prompts) draws a fresh set with indices offset by
        EXTRA_ROUND_OFFSET * r, so they never collide with another round's or step's.
        """
        suffix = f"-round{round_index}" if round_index else ""
        rng = random.Random(f"train-{self.seed}-{step}{suffix}")
        prompts = []
        for i in range(count):
            text = self._draw(rng)
            while text in self._held_out:
                text = self._draw(rng)
            prompts.append(self._prompt(round_index * self.EXTRA_ROUND_OFFSET + step * count + i, text))
        return prompts
