"""The decode step's reads and writes of the per-slot state as two Triton kernels (CUDA; slot_step.py
has the same arithmetic in plain torch, and the contracts).

Why kernels of our own: in plain torch the step's bookkeeping is about 30 gathers, compares and
scatters of a few hundred integers each, every one a kernel of its own inside the decode graph. At
small batches, where a step's matmuls take a few microseconds each, those launches were a few
percent of the step (bench/RESULTS.md). Here each side is one kernel, one lane per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _read_kernel(rows, last_token, position, key, share_slot, share_len, done,
                 token_out, position_out, key_out, next_position_out, lengths_out, share_slots_out, share_lens_out,
                 attended_out, n_rows, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n_rows
    slot = tl.load(rows + i, mask=inside, other=0)
    at = tl.load(position + slot, mask=inside, other=0)
    tl.store(token_out + i, tl.load(last_token + slot, mask=inside, other=0), mask=inside)
    tl.store(position_out + i, at, mask=inside)
    tl.store(key_out + i, tl.load(key + slot, mask=inside, other=0), mask=inside)
    tl.store(next_position_out + i, at + 1, mask=inside)
    tl.store(lengths_out + i, (at + 1).to(tl.int32), mask=inside)
    tl.store(share_slots_out + i, tl.load(share_slot + slot, mask=inside, other=0), mask=inside)
    tl.store(share_lens_out + i, tl.load(share_len + slot, mask=inside, other=0), mask=inside)
    finished = tl.load(done + slot, mask=inside, other=0) != 0
    tl.store(attended_out + i, tl.where(finished, 1, at + 1).to(tl.int32), mask=inside)


@triton.jit
def _advance_kernel(rows, new, logprob, last_token, position, generated, budget, done, eos,
                    out_tokens, out_logprobs, out_stride, eos_ids, n_eos, n_rows, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n_rows
    slot = tl.load(rows + i, mask=inside, other=0)
    # A finished row (padding rows' scratch slot among them) keeps every value it has.
    active = inside & (tl.load(done + slot, mask=inside, other=1) == 0)
    token = tl.load(new + i, mask=active, other=0)
    count = tl.load(generated + slot, mask=active, other=0)
    tl.store(out_tokens + slot * out_stride + count, token, mask=active)
    tl.store(out_logprobs + slot * out_stride + count, tl.load(logprob + i, mask=active, other=0.0), mask=active)
    hit_eos = tl.zeros((BLOCK,), tl.int1)
    for e in range(n_eos):
        hit_eos = hit_eos | (token == tl.load(eos_ids + e))
    count = count + 1
    tl.store(generated + slot, count, mask=active)
    tl.store(eos + slot, (tl.load(eos + slot, mask=active, other=0) != 0) | hit_eos, mask=active)
    tl.store(done + slot, hit_eos | (count >= tl.load(budget + slot, mask=active, other=0)), mask=active)
    tl.store(last_token + slot, token, mask=active)
    tl.store(position + slot, tl.load(position + slot, mask=active, other=0) + 1, mask=active)


def read_slots(cache, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """slot_step.read_slots' values for rows [B] int64, in its order (one kernel)."""
    B = rows.shape[0]
    outs = [torch.empty(B, dtype=torch.int64, device=rows.device) for _ in range(4)]
    lengths, share_lens, attended = (torch.empty(B, dtype=torch.int32, device=rows.device) for _ in range(3))
    share_slots = torch.empty(B, dtype=torch.int64, device=rows.device)
    if B:
        _read_kernel[(triton.cdiv(B, BLOCK),)](
            rows, cache.last_token, cache.position, cache.key, cache.share_slot, cache.share_len, cache.done,
            *outs, lengths, share_slots, share_lens, attended, B, BLOCK=BLOCK,
        )
    return (*outs, lengths, share_slots, share_lens, attended)


def advance_slots(cache, rows: torch.Tensor, new: torch.Tensor, logprob: torch.Tensor, eos_ids: torch.Tensor) -> None:
    """slot_step.advance_slots (one kernel)."""
    B = rows.shape[0]
    if B == 0:
        return
    assert cache.out_tokens.stride() == cache.out_logprobs.stride() and cache.out_tokens.stride(1) == 1
    _advance_kernel[(triton.cdiv(B, BLOCK),)](
        rows, new, logprob, cache.last_token, cache.position, cache.generated, cache.budget, cache.done, cache.eos,
        cache.out_tokens, cache.out_logprobs, cache.out_tokens.stride(0), eos_ids, eos_ids.shape[0], B, BLOCK=BLOCK,
    )
