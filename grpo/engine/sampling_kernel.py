"""Keyed Gumbel-max sampling as one Triton kernel (CUDA; sampling.py has the formulas and the
reference in plain torch).

Why a kernel of our own: the reference builds the noise as [B, V] int64 tensors (hash, shift,
multiply, mask) and the compiled code still walks a row several times; at batch 256 on a 152k
vocabulary it took 1.5 ms of a 14.5 ms decode step on an H200 (bench/RESULTS.md, "Fourth GPU
session"). Here the logits are read once: each program takes one chunk of one row, hashes in
32-bit integers, and keeps the chunk's best noisy score with its column and the chunk's running
max and sum of exp for the log-normaliser; a few [B, chunks] tensor ops finish the row. Chunks,
not whole rows, per program: with one program per row a batch of 64 left most of the GPU idle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096
BLOCK = 1024


@triton.jit
def _mix32(x):
    """sampling.mix32 on uint32 (the multiplies wrap mod 2**32 as the reference's masks do)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _chunk_kernel(logits, row_stride, row_hash, best_score, best_index, chunk_max, chunk_sum, V, n_chunks,
                  inv_temperature, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = logits + row * row_stride
    h = tl.load(row_hash + row).to(tl.uint32, bitcast=True)
    best = tl.full((), float("-inf"), tl.float32)
    best_col = tl.zeros((), tl.int32)
    running_max = tl.full((), float("-inf"), tl.float32)
    sum_exp = tl.zeros((), tl.float32)
    for start in tl.range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
        bits = _mix32(h ^ _mix32(cols.to(tl.uint32))) >> 8
        uniform = (bits.to(tl.float32) + 0.5) / 16777216.0
        score = tl.where(inside, x - tl.log(-tl.log(uniform)), float("-inf"))
        block_best = tl.max(score, 0)
        # The first column holding the block's best: ties go to the lowest index, as argmax's do.
        block_col = tl.min(tl.where(score == block_best, cols, V), 0)
        better = block_best > best
        best_col = tl.where(better, block_col, best_col)
        best = tl.where(better, block_best, best)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        sum_exp = sum_exp * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
    at = row * n_chunks + chunk
    tl.store(best_score + at, best)
    tl.store(best_index + at, best_col)
    tl.store(chunk_max + at, running_max)
    tl.store(chunk_sum + at, sum_exp)


@torch.library.custom_op("tandem::gumbel_chunks", mutates_args=())
def _gumbel_chunks(logits: torch.Tensor, row_hash: torch.Tensor, temperature: float) -> list[torch.Tensor]:
    """_chunk_kernel over logits [B, V], row_hash [B] int32 -> per (row, chunk) [B, C]: best noisy
    score (fp32), its column (int32), max and sum of exp of logits / temperature (fp32)."""
    B, V = logits.shape
    n_chunks = triton.cdiv(V, CHUNK)
    score, chunk_max, chunk_sum = (torch.empty((B, n_chunks), dtype=torch.float32, device=logits.device) for _ in range(3))
    index = torch.empty((B, n_chunks), dtype=torch.int32, device=logits.device)
    if B:
        _chunk_kernel[(B, n_chunks)](logits, logits.stride(0), row_hash, score, index, chunk_max, chunk_sum, V,
                                     n_chunks, 1.0 / temperature, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    return [score, index, chunk_max, chunk_sum]


@_gumbel_chunks.register_fake
def _(logits, row_hash, temperature):
    shape = (logits.shape[0], triton.cdiv(logits.shape[1], CHUNK))
    fp32 = [logits.new_empty(shape, dtype=torch.float32) for _ in range(3)]
    return [fp32[0], logits.new_empty(shape, dtype=torch.int32), fp32[1], fp32[2]]


def gumbel_sample(logits: torch.Tensor, row_hash: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax(logits / temperature + Gumbel noise(row_hash, token id)) and its log-prob under
    log softmax(logits / temperature): logits [B, V] (row-contiguous, any float dtype), row_hash
    [B] int64 holding 32-bit values -> tokens [B] int64, logprobs [B] fp32.

    The kernel is a custom operator, so that the compiled sampler launches it as one opaque call."""
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    as_int32 = torch.where(row_hash >= 2**31, row_hash - 2**32, row_hash).to(torch.int32)  # the same 32 bits
    score, index, chunk_max, chunk_sum = _gumbel_chunks(logits, as_int32, temperature)
    # argmax takes the first chunk holding the best score: chunks run in column order, so ties still
    # go to the lowest column.
    tokens = index.gather(-1, score.argmax(-1, keepdim=True)).squeeze(-1).long()
    top = chunk_max.max(-1, keepdim=True).values
    log_z = top.squeeze(-1) + torch.log((chunk_sum * torch.exp(chunk_max - top)).sum(-1))
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1).float() * (1.0 / temperature)
    return tokens, picked - log_z
