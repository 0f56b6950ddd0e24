"""The log-prob head: log softmax(hidden @ weight.T / T)[target] and the entropy of that
distribution, per token, without ever holding the whole `[N, V]` logits.

Tokens go through in chunks. Forward keeps, per token, only the log-normaliser and the entropy
(plus its inputs); backward recomputes each chunk's logits with one matmul and turns them into
their gradient in one elementwise pass, from the closed forms (s = logits / T, p = softmax(s)):

    d logprob / d s_j = 1[j = target] - p_j
    d entropy / d s_j = -p_j (log p_j + entropy)

so neither pass runs the softmax twice, and no autograd graph over `[chunk, V]` tensors exists.
The two per-chunk functions are plain tensor code; model/parallelize.py may swap in compiled
copies, which fuse each into one pass over the chunk's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

# Tokens per chunk: bounds the [chunk, V] logits (and their gradient) held at once.
LOGPROB_CHUNK_TOKENS = 4096


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
) -> torch.Tensor:
    """The gradient [N, V] (in logits' dtype) of the loss w.r.t. logits [N, V], given its gradients
    w.r.t. the chunk's target log-probs and entropies [N]."""
    log_p = _wide(logits) / temperature - log_z[:, None]
    p = log_p.exp()
    grad = -p * (grad_logprob[:, None] + grad_entropy[:, None] * (log_p + entropy[:, None]))
    is_target = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
    grad = torch.where(is_target, grad + grad_logprob[:, None], grad)
    return (grad / temperature).to(logits.dtype)


@dataclass
class HeadKernels:
    """The per-chunk functions the head runs (`chunk_stats`, `chunk_grad` or compiled copies)."""

    stats: Callable = chunk_stats
    grad: Callable = chunk_grad


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, kernels: HeadKernels):
        logprobs, entropies, log_zs = [], [], []
        for start in range(0, hidden.shape[0], LOGPROB_CHUNK_TOKENS):
            chunk = slice(start, start + LOGPROB_CHUNK_TOKENS)
            lp, ent, log_z = kernels.stats(F.linear(hidden[chunk], weight), targets[chunk], temperature)
            logprobs.append(lp)
            entropies.append(ent)
            log_zs.append(log_z)
        entropy = torch.cat(entropies)
        ctx.save_for_backward(hidden, weight, targets, torch.cat(log_zs), entropy)
        ctx.temperature, ctx.kernels = temperature, kernels
        return torch.cat(logprobs), entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        grad_logprob = torch.zeros_like(log_z) if grad_logprob is None else grad_logprob.to(log_z.dtype)
        grad_entropy = torch.zeros_like(log_z) if grad_entropy is None else grad_entropy.to(log_z.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        wide = torch.promote_types(weight.dtype, torch.float32)
        # Summed over chunks in fp32, whatever the weight's dtype.
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], LOGPROB_CHUNK_TOKENS):
            chunk = slice(start, start + LOGPROB_CHUNK_TOKENS)
            grad_logits = ctx.kernels.grad(
                F.linear(hidden[chunk], weight), targets[chunk], log_z[chunk], entropy[chunk],
                grad_logprob[chunk], grad_entropy[chunk], ctx.temperature,
            )
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
    kernels: HeadKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, T, dim], weight [V, dim], targets [B, T] -> (log softmax(hidden @ weight.T /
    temperature)[targets], entropy), both [B, T] fp32, differentiable w.r.t. hidden and weight."""
    B, T, D = hidden.shape
    logprobs, entropy = _ChunkedHead.apply(
        hidden.reshape(B * T, D), weight, targets.reshape(B * T), temperature, kernels or HeadKernels()
    )
    return logprobs.view(B, T), entropy.view(B, T)
