"""Batch-invariant numerics: each token's result computed by the same operations in the same order,
whatever else is in its batch (`job.bitwise_logprobs`).

The engine and the trainer see a token in different company: one decode row among a few, a prompt
prefilled with others, one position of a packed training row. Kernels pick their tiling, their
split of a reduction and their vector/scalar boundaries from the shapes they are given, so the
same token's log-prob comes out a few ulps apart (or, in bf16, a few hundredths of a nat). With
the mode on, the engine's log-probs equal the trainer's recomputation bitwise, two ways:

- On CUDA, the operations whose reductions would vary run as batch-invariant Triton kernels
  (model/invariant_kernels.py): every matmul, RMSNorm, attention for prefill, decode and
  training alike, and the log-softmax (model/head_kernel.py, already one program per row). The
  logits come out of the head's matmul in fp32. Elementwise work stays compiled; Inductor rounds
  where eager PyTorch would (`emulate_precision_casts`), so a fused kernel and an unfused one agree.
  With TRITON_INTERPRET=1 the same kernels run on the CPU through Triton's interpreter (slow;
  the tests check the kernels' logic that way where no GPU is).
- Elsewhere (the CPU), the reference: every token-wise computation (the block halves around
  attention, the RoPE tables, the final norm, the output head and its log-softmax) runs on fixed
  blocks of `BLOCK` tokens, padded, so each call has one shape; attention runs over fixed blocks
  of `BLOCK` keys in a fixed order, with per-block partial results added up in order; blocks that
  lie wholly past a query add exact zeros. Slow (many small calls), and meant for tests.

The mode is process-wide, like `torch.use_deterministic_algorithms`: `enable(True)` before
building engines and trainers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

BLOCK = 32

_state = {"on": False, "ops": None, "interpret": False, "casts": None, "fp32_logits": True}


def enable(on: bool = True) -> None:
    """Turn batch-invariant numerics on or off for this process."""
    _state["on"] = bool(on)
    _state["interpret"] = bool(on) and os.environ.get("TRITON_INTERPRET") == "1"
    if on and (torch.cuda.is_available() or _state["interpret"]):
        import torch._inductor.config as inductor_config

        from model import invariant_ops  # imported only here: Triton exists only where CUDA does

        _state["ops"] = invariant_ops
        if _state["casts"] is None:  # Inductor's own setting, given back when the mode goes off
            _state["casts"] = inductor_config.emulate_precision_casts
        inductor_config.emulate_precision_casts = True
    elif not on and _state["casts"] is not None:
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = _state["casts"]
        _state["casts"] = None


def enabled() -> bool:
    return _state["on"]


def describe(device: torch.device) -> str:
    """Which implementation serves work on `device`, in words (the run's start-up line)."""
    if not enabled():
        return "off"
    if device.type == "cuda":
        return "invariant Triton kernels"
    if _state["interpret"]:
        return "invariant Triton kernels under Triton's interpreter (TRITON_INTERPRET=1)"
    return "the fixed-block reference (CPU)"


def uses_kernels(t: torch.Tensor) -> bool:
    """Whether the mode is on and t's work runs on the invariant kernels: on CUDA, or anywhere
    under Triton's interpreter."""
    return _state["on"] and (t.is_cuda or _state["interpret"])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on the invariant matmul where `uses_kernels(x)`."""
    if uses_kernels(x):
        return _state["ops"].invariant_linear(x, weight, bias, False)
    return F.linear(x, weight, bias)


def project(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x), its hooks included, or the invariant matmul where `uses_kernels(x)` (on the
    merged weight of a LoRA layer, model/lora.py, as its forward would)."""
    if uses_kernels(x):
        weight = layer.merged_weight() if hasattr(layer, "merged_weight") else layer.weight
        return _state["ops"].invariant_linear(x, weight, layer.bias, False)
    return layer(x)


def output_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The output head x [..., dim] @ weight [V, dim].T -> [..., V]: in x's dtype, or in fp32 from
    the invariant matmul where `uses_kernels(x)` (the log-softmax reads them in fp32 anyway)."""
    if uses_kernels(x):
        return _state["ops"].invariant_linear(x, weight, None, True)
    return F.linear(x, weight)


def set_fp32_logits(on: bool) -> None:
    """Whether the log-prob head and the engine take fp32 logits from the head's bf16 matmul on
    CUDA (`model.fp32_logits`), in every mode."""
    _state["fp32_logits"] = bool(on)


def head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The logits the log-prob head and the engine read, outside autograd: x [N, dim] @ weight [V, dim].T
    -> [N, V]. In fp32 from the invariant matmul where `uses_kernels(x)`; in fp32 from cuBLAS
    (bf16 products accumulated in fp32 and written out without the bf16 rounding) for a CUDA
    bf16/fp16 x while fp32 logits are on; otherwise as `output_logits`."""
    if uses_kernels(x):
        return _state["ops"].invariant_linear(x, weight, None, True)
    if _state["fp32_logits"] and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The invariant RMSNorm kernel (call where `uses_kernels(x)`)."""
    return _state["ops"].invariant_rms_norm(x, weight, eps)


def kernel_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, grads: Callable | None = None) -> torch.Tensor:
    """Invariant attention over packed sequences (invariant_kernels.packed_attention); with
    `grads` (invariant_ops.PackedAttention's backward), gradients flow through it."""
    if grads is None or not torch.is_grad_enabled():
        return _state["ops"].kernels.packed_attention(q, k, v, cu_seqlens, max_len)
    return _state["ops"].PackedAttention.apply(q, k, v, cu_seqlens, max_len, grads)


def kernel_slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          lengths: torch.Tensor, share_slots: torch.Tensor, share_lens: torch.Tensor,
                          new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None,
                          attended: torch.Tensor | None = None) -> torch.Tensor:
    """Invariant single-query attention against cache slots (invariant_kernels.slot_attention)."""
    return _state["ops"].kernels.slot_attention(q, k_cache, v_cache, slots, lengths, share_slots, share_lens,
                                                new_k, new_v, attended)


def in_blocks(fn: Callable[..., torch.Tensor | tuple], *tokens: torch.Tensor, rows: int = 1) -> torch.Tensor | tuple:
    """fn applied to `tokens` (each [N, ...], the same N) in blocks of BLOCK rows, the last one
    padded with zeros; each block is shaped [BLOCK, ...] (rows 1) or [1, BLOCK, ...] (rows 2), and
    fn's outputs, shaped the same way, are concatenated back to [N, ...]. fn must treat rows
    independently."""
    n = tokens[0].shape[0]
    padded = -(-max(n, 1) // BLOCK) * BLOCK
    tokens = tuple(torch.cat([t, t.new_zeros(padded - n, *t.shape[1:])]) if padded > n else t for t in tokens)

    def call(start: int):
        out = fn(*(t[start : start + BLOCK] if rows == 1 else t[start : start + BLOCK][None] for t in tokens))
        if rows == 1:
            return out
        return tuple(o[0] for o in out) if isinstance(out, tuple) else out[0]

    outs = [call(start) for start in range(0, padded, BLOCK)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat([o[i] for o in outs])[:n] for i in range(len(outs[0])))
    return torch.cat(outs)[:n]


def tokenwise(fn: Callable[..., torch.Tensor | tuple], *tokens: torch.Tensor, lead: int = 2) -> torch.Tensor | tuple:
    """fn(*tokens) for a row-wise fn over tensors whose first `lead` dims index tokens ([B, T, ...]
    for lead 2); where the reference serves (the mode on, no kernels), run through `in_blocks` over
    the flattened tokens. Output shapes are the same either way."""
    if not enabled() or uses_kernels(tokens[0]):  # the kernels themselves are invariant
        return fn(*tokens)
    shape = tokens[0].shape[:lead]
    flat = in_blocks(fn, *(t.reshape(-1, *t.shape[lead:]) for t in tokens), rows=lead)
    if isinstance(flat, tuple):
        return tuple(t.view(*shape, *t.shape[1:]) for t in flat)
    return flat.view(*shape, *flat.shape[1:])


def causal_attention(q: torch.Tensor, first_position: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Queries of one sequence against its keys: q [Nq, H, D] at positions first_position ..
    first_position + Nq - 1, k/v [L, Hkv, D] at positions 0 .. L - 1 -> [Nq, H, D]; each query
    attends to the keys at or before its own position.

    Per query the arithmetic does not depend on Nq, L or the query's place among the others:
    scores and weighted values come from fixed [BLOCK x BLOCK] block products, key blocks are
    visited in order, and blocks past a query's position contribute exact zeros.
    """
    n_q, H, D = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    key_blocks = -(-L // BLOCK)
    keys = F.pad(k, (0, 0, 0, 0, 0, key_blocks * BLOCK - L)).repeat_interleave(H // Hkv, dim=1)
    values = F.pad(v, (0, 0, 0, 0, 0, key_blocks * BLOCK - L)).repeat_interleave(H // Hkv, dim=1)
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [H, blocks * BLOCK, D]
    key_positions = torch.arange(key_blocks * BLOCK, device=q.device)
    scale = 1.0 / math.sqrt(D)
    outs = []
    for start in range(0, n_q, BLOCK):
        rows = min(BLOCK, n_q - start)
        positions = first_position + start + torch.arange(BLOCK, device=q.device)
        # Padding rows take the last real row's position: every key they see is real, so no NaN.
        positions = torch.minimum(positions, torch.tensor(first_position + n_q - 1, device=q.device))
        block_q = F.pad(q[start : start + rows], (0, 0, 0, 0, 0, BLOCK - rows)).transpose(0, 1) * scale
        visited = min(key_blocks, (first_position + start + rows - 1) // BLOCK + 1)
        scores = []
        for b in range(visited):
            s = torch.matmul(block_q, keys[:, b * BLOCK : (b + 1) * BLOCK].transpose(1, 2))  # [H, BLOCK, BLOCK]
            live = key_positions[b * BLOCK : (b + 1) * BLOCK][None, :] <= positions[:, None]
            live &= key_positions[b * BLOCK : (b + 1) * BLOCK][None, :] < L
            scores.append(s.masked_fill(~live, float("-inf")))
        top = scores[0].amax(-1)
        for s in scores[1:]:
            top = torch.maximum(top, s.amax(-1))
        total = torch.zeros_like(top)
        acc = torch.zeros_like(block_q)
        for b, s in enumerate(scores):
            weights = torch.exp(s - top[..., None])
            total = total + weights.sum(-1)
            acc = acc + torch.matmul(weights, values[:, b * BLOCK : (b + 1) * BLOCK])
        outs.append((acc / total[..., None]).transpose(0, 1)[:rows])
    return torch.cat(outs)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Sequences back to back: q [N, H, D], k/v [N, Hkv, D], sequence s spanning bounds[s]:bounds[s + 1]
    -> [N, H, D], each sequence causal by itself (training, scoring and prefill)."""
    return torch.cat([causal_attention(q[a:b], 0, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])


def slot_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                   attended: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row against its own keys and values [B, L, Hkv, D] (gathered from the cache
    by model.attention.slot_decode): row b's query sits at position lengths[b] - 1 and attends to
    its first lengths[b] keys, or with attended [B] its first attended[b] (<= lengths[b])."""
    counts = (lengths if attended is None else attended).tolist()
    rows = []
    for b, (count, length) in enumerate(zip(counts, lengths.tolist())):
        rows.append(causal_attention(q[b : b + 1], length - 1, keys[b, :count], values[b, :count]))
    return torch.cat(rows)
