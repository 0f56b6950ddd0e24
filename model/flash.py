"""aten's FlashAttention 2 variable-length ops, for attention over sequences packed back to back
on one token axis (CUDA, bf16/fp16): sequence s's queries are q[cu_q[s]:cu_q[s + 1]], its keys
k[cu_k[s]:cu_k[s + 1]], and causal attention aligns its queries with its last keys.

Straight on PyTorch's aten flash ops, the kernels `torch.nn.attention.varlen.varlen_attn` runs:
its output and K/V gradients are the same bits (the query gradient's atomic sums vary from run to
run with either). That function goes through a Python custom op, and the trainer calls it once per
layer per micro-batch: on one H200, a forward and backward at 16k tokens cost the host 487 µs here
against 802 µs (bench/RESULTS.md). It needs no probing of which keywords the installed release's
`varlen_attn` takes.
"""

from __future__ import annotations

import torch


def fast_kernels_serve(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the CUDA kernels (flash attention, our decode kernel) serve this device and dtype."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def uses_flash(t: torch.Tensor) -> bool:
    """Whether the fast kernels serve tensors like t."""
    return fast_kernels_serve(t.device, t.dtype)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Nq, H, D], k/v [Nk, Hkv, D] (grouped K/V heads served) -> out [Nq, H, D] and each query's
    log-sum-exp over the keys it attends, [H, Nq] fp32 (no dropout)."""
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False)
    return out, lse


def backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `forward` from its output and log-sum-exp [H, Nq].

    out and lse may be those of a larger softmax whose keys were split over several calls: each
    call's backward then gives its exact share of the gradients. A query whose lse is +inf takes
    no part (its attention weights are exp(s - inf) = 0)."""
    # Without dropout flash reads no random state: empty placeholders stand for it.
    no_rng = torch.empty((), dtype=torch.int64)
    return torch.ops.aten._flash_attention_backward(
        grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, no_rng, no_rng
    )


class FlashVarlen(torch.autograd.Function):
    """Causal flash attention within each sequence of a packed axis, with its backward:
    q [N, H, D], k/v [N, Hkv, D] -> [N, H, D]."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
        out, lse = forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, True)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, True)
        return dq, dk, dv, None, None
