"""What decoding reads from the per-slot state (SlotCache) and writes back to it: a prefilled
request's first token starts its slot's state; each decode step reads the model's and the
sampler's inputs, and records each row's drawn token and whether it finished. On CUDA the decode
step's two sides are one Triton kernel each (slot_kernels.py); elsewhere the plain torch below,
which is also the reference the kernels are checked against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def start_slots(
    cache, slots: torch.Tensor, first: torch.Tensor, logprob: torch.Tensor, positions: torch.Tensor,
    keys: torch.Tensor, budgets: torch.Tensor, eos_ids: torch.Tensor,
) -> None:
    """The decode state of freshly prefilled slots [R] (int64), all [R]: the first token (drawn from
    the prefill's logits) and its log-prob, the position it takes (the prompt's length), the noise
    key and the token budget; the slot is finished when that token is EOS or the budget is 1."""
    c = cache
    hit_eos = torch.isin(first, eos_ids)
    c.last_token[slots], c.position[slots], c.key[slots], c.budget[slots] = first, positions, keys, budgets
    c.generated.index_fill_(0, slots, 1)  # an index_put of a Python number copies it from the host: a sync
    c.out_tokens[slots, 0], c.out_logprobs[slots, 0] = first, logprob
    c.eos[slots], c.done[slots] = hit_eos, hit_eos | (budgets <= 1)


class SlotReads(NamedTuple):
    """The decode inputs of a batch's rows, each [B]: the token to feed and its position (int64),
    the noise key (int64), the position the drawn token will take (int64), the live keys after this
    step (int32, = position + 1), the slot and length of the shared prompt K/V the row reads
    (int64, int32; see SlotCache.share_slot), and the keys the row attends to, its slot's first
    `attended` (int32): the live keys, or for a row whose slot is finished one key. A finished row
    stays in its decode graph until the host's next check, and nothing reads its output; attending
    to its whole slot would read the slot's K/V for nothing, up to two check intervals per
    finished row."""

    token: torch.Tensor
    position: torch.Tensor
    key: torch.Tensor
    next_position: torch.Tensor
    lengths: torch.Tensor
    share_slots: torch.Tensor
    share_lens: torch.Tensor
    attended: torch.Tensor


def read_slots(cache, rows: torch.Tensor) -> SlotReads:
    """The decode inputs of rows [B] (slot ids, int64) of `cache` (a SlotCache)."""
    if rows.is_cuda:
        from grpo.engine import slot_kernels  # Triton exists only where CUDA does

        return SlotReads(*slot_kernels.read_slots(cache, rows))
    position = cache.position[rows]
    lengths = (position + 1).to(torch.int32)
    attended = torch.where(cache.done[rows], torch.ones_like(lengths), lengths)
    return SlotReads(
        cache.last_token[rows], position, cache.key[rows], position + 1, lengths,
        cache.share_slot[rows], cache.share_len[rows], attended,
    )


def advance_slots(cache, rows: torch.Tensor, new: torch.Tensor, logprob: torch.Tensor, eos_ids: torch.Tensor) -> None:
    """Record one drawn token per row: rows [B] (slot ids), new [B] int64, logprob [B] fp32.

    A row whose slot is unfinished stores the token and its log-prob at its next completion index,
    feeds the token next, moves one position on, and finishes on a token of eos_ids [E] int64 (eos
    set) or at its budget. A finished row's slot (padding rows' scratch slot among them) keeps every
    value it has. Rows of unfinished slots must be distinct."""
    if rows.is_cuda:
        from grpo.engine import slot_kernels

        slot_kernels.advance_slots(cache, rows, new, logprob, eos_ids)
        return
    c = cache
    active = ~c.done[rows]
    count = c.generated[rows]
    at = (rows, count)
    c.out_tokens.index_put_(at, torch.where(active, new, c.out_tokens[at]))
    c.out_logprobs.index_put_(at, torch.where(active, logprob, c.out_logprobs[at]))
    hit_eos = active & torch.isin(new, eos_ids)
    count = count + active
    c.generated[rows] = count
    c.eos[rows] = c.eos[rows] | hit_eos
    c.done[rows] = c.done[rows] | hit_eos | (count >= c.budget[rows])
    c.last_token[rows] = torch.where(active, new, c.last_token[rows])
    c.position[rows] = c.position[rows] + active
