"""What goes into and comes out of an engine (requests, sampling parameters, completions), and the
`Engine` interface both engines satisfy."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.errors import TandemError

# (parameter name, index into it as a tuple of slices, values): one piece of a weight update.
WeightUpdate = tuple[str, tuple[slice, ...], torch.Tensor]


class EngineCapacityError(TandemError, ValueError):
    """A generation setting leaves the engine no room for what it must hold (a KV slot, a sequence,
    a weight row); the message names the setting to raise."""


class GenerationOutOfMemory(TandemError, RuntimeError):
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
    keep_kv: the engine may keep this request's K/V when it finishes, for a later request with the
        same key whose prompt continues this prompt and completion (a conversation's next turn),
        which then prefills only what it appends. An engine without that ability ignores it.
    """

    prompt_tokens: list[int]
    step: int
    prompt_index: int
    sample_index: int
    max_new_tokens: int | None = None
    keep_kv: bool = False


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


class Engine(Protocol):
    """What the run asks of a generation engine (NativeEngine, VLLMEngine).

    `version` is the weight version of the last `update_weights` (-1 before the first); every
    completion carries the version that generated it.
    """

    version: int

    def generate(
        self, requests: Iterable[GenerationRequest], sampling: SamplingParams | None = None,
        on_finished: Callable[[list[Completion]], None] | None = None,
    ) -> list[Completion]:
        """Every request run to completion, in request order; `sampling` defaults to the engine's.
        `on_finished`, if given, is called with completions as they finish (each exactly once,
        before generate returns), so the caller can start on them while the rest decode."""
        ...

    def update_weights(self, buckets: Iterable[Iterable[WeightUpdate]], version: int) -> None:
        """`param[index] = tensor` for each (name, index, tensor) update, bucket by bucket."""
        ...

    def release_cache(self) -> None:
        """Free the KV cache's memory for a colocated trainer; the next generate brings it back."""
        ...

    def outside_bytes(self) -> int:
        """Device memory held outside PyTorch's allocator (counted in the run's peak memory)."""
        ...

    def close(self) -> None:
        """Free what the engine holds; it is not used again."""
        ...
