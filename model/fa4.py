"""FlashAttention 4 for the trainer's packed causal attention (`model.train_attention = "fa4"`).

FA4 (the `flash-attn-4` package: FlashAttention's CuTe DSL kernels, compiled on first use) has a
varlen forward and backward written for Hopper and Blackwell. Where it serves, it replaces aten's
FlashAttention 2 kernels in `model.attention.packed_attention`: the training forward and backward
and the trainer's frozen passes. The engine's prefill and decode keep their own kernels.
"""

from __future__ import annotations

import os

import torch

_varlen_func = None


def _import_interface():
    """FA4's interface module, its compiled kernels kept on disk between runs: the first training
    step compiles about a dozen of them (17 s more in the realistic step's first step on an H200),
    and later runs load them. FA4 reads the switch when its cache module is first imported;
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0 in the environment turns it off."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    import flash_attn.cute.interface

    return flash_attn.cute.interface


def fa4_problem(device_type: str) -> str | None:
    """Why FA4 cannot serve the trainer on this machine, or None where it can."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"needs a GPU of compute capability 9.0 or newer (Hopper, Blackwell); this one is {major}.{minor}"
    try:
        _import_interface()
    except ImportError as exc:
        return f"needs the flash-attn-4 package (pip install flash-attn-4), which does not import here: {exc}"
    return None


def packed_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Causal attention within each sequence of a packed axis, with autograd: q [N, H, D],
    k/v [N, Hkv, D] (grouped K/V heads read as they are) -> [N, H, D]. cu_seqlens [S + 1] int32
    bounds the sequences; max_len is the longest."""
    global _varlen_func
    if _varlen_func is None:
        _varlen_func = _import_interface().flash_attn_varlen_func
    out, _lse = _varlen_func(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len, max_seqlen_k=max_len,
        causal=True,
    )
    return out
