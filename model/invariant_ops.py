"""The batch-invariant CUDA kernels (invariant_kernels.py) as PyTorch operators with gradients.

The matmul and RMSNorm are custom operators, so a compiled block traces them as opaque calls
(no graph break, CUDA graphs intact). Attention runs eagerly between the compiled halves, as an
autograd function. Only forward values must be invariant: gradients come from the standard
kernels (cuBLAS for the matmul's, flash attention's backward for attention's, the closed form for
RMSNorm), which is what keeps the trainer's cost near the default mode's.
"""

from __future__ import annotations

import torch

from model import invariant_kernels as kernels


@torch.library.custom_op("tandem::invariant_linear", mutates_args=())
def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) -> [..., N], in fp32 when fp32_out, else x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    out = kernels.matmul(flat, weight, bias, torch.float32 if fp32_out else x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


@invariant_linear.register_fake
def _(x, weight, bias, fp32_out):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32 if fp32_out else x.dtype)


def _linear_context(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad = grad.to(x.dtype)
    flat_grad = grad.reshape(-1, grad.shape[-1])
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = flat_grad.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_bias = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_weight, grad_bias, None


invariant_linear.register_autograd(_linear_backward, setup_context=_linear_context)


@torch.library.custom_op("tandem::invariant_rms_norm", mutates_args=())
def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] (model.RMSNorm's numerics) -> x's shape and dtype."""
    return kernels.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


@invariant_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _rms_norm_context(ctx, inputs, output) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    # y = w * cast(n), n = x / rms(x); the cast passes gradients through. With g = dL/dn:
    # dL/dx = (g - n * mean(g * n)) / rms(x).
    x, weight = ctx.saved_tensors
    wide = x.float()
    inv_rms = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + ctx.eps)
    normed = wide * inv_rms
    grad = grad.float()
    g = grad * weight.float()
    grad_x = (inv_rms * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
    grad_weight = (grad * normed.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return grad_x, grad_weight, None


invariant_rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_context)


class PackedAttention(torch.autograd.Function):
    """Invariant causal attention over packed sequences, forward; the backward is `grads`
    (grad [N, H, D], q, k, v, out [N, H, D], lse [H, N] -> dq, dk, dv), given the forward's
    output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_len: int, grads):
        out, lse = kernels.packed_attention(q, k, v, cu_seqlens, max_len, with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.grads = grads
        return out

    @staticmethod
    def backward(ctx, grad):
        return *ctx.grads(grad, *ctx.saved_tensors), None, None, None
