"""Keyed Gumbel-max sampling as one Triton kernel (CUDA; sampling.py has the formulas and the
reference in plain torch).

Why a kernel of our own: the reference builds the noise as [B, V] int64 tensors (hash, shift,
multiply, mask) and the compiled code still walks a row several times; at batch 256 on a 152k
vocabulary it took 1.5 ms of a 14.5 ms decode step on an H200 (bench/RESULTS.md, "Fourth GPU
session"). Here one program reads its row of logits once, hashes in 32-bit integers, and keeps
the running best score and its index: the same draw as the reference, in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _mix32(x):
    """sampling.mix32 on uint32 (the multiplies wrap mod 2**32 as the reference's masks do)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _gumbel_argmax_kernel(logits, row_stride, row_hash, out_tokens, V, inv_temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    h = tl.load(row_hash + row).to(tl.uint32, bitcast=True)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.zeros((), tl.int32)
    for start in tl.range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
        bits = _mix32(h ^ _mix32(cols.to(tl.uint32))) >> 8
        uniform = (bits.to(tl.float32) + 0.5) / 16777216.0
        score = tl.where(inside, x - tl.log(-tl.log(uniform)), float("-inf"))
        block_best = tl.max(score, 0)
        # The first column holding the block's best: ties go to the lowest index, as argmax's do.
        block_index = tl.min(tl.where(score == block_best, cols, V), 0)
        better = block_best > best
        best_index = tl.where(better, block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_tokens + row, best_index.to(tl.int64))


@torch.library.custom_op("tandem::gumbel_argmax", mutates_args=())
def _gumbel_argmax(logits: torch.Tensor, row_hash: torch.Tensor, temperature: float) -> torch.Tensor:
    """_gumbel_argmax_kernel over logits [B, V] and row_hash [B] int32 -> tokens [B] int64."""
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(B,)](logits, logits.stride(0), row_hash, tokens, V, 1.0 / temperature,
                                BLOCK=BLOCK_V, num_warps=8)
    return tokens


@_gumbel_argmax.register_fake
def _(logits, row_hash, temperature):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def gumbel_argmax(logits: torch.Tensor, row_hash: torch.Tensor, temperature: float) -> torch.Tensor:
    """argmax(logits / temperature + Gumbel noise(row_hash, token id)): logits [B, V] (row-contiguous,
    any float dtype), row_hash [B] int64 holding 32-bit values -> tokens [B] int64.

    A custom operator, so that the compiled sampler launches it as one opaque call."""
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    as_int32 = torch.where(row_hash >= 2**31, row_hash - 2**32, row_hash).to(torch.int32)  # the same 32 bits
    return _gumbel_argmax(logits, as_int32, temperature)
