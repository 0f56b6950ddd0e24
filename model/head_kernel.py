"""The log-prob head's two per-chunk passes as Triton kernels (CUDA only; logprob_head.py has the
reference in plain torch and the formulas).

Why kernels of our own: a chunk's logits are [tokens, V] with V ~150k, and the generic fused
reduction a compiler emits for logsumexp + target + entropy walks each row several times (measured
at ~180 GB/s on an H200, 7 ms per 4096-token chunk). Here one program reads its row once with an
online softmax (running max, sum of exp and sum of exp * logit), and the gradient is one pass that
reads the logits and writes their gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _stats_kernel(logits, row_stride, targets, out_logprob, out_entropy, out_log_z, V, inv_temperature,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    running_max = tl.full((), float("-inf"), tl.float32)
    sum_exp = tl.zeros((), tl.float32)
    sum_exp_x = tl.zeros((), tl.float32)
    for start in tl.range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
        new_max = tl.maximum(running_max, tl.max(x, 0))
        rescale = tl.exp(running_max - new_max)
        e = tl.exp(x - new_max)
        sum_exp = sum_exp * rescale + tl.sum(e, 0)
        sum_exp_x = sum_exp_x * rescale + tl.sum(tl.where(inside, e * x, 0.0), 0)
        running_max = new_max
    log_z = running_max + tl.log(sum_exp)
    target = tl.load(targets + row)
    target_x = tl.load(base + target).to(tl.float32) * inv_temperature
    tl.store(out_logprob + row, target_x - log_z)
    tl.store(out_entropy + row, log_z - sum_exp_x / sum_exp)
    tl.store(out_log_z + row, log_z)


@triton.jit
def _grad_kernel(logits, row_stride, targets, log_z, entropy, grad_logprob, grad_entropy, out, V,
                 inv_temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(logits + row * row_stride + cols, mask=inside, other=0.0).to(tl.float32) * inv_temperature
    log_p = x - tl.load(log_z + row)
    p = tl.exp(log_p)
    g_lp = tl.load(grad_logprob + row)
    g_ent = tl.load(grad_entropy + row)
    grad = -p * (g_lp + g_ent * (log_p + tl.load(entropy + row)))
    grad = tl.where(cols == tl.load(targets + row), grad + g_lp, grad)
    tl.store(out + row * row_stride + cols, (grad * inv_temperature).to(out.dtype.element_ty), mask=inside)


@torch.library.custom_op("tandem::token_logprob_stats", mutates_args=())
def _token_logprob_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """_stats_kernel over logits [N, V] -> [3, N] fp32 (log-prob, entropy, log Z)."""
    N, V = logits.shape
    out = torch.empty((3, N), dtype=torch.float32, device=logits.device)
    _stats_kernel[(N,)](logits, logits.stride(0), targets, out[0], out[1], out[2], V, 1.0 / temperature,
                        BLOCK=BLOCK_V, num_warps=8)
    return out


@_token_logprob_stats.register_fake
def _(logits, targets, temperature):
    return logits.new_empty((3, logits.shape[0]), dtype=torch.float32)


def chunk_stats_triton(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """As logprob_head.chunk_stats: logits [N, V] (row-contiguous), targets [N] -> three [N] fp32.

    A custom operator, so that a compiled caller (the engine's sampler) launches the kernel as
    Triton's own launcher does, with the scalar in fp32, like an eager caller (the trainer's head)."""
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    out = _token_logprob_stats(logits, targets, temperature)
    return out[0], out[1], out[2]


def chunk_grad_triton(logits, targets, log_z, entropy, grad_logprob, grad_entropy, temperature: float,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """As logprob_head.chunk_grad: the gradient [N, V] w.r.t. logits, in out_dtype (default logits')."""
    N, V = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    out = torch.empty_like(logits, dtype=out_dtype or logits.dtype)
    grid = (N, triton.cdiv(V, BLOCK_V))
    _grad_kernel[grid](logits, logits.stride(0), targets, log_z, entropy, grad_logprob.contiguous(),
                       grad_entropy.contiguous(), out, V, 1.0 / temperature, BLOCK=BLOCK_V, num_warps=8)
    return out
