"""Batch-invariant Triton kernels for CUDA: the matmul, RMSNorm and attention of
`job.bitwise_logprobs` (model/batch_invariant.py says why and what).

A kernel is batch-invariant when each output row is computed by the same instructions in the same
order whatever the other rows are. cuBLAS and flash attention are not: they pick a tiling, and a
split of the reduction across thread blocks, from the shapes they are given. Here:

- matmul: one program per output tile, the whole K loop in order, no split-K. A row's result
  depends only on its own inputs and K (a compile-time constant: a model has a handful of K
  values), not on the tile: a tensor-core instruction sums each element over K in one order
  wherever the element sits, so each shape may take the tile that runs it fastest
  (`matmul_tiles`; bench/invariant_matmul.py and tests/test_bitwise_gpu.py show the bits equal).
- RMSNorm: one program per row, one fixed tile over the row.
- attention: one program per 16-row query tile; rows are query positions of one head (packed
  prefill and training) or the query heads sharing a K/V head (decode). Both run the same
  block step (`_attend_block`) over key blocks of 64 positions from position 0, in order; blocks
  past a row's position add exact zeros. A token's attention output is the same bits whether
  it was prefilled, decoded from the cache, or recomputed in a packed training row.

Only the forward passes are invariant; gradients need not be (model/invariant_ops.py).

The decode kernel (`slot_attention`) is also the engine's decode attention in the default mode,
where the other paths use cuBLAS and flash attention (at batches too small to fill the device,
model/decode_kernel.py splits each row's keys across programs instead). Why a kernel of our own there: on torch 2.11
the flash-attention kernel has no decode entry point (no split-KV, no KV-cache path), and its
forward pass tiles queries in blocks of 128 rows, so a step with one query per sequence computes
64-128 times the useful work and becomes compute-bound (bench/decode_attention.py measures it).
Here one program loads the query heads that share a K/V head as one tile and streams only the
sequence's live keys and values from its slot, once. Rows whose prompts were prefilled together
may read the prompt's keys from another slot holding the same bits (grpo/engine/shares.py says why).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# The matmul's tiles, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), from the largest to the smallest.
MATMUL_TILES = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 3))
GROUP_M = 8  # programs walk output tiles in groups of GROUP_M row tiles (L2 reuse; no effect on values)

ATTENTION_BLOCK_M = 16  # query rows per program (the tensor-core minimum)
ATTENTION_BLOCK_N = 64  # keys per block step
ATTENTION_WARPS = 4
ATTENTION_DECODE_STAGES = 2  # software pipelining of the decode kernel's loads (no effect on values)


def _precision(t: torch.Tensor) -> str:
    """tl.dot's input precision: full fp32 for fp32 inputs (as F.linear without TF32), else native."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


@triton.jit
def _matmul_kernel(a, b, bias, c, M, N, stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                   K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP * tiles_n
    first_m = (pid // group_size) * GROUP
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP)
    tile_m = first_m + (pid % group_size) % rows_in_group
    tile_n = (pid % group_size) // rows_in_group
    rm = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(a + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(b + rn[None, :] * stride_bn + kk[:, None] * stride_bk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's SM count (0 off CUDA), read once per device."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def matmul_tiles(M: int, N: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """The tile of an [M, N] output: the largest of MATMUL_TILES whose programs fill at least half
    of the device's multiprocessors, else the smallest. On an H100, at the projection shapes of two
    models and 64 to 16,384 rows, this took at most 1.2× the fastest of eight tiles' time, and up
    to 2.3× less than the 128 × 128 tile alone at decode's row counts (bench/RESULTS.md)."""
    for tiles in MATMUL_TILES[:-1]:
        if 2 * triton.cdiv(M, tiles[0]) * triton.cdiv(N, tiles[1]) >= multiprocessors(device):
            return tiles
    return MATMUL_TILES[-1]


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
           tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in out_dtype, accumulated in fp32;
    `tiles` (default `matmul_tiles`') changes the speed, not the bits."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return out
    block_m, block_n, block_k, warps, stages = tiles or matmul_tiles(M, N, x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, M, N,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        K=K, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M,
        PRECISION=_precision(x), num_warps=warps, num_stages=stages,
    )
    return out


@triton.jit
def _rms_norm_kernel(x, weight, out, stride_x, stride_out, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    v = tl.load(x + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    # HF's order: mean of squares in fp32, plus eps, rsqrt; normalised, cast back, then scaled.
    inv_rms = 1.0 / tl.sqrt(tl.sum(v * v, 0) / D + eps)
    normed = (v * inv_rms).to(out.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + cols, (w * normed).to(out.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [R, D] (rows contiguous), weight [D] -> [R, D] in x's dtype."""
    R, D = x.shape
    out = torch.empty_like(x)
    if R:
        _rms_norm_kernel[(R,)](x, weight, out, x.stride(0), out.stride(0), D, eps,
                               BLOCK=triton.next_power_of_2(D), num_warps=4)
    return out


@triton.jit
def _attend_block(q, k, v, live, m, l, acc, scale, PRECISION: tl.constexpr):
    """One key block of the online softmax: q [BM, D], k/v [BN, D], live [BM, BN] -> m, l, acc."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(live, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _packed_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens, scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr, WRITE_LSE: tl.constexpr):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_seqlens + seq).to(tl.int64)
    length = tl.load(cu_seqlens + seq + 1) - start
    if q_block * BLOCK_M < length:
        d = tl.arange(0, D)
        pos = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_live = pos < length
        q = tl.load(q_ptr + (start + pos)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=rows_live[:, None], other=0.0)
        kv_head = head // G
        k_base = k_ptr + start * stride_kt + kv_head * stride_kh
        v_base = v_ptr + start * stride_vt + kv_head * stride_vh
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        visible = tl.minimum(length, (q_block + 1) * BLOCK_M)
        for key_start in range(0, visible, BLOCK_N):
            n = key_start + tl.arange(0, BLOCK_N)
            keys_live = n < length
            k = tl.load(k_base + n[:, None] * stride_kt + d[None, :], mask=keys_live[:, None], other=0.0)
            v = tl.load(v_base + n[:, None] * stride_vt + d[None, :], mask=keys_live[:, None], other=0.0)
            m, l, acc = _attend_block(q, k, v, n[None, :] <= pos[:, None], m, l, acc, scale, PRECISION)
        out = acc / l[:, None]
        tl.store(out_ptr + (start + pos)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows_live[:, None])
        if WRITE_LSE:
            # Natural log of the softmax's denominator over the scaled scores: flash attention's
            # own log-sum-exp, which its backward takes in place of a recomputed forward.
            tl.store(lse_ptr + head * stride_lh + start + pos, m + tl.log(l), mask=rows_live)


@triton.jit
def _slot_row(slots_ptr, lengths_ptr, share_slots_ptr, share_lens_ptr, attended_ptr, row):
    """A decode row's slot, live keys, shared-prompt slot and length, and keys attended."""
    return (tl.load(slots_ptr + row).to(tl.int64), tl.load(lengths_ptr + row),
            tl.load(share_slots_ptr + row).to(tl.int64), tl.load(share_lens_ptr + row), tl.load(attended_ptr + row))


@triton.jit
def _store_new_kv(k_ptr, v_ptr, new_k_ptr, new_v_ptr, slot, length, row, kv_head, stride_ks, stride_kl, stride_kh,
                  stride_nkb, stride_nkh, stride_nvb, stride_nvh, D: tl.constexpr):
    """The row's new key and value of one K/V head into its slot at position length - 1, then a
    barrier, so that every thread of the program reads them back."""
    d = tl.arange(0, D)
    at = slot * stride_ks + (length - 1).to(tl.int64) * stride_kl + kv_head * stride_kh + d
    tl.store(k_ptr + at, tl.load(new_k_ptr + row * stride_nkb + kv_head * stride_nkh + d))
    tl.store(v_ptr + at, tl.load(new_v_ptr + row * stride_nvb + kv_head * stride_nvh + d))
    tl.debug_barrier()


@triton.jit
def _slot_keys_block(k_ptr, v_ptr, n, end, slot, share_slot, share_len, kv_head, stride_ks, stride_kl, stride_kh,
                     D: tl.constexpr):
    """Keys and values [BN, D] of one K/V head at positions n [BN] of a row's slot (0 at and past
    `end`), and which are live."""
    keys_live = n < end
    # Keys below share_len hold the same bits in share_slot as in this row's slot: rows that share a
    # prompt read one copy of it, which the programs running side by side find in L2.
    source = tl.where(n < share_len, share_slot, slot)
    offsets = source[:, None] * stride_ks + n[:, None] * stride_kl + kv_head * stride_kh + tl.arange(0, D)[None, :]
    k = tl.load(k_ptr + offsets, mask=keys_live[:, None], other=0.0)
    v = tl.load(v_ptr + offsets, mask=keys_live[:, None], other=0.0)
    return k, v, keys_live


@triton.jit
def _slot_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, lengths_ptr, share_slots_ptr, share_lens_ptr,
                 attended_ptr, new_k_ptr, new_v_ptr, scale,
                 stride_qb, stride_qh, stride_ks, stride_kl, stride_kh, stride_nkb, stride_nkh, stride_nvb,
                 stride_nvh, stride_ob, stride_oh, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, STORE_NEW: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot, length, share_slot, share_len, attended = _slot_row(slots_ptr, lengths_ptr, share_slots_ptr, share_lens_ptr,
                                                              attended_ptr, row)
    g = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    heads = kv_head * G + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < G, other=0.0)
    if STORE_NEW:
        # The row's own key and value go into its slot here rather than by two copy kernels per
        # layer; the barrier makes them visible to every thread of the program before the loop
        # reads them back with the rest of the slot, so the values attended are the same bits.
        _store_new_kv(k_ptr, v_ptr, new_k_ptr, new_v_ptr, slot, length, row, kv_head, stride_ks, stride_kl, stride_kh,
                      stride_nkb, stride_nkh, stride_nvb, stride_nvh, D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # The loop runs from key 0 to a runtime end, the same loop for every row: a first key other
    # than 0 made the kernel 6-18% slower for all rows on an H200.
    for key_start in range(0, attended, BLOCK_N):
        n = key_start + tl.arange(0, BLOCK_N)
        k, v, keys_live = _slot_keys_block(k_ptr, v_ptr, n, attended, slot, share_slot, share_len, kv_head, stride_ks,
                                           stride_kl, stride_kh, D)
        live = tl.broadcast_to(keys_live[None, :], (BLOCK_M, BLOCK_N))  # every head row sees the same keys
        m, l, acc = _attend_block(q, k, v, live, m, l, acc, scale, PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g[:, None] < G)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_len: int, with_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, D], k/v [N, Hkv, D] (last dim contiguous), sequence s spanning
    cu_seqlens[s]:cu_seqlens[s + 1] (int32 [S + 1], on the device) -> [N, H, D], causal within
    each sequence; with_lse: also each query's log-sum-exp of its scaled scores, fp32 [H, N]
    (flash attention's varlen layout)."""
    N, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((H, N), dtype=torch.float32, device=q.device) if with_lse else out
    S = cu_seqlens.shape[0] - 1
    if N > 0 and S > 0:
        grid = (triton.cdiv(max_len, ATTENTION_BLOCK_M), S, H)
        _packed_kernel[grid](
            q, k, v, out, lse, cu_seqlens, D**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            lse.stride(0), G=H // k.shape[1], D=D, BLOCK_M=ATTENTION_BLOCK_M, BLOCK_N=ATTENTION_BLOCK_N,
            PRECISION=_precision(q), WRITE_LSE=with_lse, num_warps=ATTENTION_WARPS,
        )
    return (out, lse) if with_lse else out


def slot_attention_unsupported(n_heads: int, n_kv_heads: int, head_dim: int) -> str | None:
    """Why `slot_attention` cannot serve this attention shape, or None when it can."""
    if n_heads // n_kv_heads > ATTENTION_BLOCK_M:
        return f"{n_heads // n_kv_heads} query heads per KV head (at most {ATTENTION_BLOCK_M})"
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (a power of two is needed)"
    return None


def slot_inputs(q: torch.Tensor, k_cache: torch.Tensor, new_k: torch.Tensor | None,
                new_v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, torch.Tensor]:
    """The decode kernels' inputs, checked: (q, new_k, new_v, whether the new keys are stored, an
    empty output like q), each input with its head dimension contiguous (new_k / new_v are q, not
    read, where none are given)."""
    problem = slot_attention_unsupported(q.shape[1], k_cache.shape[2], q.shape[2])
    if problem:
        raise ValueError(f"the decode attention kernel does not support {problem}")
    # Rows and heads are read at their strides, so a view needs no copy: only the head dimension
    # must be contiguous. New K and V are each read in their own layout (V is a column block of the
    # fused projection's output): a copy into one shared layout would cost a kernel per layer.
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if new_k is None:
        return q, q, q, False, out
    new_k = new_k if new_k.stride(-1) == 1 else new_k.contiguous()
    new_v = new_v if new_v.stride(-1) == 1 else new_v.contiguous()
    return q, new_k, new_v, True, out


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   lengths: torch.Tensor, share_slots: torch.Tensor | None = None,
                   share_lens: torch.Tensor | None = None, new_k: torch.Tensor | None = None,
                   new_v: torch.Tensor | None = None, attended: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] against k_cache / v_cache [S, L, Hkv, D]: row b's query sits at position
    lengths[b] - 1 of slot slots[b] and attends to its first lengths[b] keys -> [B, H, D].

    share_slots [B] int64 / share_lens [B] int32 (optional, together): row b reads its first
    share_lens[b] keys from slot share_slots[b], which must hold the same values there.
    new_k / new_v [B, Hkv, D] (optional, together): row b's own key and value, stored at position
    lengths[b] - 1 of its slot before it attends (rows of distinct slots: padding rows that share
    a scratch slot may leave any of their values there).
    attended [B] int32 (optional): row b attends only to its first attended[b] (<= lengths[b]) keys
    (default lengths)."""
    if share_slots is None:
        share_slots, share_lens = slots, lengths
    if attended is None:
        attended = lengths
    q, new_k, new_v, store, out = slot_inputs(q, k_cache, new_k, new_v)
    (B, H, D), Hkv = q.shape, k_cache.shape[2]
    if B == 0:
        return out
    _slot_kernel[(B, Hkv)](
        q, k_cache, v_cache, out, slots, lengths, share_slots, share_lens, attended, new_k, new_v, D**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), out.stride(0), out.stride(1),
        G=H // Hkv, D=D, BLOCK_M=ATTENTION_BLOCK_M, BLOCK_N=ATTENTION_BLOCK_N,
        PRECISION=_precision(q), STORE_NEW=store, num_warps=ATTENTION_WARPS, num_stages=ATTENTION_DECODE_STAGES,
    )
    return out


def _in_order_interpreter_dot() -> None:
    """Give the interpreter's fp32 `tl.dot` the tensor core's property that these kernels rest on.

    Under Triton's interpreter `tl.dot` is numpy's matmul, and the BLAS kernel that numpy picks for
    the CPU at hand may sum an element in an order that depends on the element's row within the
    tile (OpenBLAS's Haswell kernels do, on AMD EPYC). A tensor core sums every element over K in
    one order wherever it sits (tests/test_bitwise_gpu.py checks that on the hardware). Here the
    products are added to the accumulator one K step at a time, so the interpreted kernels are
    checked for their own logic (tiling, masks, block order) whatever BLAS the CPU runs."""
    import numpy as np
    from triton.runtime import interpreter

    blas_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.copy()
        for k in range(a.data.shape[-1]):
            acc += a.data[..., :, k, None] * b.data[..., None, k, :]
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _patch_the_language_once_per_launch() -> None:
    """Interpreted, a launch patches the `triton.language` modules its kernel sees with numpy
    implementations, and every call of a `@triton.jit` helper inside it (ours, `_attend_block`,
    once per key block; Triton's, `tl.zeros`, `tl.sum`, in every program) patched the modules its
    own module sees again, through `inspect.getmembers`: a third of the interpreted time. Patches
    made inside a launch stay until it ends, so here each module's names are patched once per
    launch; what the patches do is unchanged."""
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__
    patch_language = interpreter._patch_lang
    patched: list[set[int]] = []  # the globals already patched, while a launch runs

    def launch_grid(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch_once(fn):
        if patched and id(fn.__globals__) in patched[-1]:
            return None  # a helper's call: the caller drops the scope and restores nothing
        if patched:
            patched[-1].add(id(fn.__globals__))
        return patch_language(fn)

    interpreter.GridExecutor.__call__ = launch_grid
    interpreter._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _in_order_interpreter_dot()
    _patch_the_language_once_per_launch()
