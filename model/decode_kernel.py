"""Single-query attention against KV-cache slots, as one Triton kernel (CUDA only).

Why a kernel of our own: on torch 2.11 the flash-attention kernel has no decode entry point (no
split-KV, no kvcache path), and its forward pass tiles queries in blocks of 128 rows, so a step
with one query per sequence computes 64-128 times the useful work and becomes compute-bound
(bench/decode_attention.py measures it). Here one program handles one (sequence, KV head): it
loads the G query heads that share that KV head as a 16-row tile, streams only the sequence's
live keys and values from its slot once, and keeps an online softmax in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys per inner iteration; query heads are padded to a 16-row tile (the tensor-core minimum).
BLOCK_N = 64
BLOCK_G = 16


@triton.jit
def _slot_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, lengths_ptr, scale,
    stride_qb, stride_qh, stride_ks, stride_kl, stride_kh, stride_ob, stride_oh,
    G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    length = tl.load(lengths_ptr + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kv_head * G + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < G, other=0.0)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_ks + kv_head * stride_kh
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        live = n < length
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(v_base + n[:, None] * stride_kl + d[None, :], mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g[:, None] < G)


def unsupported(n_heads: int, n_kv_heads: int, head_dim: int) -> str | None:
    """Why the kernel cannot serve this attention shape, or None when it can."""
    if n_heads // n_kv_heads > BLOCK_G:
        return f"{n_heads // n_kv_heads} query heads per KV head (at most {BLOCK_G})"
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (a power of two is needed)"
    return None


def slot_decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """q [B, H, D] against k_cache / v_cache [S, L, Hkv, D]: row b reads the first lengths[b]
    positions of slot slots[b]. -> [B, H, D] in q's dtype."""
    B, H, D = q.shape
    Hkv = k_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    _slot_decode_kernel[(B, Hkv)](
        q, k_cache, v_cache, out, slots, lengths, D**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        G=H // Hkv, D=D, BLOCK_N=BLOCK_N, BLOCK_G=BLOCK_G, num_warps=4, num_stages=2,
    )
    return out
