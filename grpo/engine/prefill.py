"""Prefill: run a request's prompt through the model into its cache slot, and return the logits
its first token is drawn from. Two ways: a whole prompt (packed with others, each distinct prompt
computed once for every slot that shares it), or only the tokens a request appends to what its
slot already holds (the next turn of a conversation whose K/V the engine kept)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo.engine.cache import SlotCache
from grpo.engine.types import GenerationRequest
from model import Transformer
from model.attention import concat_ranges, to_device


@torch.no_grad()
def prefill_prompts(
    model: Transformer, cache: SlotCache, requests: Sequence[GenerationRequest], slots: Sequence[int], share_prefix: bool
) -> torch.Tensor:
    """Whole prompts into their slots -> the logits of each request's last prompt token [R, V].

    With share_prefix, requests with equal prompts are computed once and their K/V written to each
    of their slots."""
    L = cache.max_len
    prompt_of: dict[tuple[int, ...], int] = {}
    prompts: list[list[int]] = []
    owner = []  # per request: index of its prompt in `prompts`
    for r in requests:
        key = tuple(r.prompt_tokens) if share_prefix else (len(prompts),)
        if key not in prompt_of:
            prompt_of[key] = len(prompts)
            prompts.append(r.prompt_tokens)
        owner.append(prompt_of[key])
    lengths = torch.tensor([len(p) for p in prompts])
    starts = torch.cumsum(lengths, 0) - lengths
    cu = torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0))).to(torch.int32)
    # In a few vectorised ops: one arange per request cost the host ~10 ms for a step's 512.
    owner_t = torch.tensor(owner)
    positions = concat_ranges(torch.zeros_like(lengths), lengths)
    source = concat_ranges(starts[owner_t], lengths[owner_t])
    target = concat_ranges(torch.tensor(list(slots)) * L, lengths[owner_t])
    dev = cache.device
    attend = cache.prefill_attention(to_device(source, dev), to_device(target, dev), to_device(cu, dev),
                                     int(lengths.max()))
    tokens = to_device(torch.tensor([t for p in prompts for t in p], dtype=torch.int64), dev)
    logits = model.decode(tokens, to_device(positions, dev), attend, logits_index=to_device(starts + lengths - 1, dev))
    return logits[to_device(owner_t, dev)]


@torch.no_grad()
def prefill_appended(
    model: Transformer, cache: SlotCache, requests: Sequence[GenerationRequest], slots: Sequence[int],
    cached: Sequence[int],
) -> torch.Tensor:
    """Only what each request appends: slot slots[i] holds valid K/V for the first cached[i] tokens
    of requests[i].prompt_tokens; the rest are computed at their positions, attending to the slot's
    keys up to each one's own (SlotCache.append_attention). -> the logits of each request's last
    prompt token [R, V]."""
    appended = [len(r.prompt_tokens) - n for r, n in zip(requests, cached)]
    tokens = [t for r, n in zip(requests, cached) for t in r.prompt_tokens[n:]]
    positions = concat_ranges(torch.tensor(list(cached)), torch.tensor(appended))
    last = torch.tensor(appended).cumsum(0) - 1
    dev = cache.device
    attend = cache.append_attention(list(slots), list(cached), appended)
    tokens_t = to_device(torch.tensor(tokens, dtype=torch.int64), dev)
    return model.decode(tokens_t, to_device(positions, dev), attend, logits_index=to_device(last, dev))
