"""The default mode's decode attention at small batches: each row's keys split across programs.

`invariant_kernels.slot_attention` runs one program per (row, K/V head), each walking the row's
keys from the first to the last. Where rows × K/V heads are fewer than the device's SMs (the tail
of a generation, when a few long rows are left), most SMs sit idle while those programs walk
(bench/RESULTS.md, "The decode attention split across programs, measured"). Here the keys
of a row are cut into `splits` ranges of whole key blocks, one program each (flash-decoding). Each
program writes its range's softmax state (max, sum, unnormalised output, fp32) to a scratch
buffer, and the last of a row's programs to finish, told by an atomic counter, merges them
and writes the output, so no second kernel is launched.

The output differs from the unsplit kernel's by rounding (the key blocks are summed in another
grouping), so `job.bitwise_logprobs` keeps the unsplit kernel, whose bits equal the trainer's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.invariant_kernels import (
    ATTENTION_BLOCK_M,
    ATTENTION_BLOCK_N,
    ATTENTION_DECODE_STAGES,
    ATTENTION_WARPS,
    _attend_block,
    _precision,
    _slot_keys_block,
    _slot_row,
    _store_new_kv,
    slot_inputs,
)

# Measured on an H100 (RESULTS, "The decode attention split across programs, measured"): once rows ×
# K/V heads reach the SM count, ranges stop paying (256 programs: 0.99× at 2 ranges, less at more);
# below it, SMs sit idle and ranges gain up to 2.3× (8 rows of 1,024 keys). A split launch aims at
# PROGRAMS_PER_SM programs on every SM; past MAX_SPLITS the merge's reads outgrow the gain.
PROGRAMS_PER_SM = 3
MAX_SPLITS = 8


def decode_splits(rows: int, kv_heads: int, slot_len: int, sms: int) -> int:
    """How many programs share a row's keys: 1 where rows × K/V heads reach the device's `sms`
    (invariant_kernels.multiprocessors), else enough for PROGRAMS_PER_SM programs an SM, at most
    MAX_SPLITS and at most one a key block of the slot. Depends on the launch's shape only, so a
    CUDA graph keeps it."""
    programs = max(rows * kv_heads, 1)
    if programs >= sms:
        return 1
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, programs)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(slot_len, ATTENTION_BLOCK_N)))


_counters: dict[torch.device, list[torch.Tensor]] = {}


def _arrivals(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (row, K/V head), kept between calls: the merging program
    sets its counter back to 0, so no launch has to clear them. A launch too large for them gets
    larger ones; the smaller stay allocated, since CUDA graphs captured with them still write there."""
    held = _counters.setdefault(device, [])
    if not held or held[-1].numel() < size:
        held.append(torch.zeros(max(size, 4096), dtype=torch.int32, device=device))
    return held[-1]


@triton.jit
def _split_slot_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, stat_ptr, arrivals_ptr, slots_ptr, lengths_ptr,
                       share_slots_ptr, share_lens_ptr, attended_ptr, new_k_ptr, new_v_ptr, scale,
                       stride_qb, stride_qh, stride_ks, stride_kl, stride_kh, stride_nkb, stride_nkh, stride_nvb,
                       stride_nvh, stride_ob, stride_oh, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                       SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, STORE_NEW: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot, length, share_slot, share_len, attended = _slot_row(slots_ptr, lengths_ptr, share_slots_ptr, share_lens_ptr,
                                                              attended_ptr, row)
    # Whole key blocks per split, so every range starts on a block edge.
    span = tl.maximum(tl.cdiv(tl.cdiv(attended, BLOCK_N), SPLITS), 1) * BLOCK_N
    lo = split * span
    hi = tl.minimum(lo + span, attended)
    g = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    heads = kv_head * G + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < G, other=0.0)
    if STORE_NEW:
        # The program whose range holds the new key's position stores it (the last one when no
        # range does: a finished row attends to fewer keys), so the one reader is the writer.
        if split == tl.minimum((length - 1) // span, SPLITS - 1):
            _store_new_kv(k_ptr, v_ptr, new_k_ptr, new_v_ptr, slot, length, row, kv_head, stride_ks, stride_kl,
                          stride_kh, stride_nkb, stride_nkh, stride_nvb, stride_nvh, D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for key_start in range(lo, hi, BLOCK_N):
        n = key_start + tl.arange(0, BLOCK_N)
        k, v, keys_live = _slot_keys_block(k_ptr, v_ptr, n, hi, slot, share_slot, share_len, kv_head, stride_ks,
                                           stride_kl, stride_kh, D)
        live = tl.broadcast_to(keys_live[None, :], (BLOCK_M, BLOCK_N))
        m, l, acc = _attend_block(q, k, v, live, m, l, acc, scale, PRECISION)
    # Scratch layout: part [B, HKV, SPLITS, G, D] and stat [B, HKV, SPLITS, 2, G] (max, sum).
    pair = row * HKV + kv_head
    own = g < G
    base = pair * SPLITS + split
    tl.store(part_ptr + (base * G + g[:, None]) * D + d[None, :], acc, mask=own[:, None])
    tl.store(stat_ptr + base * 2 * G + g, m, mask=own)
    tl.store(stat_ptr + base * 2 * G + G + g, l, mask=own)
    # Every thread's stores are issued before the counter moves; the atomic's release and
    # acquire order them for the program that reads them.
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr + pair, 1) == SPLITS - 1:
        _merge_splits(part_ptr, stat_ptr, out_ptr, pair, row, heads, g, d, own, stride_ob, stride_oh, G, D, SPLITS,
                      BLOCK_M)
        tl.store(arrivals_ptr + pair, 0)


@triton.jit
def _merge_splits(part_ptr, stat_ptr, out_ptr, pair, row, heads, g, d, own, stride_ob, stride_oh, G: tl.constexpr,
                  D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The row's output from its SPLITS partial states: each rescaled to the largest max."""
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(stat_ptr + (pair * SPLITS + s) * 2 * G + g, mask=own, other=0.0,
                                      cache_modifier=".cg"))
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for s in tl.static_range(SPLITS):
        base = pair * SPLITS + s
        # An empty range's max is -inf: its weight is exactly 0.
        weight = tl.exp(tl.load(stat_ptr + base * 2 * G + g, mask=own, other=0.0, cache_modifier=".cg") - top)
        total += weight * tl.load(stat_ptr + base * 2 * G + G + g, mask=own, other=1.0, cache_modifier=".cg")
        part = tl.load(part_ptr + (base * G + g[:, None]) * D + d[None, :], mask=own[:, None], other=0.0,
                       cache_modifier=".cg")
        acc += weight[:, None] * part
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=own[:, None])


def split_slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                         lengths: torch.Tensor, share_slots: torch.Tensor, share_lens: torch.Tensor,
                         new_k: torch.Tensor | None, new_v: torch.Tensor | None, attended: torch.Tensor,
                         splits: int) -> torch.Tensor:
    """invariant_kernels.slot_attention's contract (q [B, H, D] against k_cache / v_cache
    [S, L, Hkv, D] -> [B, H, D]; share, new_k / new_v and attended as there, all given), each row's
    keys in `splits` ranges of whole key blocks (decode_splits picks it)."""
    q, new_k, new_v, store, out = slot_inputs(q, k_cache, new_k, new_v)
    (B, H, D), Hkv = q.shape, k_cache.shape[2]
    if B == 0:
        return out
    G = H // Hkv
    part = torch.empty((B, Hkv, splits, G, D), dtype=torch.float32, device=q.device)
    stat = torch.empty((B, Hkv, splits, 2, G), dtype=torch.float32, device=q.device)
    _split_slot_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, out, part, stat, _arrivals(q.device, B * Hkv), slots, lengths, share_slots, share_lens,
        attended, new_k, new_v, D**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), out.stride(0), out.stride(1),
        HKV=Hkv, G=G, D=D, SPLITS=splits, BLOCK_M=ATTENTION_BLOCK_M, BLOCK_N=ATTENTION_BLOCK_N,
        PRECISION=_precision(q), STORE_NEW=store, num_warps=ATTENTION_WARPS, num_stages=ATTENTION_DECODE_STAGES,
    )
    return out
