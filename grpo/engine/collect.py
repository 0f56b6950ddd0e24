"""The host's side of continuous batching: which slots finished (EOS, budget or a stop string),
and their completions, read back from the cache.

A check reads a snapshot of the active slots' state that the stream took after a given decode
step, so the host can read it while later decode steps run: a row finished in the snapshot is not
written again, and a row still going only writes past the tokens the snapshot counts. On CUDA the
reads that follow the snapshot run on the cache's read stream, which waits for the snapshot only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from grpo.engine.cache import SlotCache
from grpo.engine.types import Completion, GenerationRequest, stop_length
from model.attention import to_device


class StateSnapshot:
    """The active slots' done / eos / generated as the stream has them after the work queued before
    the snapshot was made (its decode steps): copied to the host without waiting for later work."""

    def __init__(self, cache: SlotCache, slots: list[int]):
        self.slots = slots
        # Without waiting for the decode steps queued before it (model.attention.to_device).
        self.rows = to_device(torch.tensor(slots, dtype=torch.int64), cache.device)
        state = torch.stack((cache.done[self.rows].long(), cache.eos[self.rows].long(), cache.generated[self.rows]))
        self._ready = None
        if cache.device.type == "cuda":
            self._host = torch.empty(state.shape, dtype=state.dtype, pin_memory=True)
            self._host.copy_(state, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = state

    def read(self) -> tuple[list[bool], list[bool], list[int]]:
        """(done, eos, generated) per slot, waiting for the snapshot only."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host[0].bool().tolist(), self._host[1].bool().tolist(), self._host[2].tolist()

    def reading(self, cache: SlotCache):
        """Context for device reads that must not wait for the decode steps queued after the snapshot."""
        if self._ready is None:
            return nullcontext()
        stream = cache.read_stream
        stream.wait_event(self._ready)
        return torch.cuda.stream(stream)


def finished_completions(
    cache: SlotCache,
    snapshot: StateSnapshot,
    requests: Sequence[GenerationRequest],
    active: dict[int, int],
    checked: dict[int, int],
    stop_strings: Sequence[str],
    decode_text: Callable[[list[int]], str] | None,
    version: int,
) -> dict[int, Completion]:
    """Completions of the snapshot's slots that had finished in it, by slot.

    active: slot -> index into requests (the snapshot's slots are active); checked: slot ->
    completion tokens already searched for stop strings (advanced here). version: the weights'
    version the completions carry."""
    slots, s = snapshot.slots, snapshot.rows
    if not slots:
        return {}
    c = cache
    done, eos, generated = snapshot.read()
    with snapshot.reading(c):
        stops = _stop_lengths(c, s, slots, generated, eos, checked, stop_strings, decode_text) if stop_strings else {}
        ended = [i for i, slot in enumerate(slots) if done[i] or slot in stops]
        if not ended:
            return {}
        rows = s[ended]
        width = max(generated[i] for i in ended)
        out_tokens = c.out_tokens[rows, :width].cpu()
        out_logprobs = c.out_logprobs[rows, :width].cpu()
    finished = {}
    for j, i in enumerate(ended):
        slot = slots[i]
        n = stops.get(slot, generated[i])
        reason = "stop" if slot in stops else "eos" if eos[i] else "length"
        finished[slot] = Completion(
            request=requests[active[slot]],
            tokens=out_tokens[j, :n].tolist(),
            logprobs=out_logprobs[j, :n].tolist(),
            finish_reason=reason,
            version=version,
        )
    return finished


def _stop_lengths(
    cache: SlotCache,
    rows: torch.Tensor,
    slots: list[int],
    generated: list[int],
    eos: list[bool],
    checked: dict[int, int],
    stop_strings: Sequence[str],
    decode_text: Callable[[list[int]], str],
) -> dict[int, int]:
    """Slots whose text reached a stop string -> the completion length that ends at it.

    rows: `slots` as a tensor on the cache's device. Token t is checked once the prefix up to t
    exists; an EOS token ends by EOS instead."""
    tokens = cache.out_tokens[rows, : max(generated)].cpu()
    found = {}
    for i, slot in enumerate(slots):
        last = generated[i] - 1 if eos[i] else generated[i]
        n = stop_length(tokens[i].tolist(), checked[slot], last, stop_strings, decode_text)
        if n is not None:
            found[slot] = n
        checked[slot] = last
    return found
