"""The shared-prefix attention's merge (model/shared_prefix.py) as one Triton kernel (CUDA).

Two attention calls over the same queries, each with its outputs o_own, o_prefix [N, H, D] and
log-sum-exps l_own, l_prefix [H, N] (fp32), become one softmax over both calls' keys:

    l = logaddexp(l_own, l_prefix),  w = exp(l_prefix - l),  out = o_own + w (o_prefix - o_own)

where l_prefix counts as -inf for a token that continues no prefix, so that w = 0 and out is
o_own's bits. Why a kernel of our own: in plain torch this is six kernels, and the lerp, whose
weight broadcasts over D, runs unvectorised at about half the memory bound (106 µs a call at 15k
tokens on an H100, 21 ms of the RL step's training phase: bench/RESULTS.md, "The training phase
kernel by kernel; the shared-prefix merge in one kernel; ..."). Here each program reads its rows
of both outputs once and keeps the weight in fp32 rather than rounding it to the outputs' dtype
first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows (a token's head) per program: 32 rows of D = 128 are 8 KB of bf16 per output.
BLOCK_ROWS = 32


# N changes with every micro-batch: one compiled kernel for all of them.
@triton.jit(do_not_specialize=["N"])
def _merge_kernel(own, prefix, own_lse, prefix_lse, continues, out, lse, N, H, D,
                  BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    inside = rows < N * H
    token, head = rows // H, rows % H
    a = tl.load(own_lse + head * N + token, mask=inside, other=0.0)
    b = tl.load(prefix_lse + head * N + token, mask=inside, other=0.0)
    b = tl.where(tl.load(continues + token, mask=inside, other=0) != 0, b, float("-inf"))
    # torch.logaddexp's cases: two equal infinities give themselves, anything else max + log(1 + e^-|a - b|).
    both_inf = (a == b) & (tl.abs(a) == float("inf"))
    merged = tl.where(both_inf, a, tl.maximum(a, b) + tl.log(1.0 + tl.exp(-tl.abs(a - b))))
    share = tl.where(b == float("-inf"), 0.0, tl.exp(b - merged))
    tl.store(lse + head * N + token, merged, mask=inside)
    cols = tl.arange(0, BLOCK_D)
    where = rows[:, None] * D + cols[None, :]
    keep = inside[:, None] & (cols[None, :] < D)
    x = tl.load(own + where, mask=keep, other=0.0).to(tl.float32)
    y = tl.load(prefix + where, mask=keep, other=0.0).to(tl.float32)
    tl.store(out + where, (x + share[:, None] * (y - x)).to(out.dtype.element_ty), mask=keep)


def merge(
    own_out: torch.Tensor, own_lse: torch.Tensor, prefix_out: torch.Tensor, prefix_lse: torch.Tensor,
    continues: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """own_out, prefix_out [N, H, D]; own_lse, prefix_lse [H, N] fp32; continues [N] bool ->
    the merged out [N, H, D] (own_out's dtype) and log-sum-exp [H, N] fp32."""
    N, H, D = own_out.shape
    own_out, prefix_out = own_out.contiguous(), prefix_out.contiguous()
    own_lse, prefix_lse = own_lse.contiguous(), prefix_lse.contiguous()
    out = torch.empty_like(own_out)
    lse = torch.empty_like(own_lse)  # the kernel writes [H, N] row-major, as it reads own_lse
    if N:
        grid = (triton.cdiv(N * H, BLOCK_ROWS),)
        _merge_kernel[grid](own_out, prefix_out, own_lse, prefix_lse, continues, out, lse,
                            N, H, D, BLOCK_ROWS=BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out, lse
