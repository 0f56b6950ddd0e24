"""Model FLOPs per token and per-device peak FLOP/s, for model FLOPs utilisation (MFU).

Conventions (as in the PaLM paper's MFU): a training token costs forward + backward = 3 × the
forward's matmul FLOPs, with a multiply-add counted as 2 FLOPs. Counted: every weight matmul (q, k,
v, o projections, the three SwiGLU matrices, the LM head, tied or not) and the attention score and
value products. Not counted: norms, RoPE, softmax, biases, the embedding lookup, and recomputation
(activation checkpointing, π_old or reference forwards): MFU measures useful model work, so extra
passes lower it rather than count as work.
"""

from __future__ import annotations

import torch

from model.args import ModelArgs

# Dense (no structured sparsity) peak FLOP/s per device from NVIDIA's datasheets, matched in order
# against torch.cuda.get_device_name (so "H100 PCIe" is tried before the SXM "H100", and "H200"
# also matches "GH200", the same GPU). Columns: bf16/fp16 tensor core, tf32 tensor core, fp32.
_PEAKS: tuple[tuple[str, str, float, float, float], ...] = (
    ("H200", "H200", 989.4e12, 494.7e12, 66.9e12),
    ("H100 PCIe", "H100 PCIe", 756.5e12, 378.0e12, 51.0e12),
    ("H100 NVL", "H100 NVL", 835.5e12, 417.5e12, 60.0e12),
    ("H100", "H100 SXM", 989.4e12, 494.7e12, 66.9e12),
    ("A100", "A100", 312.0e12, 156.0e12, 19.5e12),
    ("L40S", "L40S", 362.05e12, 183.0e12, 91.6e12),
)


def matmul_params(args: ModelArgs) -> int:
    """Weights that take part in a matmul per token: the attention and SwiGLU projections of every
    layer (GQA's k/v projections are n_kv_heads wide) and the LM head (counted even when tied to the
    embedding: the lookup is free, the head's matmul is not)."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    ffn = 3 * args.dim * args.ffn_dim
    return args.n_layers * (attention + ffn) + args.vocab_size * args.dim


def flops_per_token(args: ModelArgs, seq_len: float, head_share: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per token: 6 × matmul_params + 6 · n_layers · n_heads ·
    head_dim · seq_len, the LM head's share weighted by head_share (the fraction of tokens it runs
    on: the trainer skips tokens that carry no loss).

    The attention term: per layer and token the forward computes q·k and p·v against the keys it
    attends to, 2 · 2 · n_heads · head_dim FLOPs per key; causally a token of a length-L sequence
    attends to L/2 keys on average; × 3 for training. `seq_len` is that L; for packed sequences of
    different lengths L_i pass Σ L_i² / Σ L_i (their token-weighted mean length), which makes the
    per-token figure exact for the batch.
    """
    attention = 6 * args.n_layers * args.n_heads * args.head_dim * seq_len
    head = args.vocab_size * args.dim
    return 6.0 * (matmul_params(args) - head + head_share * head) + attention


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0) -> tuple[float, str] | None:
    """(peak dense FLOP/s of one device for matmuls in `dtype`, a label saying what it is), or None
    where unknown (the CPU, an unlisted GPU, a dtype without a figure). `override_tflops` > 0
    (metrics.peak_tflops) wins over the table. float32 matmuls count at the tf32 rate when torch
    lets them use tf32 (torch.get_float32_matmul_precision() != "highest")."""
    if override_tflops > 0:
        return override_tflops * 1e12, f"metrics.peak_tflops = {override_tflops:g}"
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, label, half, tf32, fp32 in _PEAKS:
        if pattern not in name:
            continue
        if dtype in (torch.bfloat16, torch.float16):
            kind, peak = ("bf16" if dtype == torch.bfloat16 else "fp16"), half
        elif dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
            kind, peak = "tf32", tf32
        elif dtype == torch.float32:
            kind, peak = "fp32", fp32
        else:
            return None
        return peak, f"{label} {kind} dense peak {peak / 1e12:g} TFLOP/s"
    return None


def batch_mfu(
    seq_lens: torch.Tensor, computed: float, head_tokens: float, seconds: float, args: ModelArgs, peak: float
) -> float:
    """MFU of one device that trained `computed` tokens of the sequences seq_lens [N] in `seconds`,
    the output head on `head_tokens` of them; the attention term at their token-weighted mean length."""
    lengths = seq_lens.double()
    seq_len = float((lengths * lengths).sum() / lengths.sum()) if float(lengths.sum()) > 0 else 0.0
    return mfu(computed, seconds, args, seq_len, peak, 1, min(head_tokens / max(computed, 1.0), 1.0))


def mfu(
    tokens: float, seconds: float, args: ModelArgs, seq_len: float, peak: float, ranks: int, head_share: float = 1.0
) -> float:
    """Model FLOPs utilisation: the fraction of `ranks` devices' `peak` FLOP/s (each) that training
    on `tokens` tokens in `seconds` amounts to, by flops_per_token(args, seq_len, head_share)."""
    return tokens * flops_per_token(args, seq_len, head_share) / (max(seconds, 1e-9) * peak * ranks)
