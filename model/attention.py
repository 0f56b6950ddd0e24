"""The attention kernels behind the model's two paths, chosen per device and dtype.

- `packed_attention`: training and scoring over rows holding several sequences (document mask).
- `varlen_prefill`: causal attention over prompts packed into one token axis, each prompt alone.
- `slot_decode`: one query per sequence against its KV-cache slot, reading only the slot's live
  keys (the first `lengths[b]` positions).

On CUDA in bf16/fp16, prefill runs PyTorch's flash-attention kernel in its variable-length form
(`cu_seqlens`, no mask) and decode runs our Triton kernel (decode_kernel.py), which reads exactly
the live keys once per KV head. Elsewhere (CPU, fp32) both run `scaled_dot_product_attention` with
an explicit mask: the reference path the tests use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_mask(doc_ids: torch.Tensor | None) -> torch.Tensor | None:
    """bool [B, 1, T, T]: causal attention within equal doc_ids [B, T]; None (plain causal) for None."""
    if doc_ids is None:
        return None
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, T, H, D]; mask from `document_mask` (None: causal)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def uses_flash(t: torch.Tensor) -> bool:
    """Whether the fast kernels serve tensors like t (CUDA, half precision)."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def check_decode_kernel(n_heads: int, n_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before any work, an attention shape the CUDA decode kernel cannot serve."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return
    from model.decode_kernel import unsupported

    reason = unsupported(n_heads, n_kv_heads, head_dim)
    if reason is not None:
        raise ValueError(f"generator: the CUDA decode kernel does not support {reason}; use model.dtype = \"float32\"")


def _flash(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False)[0]


def varlen_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D] of prompts packed back to back -> [N, H, D].

    cu_seqlens [P + 1] int32: prompt p spans tokens cu_seqlens[p]:cu_seqlens[p + 1]; attention is
    causal within each prompt. max_len: the longest prompt.
    """
    if uses_flash(q):
        return _flash(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, True)
    N = q.shape[0]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths.long(), output_size=N)
    return packed_attention(q[None], k[None], v[None], document_mask(doc[None]))[0]


def slot_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """q [B, H, D] (one query per row) against cache slots -> [B, H, D].

    k_cache / v_cache [S, L, Hkv, D]: slot s holds its sequence's keys at positions 0..L-1.
    slots [B] int64: each row's slot; lengths [B] int32: the live keys of each row (its query's
    position + 1). Rows may sit in any slot at any length.
    """
    if uses_flash(q):
        # Imported here: Triton exists only where CUDA does.
        from model.decode_kernel import slot_decode_triton

        return slot_decode_triton(q, k_cache, v_cache, slots, lengths)
    L, Hkv = k_cache.shape[1], k_cache.shape[2]
    keys, values = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    live = (torch.arange(L, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None], keys, values, attn_mask=live, enable_gqa=q.shape[1] != Hkv
    )
    return out[:, :, 0]
