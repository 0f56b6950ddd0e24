"""Which slot's copy of a shared prompt each decoding sequence reads.

Requests with equal prompts prefilled in one call receive the same prompt K/V, bit for bit, in
each of their slots (prefill.py). Decode attention then reads the prompt part of every sequence of
such a group from one slot, the group's reader slot (SlotCache.share_slot / share_len): the
attention programs of a group's rows run side by side and find that copy in L2, instead of each
streaming its own copy from device memory. A group of 8 samples per prompt reads its prompt once
where it read it 8 times. The values read are the same bits either way, so outputs do not change.

The reader slot must keep those values while others read it. A slot's K/V are overwritten only
when a new request is admitted into it, after the sequence that held it has left the batch; so
when a sequence leaves, the rest of its group moves to another live member's slot first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from grpo.engine.cache import SlotCache
from model.attention import to_device


class PrefixShares:
    """The host's record of the groups whose rows read one slot's prompt K/V, kept in step with
    the cache's per-slot `share_slot` / `share_len` tensors (read by the captured decode steps)."""

    def __init__(self, cache: SlotCache):
        self.cache = cache
        # slot -> the live slots of its group, one list object shared by the whole group
        self._groups: dict[int, list[int]] = {}

    def reset(self) -> None:
        """Every slot reads only its own K/V."""
        self._groups.clear()
        self.cache.share_slot.copy_(torch.arange(self.cache.share_slot.numel(), device=self.cache.device))
        self.cache.share_len.zero_()

    def prefilled(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], shared: bool) -> None:
        """`slots` were just prefilled in one call with `prompts` (one per slot); with `shared`,
        equal prompts got their K/V from one computation and form a group."""
        # Keyed by the prompt itself when shared; a group of more than one then shares len(key) tokens.
        members: dict[tuple[int, ...], list[int]] = {}
        for i, (slot, prompt) in enumerate(zip(slots, prompts)):
            members.setdefault(tuple(prompt) if shared else (i,), []).append(slot)
        changed, readers, lengths = [], [], []
        for key, group in members.items():
            group.sort()
            for slot in group:
                self._groups[slot] = group
            changed += group
            readers += [group[0]] * len(group)
            lengths += [len(key) if len(group) > 1 else 0] * len(group)
        self._write(changed, readers, lengths)

    def appended(self, slots: Iterable[int]) -> None:
        """`slots` hold K/V of their own earlier turn, computed for no one else."""
        slots = list(slots)
        for slot in slots:
            self._groups[slot] = [slot]
        self._write(slots, slots, [0] * len(slots))

    def leave(self, slots: Iterable[int]) -> None:
        """`slots` left the batch: their groups' other members read from a slot still live."""
        moved: dict[int, list[int]] = {}
        for slot in slots:
            group = self._groups.pop(slot, None)
            if group is None:
                continue
            was_reader = group[0] == slot
            group.remove(slot)
            if was_reader and group:
                moved[id(group)] = group
        if moved:
            changed = [s for group in moved.values() for s in group]
            readers = [group[0] for group in moved.values() for _ in group]
            self._write(changed, readers, None)

    def _write(self, slots: list[int], readers: list[int], lengths: list[int] | None) -> None:
        """share_slot[slots] = readers (and share_len[slots] = lengths) on the device, queued behind
        the work already on the stream without waiting for it: a group moves while the next decode
        steps are queued (overlapped checks), and a copy from pageable memory would wait for them."""
        if not slots:
            return
        device = self.cache.device
        index = to_device(torch.tensor(slots), device)
        self.cache.share_slot[index] = to_device(torch.tensor(readers, dtype=torch.int64), device)
        if lengths is not None:
            self.cache.share_len[index] = to_device(torch.tensor(lengths, dtype=torch.int32), device)
