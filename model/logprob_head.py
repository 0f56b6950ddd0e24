"""The log-prob head: log softmax(hidden @ weight.T / T)[target] and the entropy of that
distribution, per token, holding no more of the `[N, V]` logits than a budget allows.

Tokens go through in chunks. Forward keeps, per token, the log-normaliser and the entropy (plus
its inputs), and, while they fit in `keep_budget` bytes, the chunks' logits themselves; backward
takes each chunk's logits from there or recomputes them with one matmul, and turns them into
their gradient in one elementwise pass, from the closed forms (s = logits / T, p = softmax(s)):

    d logprob / d s_j = 1[j = target] - p_j
    d entropy / d s_j = -p_j (log p_j + entropy)

so neither pass runs the softmax twice, and no autograd graph over `[chunk, V]` tensors exists.
On CUDA in bf16/fp16 the two per-chunk passes run as Triton kernels (head_kernel.py), each one
read of the chunk's logits; elsewhere the plain tensor code below, which they must equal. With
batch-invariant numerics on, the logits come from the invariant matmul in fp32 on CUDA
(model/batch_invariant.py), and on the CPU the chunks are its fixed blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import batch_invariant
from model.attention import fast_kernels_serve

# Tokens per chunk: bounds the [chunk, V] logits (and their gradient) computed at once.
LOGPROB_CHUNK_TOKENS = 4096
# The forward's logits a backward may keep instead of recomputing them (saving a quarter of the
# head's matmul FLOPs): a share of the device's memory on CUDA, a fixed amount on the CPU.
KEEP_LOGITS_SHARE = 0.1
KEEP_LOGITS_CPU_BYTES = 1 << 30


def keep_budget(device: torch.device) -> int:
    """Bytes of a differentiable call's logits its backward may keep on `device`."""
    if device.type == "cuda":
        return int(KEEP_LOGITS_SHARE * torch.cuda.get_device_properties(device).total_memory)
    return KEEP_LOGITS_CPU_BYTES


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """logits in fp32, or in their own dtype when it is wider."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def chunk_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """logits [N, V], targets [N] -> target log-probs, entropies, log-normalisers [N], fp32."""
    scaled = _wide(logits) / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    target = scaled.gather(-1, targets[:, None]).squeeze(-1) - log_z
    entropy = log_z - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return target, entropy, log_z


def chunk_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The gradient [N, V] (in out_dtype, default logits' dtype) of the loss w.r.t. logits [N, V],
    given its gradients w.r.t. the chunk's target log-probs and entropies [N]."""
    log_p = _wide(logits) / temperature - log_z[:, None]
    p = log_p.exp()
    grad = -p * (grad_logprob[:, None] + grad_entropy[:, None] * (log_p + entropy[:, None]))
    is_target = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
    grad = torch.where(is_target, grad + grad_logprob[:, None], grad)
    return (grad / temperature).to(out_dtype or logits.dtype)


def _kernels(logits_like: torch.Tensor):
    """The (stats, grad) pair serving tensors like logits_like."""
    if batch_invariant.uses_kernels(logits_like) or fast_kernels_serve(logits_like.device, logits_like.dtype):
        # Imported here: Triton exists only where CUDA does.
        from model.head_kernel import chunk_grad_triton, chunk_stats_triton

        return chunk_stats_triton, chunk_grad_triton
    return chunk_stats, chunk_grad


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A chunk's logits [N, V], in the dtype batch_invariant.head_logits gives them."""
    return batch_invariant.head_logits(hidden, weight)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, keep_bytes: int):
        stats, _ = _kernels(hidden)
        starts = range(0, hidden.shape[0], LOGPROB_CHUNK_TOKENS)
        # Per chunk: its logits, kept for the backward, or None (recomputed there).
        ctx.kept = [None] * len(starts)
        if batch_invariant.enabled() and not batch_invariant.uses_kernels(hidden):
            # Blocks of one shape, as the engine computes its log-probs (grpo/engine/sampling.py).
            logprob, entropy, log_z = batch_invariant.in_blocks(
                lambda h, t: stats(F.linear(h, weight), t, temperature), hidden, targets
            )
        else:
            parts = []
            for i, start in enumerate(starts):
                logits = _logits(hidden[start : start + LOGPROB_CHUNK_TOKENS], weight)
                parts.append(stats(logits, targets[start : start + LOGPROB_CHUNK_TOKENS], temperature))
                size = logits.numel() * logits.element_size()
                if size <= keep_bytes:
                    ctx.kept[i], keep_bytes = logits, keep_bytes - size
            logprob, entropy, log_z = (torch.cat(column) for column in zip(*parts))
        ctx.save_for_backward(hidden, weight, targets, log_z, entropy)
        ctx.temperature = temperature
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        _, grad_of_logits = _kernels(hidden)
        grad_logprob = torch.zeros_like(log_z) if grad_logprob is None else grad_logprob.to(log_z.dtype)
        grad_entropy = torch.zeros_like(log_z) if grad_entropy is None else grad_entropy.to(log_z.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        wide = torch.promote_types(weight.dtype, torch.float32)
        # Summed over chunks in fp32, whatever the weight's dtype.
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if ctx.needs_input_grad[1] else None
        for i, start in enumerate(range(0, hidden.shape[0], LOGPROB_CHUNK_TOKENS)):
            chunk = slice(start, start + LOGPROB_CHUNK_TOKENS)
            # The forward's logits exactly (fp32 ones included), so p sums to one; the gradient
            # comes out in the matmuls' dtype. A kept chunk is let go as soon as it is read.
            logits, ctx.kept[i] = ctx.kept[i], None
            if logits is None:
                logits = _logits(hidden[chunk], weight)
            grad_logits = grad_of_logits(
                logits, targets[chunk], log_z[chunk], entropy[chunk],
                grad_logprob[chunk], grad_entropy[chunk], ctx.temperature, hidden.dtype,
            )
            del logits
            if grad_hidden is not None:
                grad_hidden[chunk] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ hidden[chunk]).to(wide)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def target_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, T, dim], weight [V, dim], targets [B, T] -> (log softmax(hidden @ weight.T /
    temperature)[targets], entropy), both [B, T] fp32, differentiable w.r.t. hidden and weight.

    index [M] (int64, on hidden's device, increasing): the flat positions (row * T + column) whose
    log-probs are wanted; the head runs on those tokens only and every other position gets 0 and 0
    (None: every position). Each token's figures are those of the whole-row call where the head's
    numerics are batch-invariant."""
    B, T, D = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(B * T, D), targets.reshape(B * T)
    # Only a call with a backward to come keeps logits (inside the Function grad mode is always off).
    differentiable = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    keep = keep_budget(hidden.device) if differentiable else 0
    if index is None:
        logprobs, entropy = _ChunkedHead.apply(flat_hidden, weight, flat_targets, temperature, keep)
        return logprobs.view(B, T), entropy.view(B, T)
    # No wanted token still runs the head on one, weighted 0: the weight's gradient must exist on
    # every rank alike (FSDP reduces the same parameters everywhere).
    scale = 1.0 if index.numel() else 0.0
    index = index if index.numel() else torch.zeros(1, dtype=torch.long, device=hidden.device)
    picked = _ChunkedHead.apply(flat_hidden[index], weight, flat_targets[index], temperature, keep)
    logprobs, entropy = (torch.zeros(B * T, dtype=p.dtype, device=p.device).index_copy(0, index, p * scale)
                         for p in picked)
    return logprobs.view(B, T), entropy.view(B, T)
