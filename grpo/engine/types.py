"""What goes into and comes out of an engine: requests, sampling parameters, completions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# (parameter name, index into it as a tuple of slices, values): one piece of a weight update.
WeightUpdate = tuple[str, tuple[slice, ...], torch.Tensor]


class GenerationOutOfMemory(RuntimeError):
    """A single request does not fit in the generator's memory (its prompt plus max_new_tokens)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class GenerationRequest:
    """One completion to produce. (step, prompt_index, sample_index) keys its randomness.

    max_new_tokens: this request's own budget (at most the sampling's); None = the sampling's.
    """

    prompt_tokens: list[int]
    step: int
    prompt_index: int
    sample_index: int
    max_new_tokens: int | None = None


@dataclass
class Completion:
    """A finished request: tokens and per-token log-probs of the completion only.

    finish_reason: "eos" (an EOS id was drawn; it is kept as the last token), "stop" (the decoded
    text reached a stop string) or "length" (max_new_tokens reached).
    """

    request: GenerationRequest
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int


def stop_length(
    tokens: Sequence[int], start: int, end: int, stop_strings: Sequence[str], decode_text: Callable[[list[int]], str]
) -> int | None:
    """The completion length that ends at the first stop string: the smallest n in (start, end]
    whose decoded prefix tokens[:n] contains one (prefixes up to `start` were checked before), or
    None. Every engine ends completions by this rule."""
    for n in range(start + 1, end + 1):
        text = decode_text(list(tokens[:n]))
        if any(stop in text for stop in stop_strings):
            return n
    return None
