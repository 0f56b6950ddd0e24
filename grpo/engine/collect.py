"""The host's side of continuous batching: which slots finished (EOS, budget or a stop string),
and their completions, read back from the cache in one transfer per check."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from grpo.engine.cache import SlotCache
from grpo.engine.types import Completion, GenerationRequest, stop_length


def finished_completions(
    cache: SlotCache,
    requests: Sequence[GenerationRequest],
    active: dict[int, int],
    checked: dict[int, int],
    stop_strings: Sequence[str],
    decode_text: Callable[[list[int]], str] | None,
    version: int,
) -> dict[int, Completion]:
    """Completions of the active slots that finished, by slot.

    active: slot -> index into requests; checked: slot -> completion tokens already searched for
    stop strings (advanced here). version: the weights' version the completions carry."""
    if not active:
        return {}
    c = cache
    slots = sorted(active)
    s = torch.tensor(slots, device=c.device)
    state = torch.stack((c.done[s].long(), c.eos[s].long(), c.generated[s])).cpu()
    done, eos, generated = state[0].bool().tolist(), state[1].bool().tolist(), state[2].tolist()
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
