"""SwiGLU's elementwise half, silu(gate) * up, as one Triton kernel for the engine (CUDA).

Why a kernel of our own: at inference w1 and w3 are one matrix (FeedForward.fuse_projections), so
gate and up are the two halves of each row of one [N, 2F] product. The compiled code read them as
two strided views at a quarter of the memory bound (0.73 ms per 8B decode step at batch 256
against 0.19 ms for vLLM's kernel, bench/RESULTS.md "Fourth GPU session"); here each program
reads one block of a row's gate and the matching block of its up, contiguously.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x, row_stride, out, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < F
    gate = tl.load(x + row * row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x + row * row_stride + F + cols, mask=inside, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out + row * F + cols, y.to(out.dtype.element_ty), mask=inside)


@torch.library.custom_op("tandem::silu_mul", mutates_args=())
def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    """_silu_mul_kernel over x [N, 2F] (row-contiguous) -> [N, F] in x's dtype."""
    N, F = x.shape[0], x.shape[1] // 2
    out = torch.empty((N, F), dtype=x.dtype, device=x.device)
    if N:
        _silu_mul_kernel[(N, triton.cdiv(F, BLOCK))](x, x.stride(0), out, F, BLOCK=BLOCK, num_warps=4)
    return out


@_silu_mul.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [..., 2F] = [gate | up] -> [..., F], computed in fp32 and rounded once.
    A custom operator, so that a compiled block launches it as one opaque call."""
    lead, width = x.shape[:-1], x.shape[-1]
    return _silu_mul(x.reshape(-1, width).contiguous()).reshape(*lead, width // 2)
