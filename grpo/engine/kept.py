"""Conversations' K/V kept in their cache slots between turns.

A request with `keep_kv` leaves its slot's K/V behind when it finishes, filed under its key
(step, prompt index, sample index). The conversation's next turn is a request with the same key
whose prompt is the previous prompt, the completion and what the environment appended; it takes
the slot back and prefills only the appended tokens (prefill.py prefill_appended). A slot holds
valid K/V for the previous prompt and completion except the completion's last token, which no
decode step fed back.

What is kept is stale after a weight update, a cache release or reallocation (`clear`), and a
poll drops every kept slot that none of its requests continues. Kept slots are the first taken
back when the engine runs out of free ones; their conversations then prefill in full.
"""

from __future__ import annotations

from collections.abc import Iterable

from grpo.engine.types import GenerationRequest

Key = tuple[int, int, int]


def request_key(request: GenerationRequest) -> Key:
    return (request.step, request.prompt_index, request.sample_index)


class KeptKV:
    """slot and tokens of each finished keep_kv request, until its next turn takes them back."""

    def __init__(self) -> None:
        self._kept: dict[Key, tuple[int, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def slots(self) -> set[int]:
        return {slot for slot, _ in self._kept.values()}

    def keep(self, request: GenerationRequest, slot: int, completion: list[int]) -> None:
        """File slot's K/V under the request's key: it holds request's prompt + completion[:-1]."""
        self._kept[request_key(request)] = (slot, list(request.prompt_tokens) + list(completion))

    def claim(self, requests: Iterable[GenerationRequest]) -> dict[Key, tuple[int, int]]:
        """Take the kept slots these requests continue -> key: (slot, tokens with valid K/V); every
        other kept slot is dropped (its conversation ended or is prefilled afresh)."""
        claimed = {}
        for r in requests:
            key = request_key(r)
            if not r.keep_kv or key not in self._kept:
                continue
            slot, held = self._kept.pop(key)
            valid = len(held) - 1
            if len(r.prompt_tokens) > valid and r.prompt_tokens[:valid] == held[:valid]:
                claimed[key] = (slot, valid)
        self._kept.clear()
        return claimed

    def evict(self) -> int | None:
        """Give up the oldest kept slot (for a request that needs one), or None if none is kept."""
        if not self._kept:
            return None
        key = next(iter(self._kept))
        return self._kept.pop(key)[0]

    def clear(self) -> None:
        self._kept.clear()


def take_slot(
    request: GenerationRequest, free: list[int], kept: KeptKV, resume: dict[Key, tuple[int, int]]
) -> tuple[int, int]:
    """The slot an admitted request takes, and how many of its prompt tokens it holds K/V for: its
    claimed slot (`resume`, from KeptKV.claim), else the first of `free`, else a kept slot given up
    (the oldest finished conversation's, then a waiting request's claimed one, which will then
    prefill in full). Takes the slot out of free, kept or resume."""
    resumed = resume.pop(request_key(request), None)
    if resumed is not None:
        return resumed
    if free:
        return free.pop(0), 0
    slot = kept.evict()
    if slot is None:
        slot = resume.pop(next(reversed(resume)))[0]
    return slot, 0
