"""The host's two scheduling decisions in continuous batching: which waiting requests a refill
round admits (split into prefill calls), and how many decode steps run before the host looks again."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from grpo.engine.types import GenerationRequest


def admission_round(
    waiting: deque[int], requests: Sequence[GenerationRequest], room: int, prefill_tokens: int, share_prefix: bool
) -> list[list[int]]:
    """Take up to `room` requests from the front of `waiting` (indices into `requests`) as prefill
    calls of at most prefill_tokens computed tokens each (a single longer prompt still gets its own
    call). With share_prefix a call computes each distinct prompt once, so a prompt already in the
    call adds no tokens: the 8 samples of a prompt cost what one does."""
    calls: list[list[int]] = []
    admit: list[int] = []
    tokens, prompts = 0, set()
    while waiting and room > 0:
        prompt = tuple(requests[waiting[0]].prompt_tokens)
        length = 0 if share_prefix and prompt in prompts else len(prompt)
        if admit and tokens + length > prefill_tokens:
            calls.append(admit)
            admit, tokens, prompts = [], 0, set()
            length = len(prompt)
        admit.append(waiting.popleft())
        tokens += length
        prompts.add(prompt)
        room -= 1
    if admit:
        calls.append(admit)
    return calls


def steps_to_check(remaining: dict[int, int], free: int, round_size: int, sync_every: int) -> int:
    """Decode steps before the host next looks: at most sync_every, and no more than it takes for
    budgets alone to free the slots of the next admission round (round_size requests wait, `free`
    slots are free already) or, with nothing waiting, to finish every active sequence
    (`remaining`: slot -> decode steps until its budget ends). Stepping past either point would
    only run finished rows."""
    ends = sorted(remaining.values())
    if not ends:
        return sync_every
    needed = round_size - free
    until = ends[needed - 1] if 0 < needed <= len(ends) else ends[-1]
    return max(1, min(sync_every, until))
