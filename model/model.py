"""The native decoder: Qwen3 / Llama 3 / Qwen2 in one module, built directly in its target dtype.

Two paths share the same layers:
- `forward`: training and scoring over packed rows (several sequences per row, per-token positions,
  attention only within a sequence). Given target tokens it returns their log-probabilities and the
  per-token entropy, computed in chunks so the full `[T, V]` fp32 logits never exist at once.
- `decode`: prefill and single-token steps over tokens packed on one axis, with the caller's
  cache-aware attention between the two halves of each block (the engine owns the KV cache).

Every token-wise step goes through `batch_invariant.tokenwise`, and every matmul through
`batch_invariant.linear` / `project` / `output_logits`: plain calls, or with batch-invariant
numerics on (`job.bitwise_logprobs`), the invariant CUDA kernels, or on the CPU the same calls
on fixed blocks of tokens.

Numerics follow the HF reference implementations operation by operation (RMSNorm in fp32, RoPE
tables in fp32 cast to the activation dtype) so that outputs agree with `transformers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model import batch_invariant
from model.args import ModelArgs
from model.attention import SequenceLayout, packed_attention, sequence_layout, to_device, uses_flash
from model.batch_invariant import head_logits, linear, output_logits, project, tokenwise
from model.logprob_head import target_logprobs


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and cast back before the scale (as HF does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.uses_kernels(x):
            return batch_invariant.rms_norm(x, self.weight, self.eps)
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], fp32, with llama3 scaling when configured."""
    # Always on CPU: the model may be built under a `meta` device context.
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64, device="cpu").float() / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    if args.rope_type != "llama3":
        return inv_freq
    s = args.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] for positions [B, T]; angles in fp32, then cast to `dtype`."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)[None, None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the tables [B, T, D] (half-split layout, as HF checkpoints use)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        kw = dict(dtype=dtype, device=device)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias, **kw)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias, **kw)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias, **kw)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False, **kw)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps, dtype, device)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.wqkv: torch.Tensor | None = None
        self.bqkv: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """Inference layout: wq, wk, wv become row blocks of one [(H + 2 Hkv) D, dim] matrix, so
        the projection is one matmul. Parameter names stay, and each parameter is a view into the
        fused storage, so in-place weight updates land in it."""
        self.wqkv = _fuse(self.wq, self.wk, self.wv)
        self.bqkv = _fuse_bias(self.wq, self.wk, self.wv)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, dim] -> q [B, T, H, D], k and v [B, T, Hkv, D], RoPE applied to q and k."""
        B, T, _ = x.shape
        kv_width = self.n_kv_heads * self.head_dim
        widths = [self.n_heads * self.head_dim, kv_width, kv_width]
        if self.wqkv is not None:
            q, k, v = linear(x, self.wqkv, self.bqkv).split(widths, -1)
        else:
            q, k, v = project(self.wq, x), project(self.wk, x), project(self.wv, x)
        q = q.reshape(B, T, self.n_heads, self.head_dim)
        k = k.reshape(B, T, self.n_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v



class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.w1 = nn.Linear(args.dim, args.ffn_dim, **kw)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, **kw)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, **kw)
        self.w13: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """Inference layout: w1 and w3 become row blocks of one matrix (see Attention.fuse_projections)."""
        self.w13 = _fuse(self.w1, self.w3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:
            fused = linear(x, self.w13)
            if uses_flash(fused) and not batch_invariant.enabled():
                # Batch-invariant numerics keep the compiled elementwise code that the trainer runs too.
                from model.swiglu_kernel import silu_mul  # Triton exists only where CUDA does

                return project(self.w2, silu_mul(fused))
            gate, up = fused.chunk(2, dim=-1)
        else:
            gate, up = project(self.w1, x), project(self.w3, x)
        return project(self.w2, F.silu(gate) * up)


def _fuse(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the linears' weights by rows and make each weight a view of its block."""
    fused = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


def _fuse_bias(*linears: nn.Linear) -> torch.Tensor | None:
    if linears[0].bias is None:
        return None
    fused = torch.cat([m.bias.detach() for m in linears])
    start = 0
    for m in linears:
        m.bias = nn.Parameter(fused[start : start + m.bias.shape[0]], requires_grad=False)
        start += m.bias.shape[0]
    return fused


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, dtype, device)
        self.attention = Attention(args, dtype, device)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype, device)
        self.feed_forward = FeedForward(args, dtype, device)

    def forward(
        self, x: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: SequenceLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream as (x, pending), both [B, T, dim], whose sum is the block's input ->
        the block's output in the same form: attention within each sequence of `layout`."""
        x, q, k, v = tokenwise(self.attention_inputs, x, pending, cos, sin)
        return tokenwise(self.after_attention, x, packed_attention(q, k, v, layout))

    # Both paths split the block around its attention: the decode path puts the caller's
    # cache-aware kernel between the two halves, and each half is what gets compiled (the
    # attention kernels take host-side lengths that a compiled graph would specialise on).
    # The feed-forward's output is added to the residual stream by the next block's first half
    # (or the final norm), where the add fuses into the norm's kernel instead of being one of its own.
    def attention_inputs(self, x: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x, pending [B, T, dim] (the residual stream, and the previous block's feed-forward output
        still to add) -> (x + pending, and q, k, v of this block's attention: see Attention.qkv)."""
        x = x + pending
        return (x, *self.attention.qkv(self.attention_norm(x), cos, sin))

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, dim], attn [B, T, H, D] (attention output) -> (x + the attention's projection,
        the feed-forward's output), both [B, T, dim]: their sum is the block's output."""
        x = x + project(self.attention.wo, attn.flatten(-2))
        return x, self.feed_forward(self.ffn_norm(x))


class TokenLogprobs(NamedTuple):
    """Per-token outputs of the log-prob head, both [B, T] fp32 (a NamedTuple so FSDP's hooks see the tensors)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


class Transformer(nn.Module):
    """Decoder-only transformer. Build on `meta` to load a checkpoint without allocating twice."""

    def __init__(
        self, args: ModelArgs, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None
    ):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, dtype=dtype, device=device)
        self.layers = nn.ModuleList(TransformerBlock(args, dtype, device) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, dtype, device)
        self.output = (
            None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False, dtype=dtype, device=device)
        )
        # Derived from args, not state: kept off the state dict and rebuilt wherever the model lives.
        self._inv_freq = rope_inv_freq(args)

    def fuse_projections(self) -> None:
        """Inference layout: one matmul for each block's q/k/v and one for its SwiGLU gate and up
        projections (parameters become views into the fused matrices; names are unchanged)."""
        for layer in self.layers:
            layer.attention.fuse_projections()
            layer.feed_forward.fuse_projections()

    def keep_rope_on(self, device: torch.device) -> None:
        """Hold the RoPE frequencies on `device`, where the model runs. Built on the host, they
        would be copied to the device at every forward: a decode step captured in a CUDA graph may
        not do that, and in training the pageable copy makes the host wait for all the work queued
        before it (the previous micro-batch's backward), so each forward starts without the lead
        the host had gained."""
        self._inv_freq = self._inv_freq.to(device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, head_dim] in `dtype` for positions [B, T] (rope_tables at this model's frequencies)."""
        return rope_tables(self._inv_freq, positions, dtype)

    def final_norm(self, x: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        """The last block's output as (x, pending) [..., dim] -> the normalised hidden states [..., dim]."""
        return self.norm(x + pending)

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, dim]: the embedding matrix when tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init for training from scratch: N(0, std) matrices, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        group_ids: torch.Tensor | None = None,
        head_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | TokenLogprobs:
        """Training / scoring pass over rows of tokens [B, T].

        positions [B, T]: position of each token within its own sequence (default 0..T-1).
        doc_ids [B, T]: sequence id of each token; attention stays within equal ids, and a sequence's
            tokens must be contiguous in the row (default: one sequence per row).
        group_ids [B, T]: shared prefixes (model/attention.py sequence_layout): a group's run of doc
            id -1 is attended to by every other sequence of the group, before its own tokens.
        Without targets: logits [B, T, V] in the compute dtype (fp32 on the invariant CUDA kernels).
        With targets [B, T]: TokenLogprobs of log softmax(logits / temperature)[target] and the entropy
            of that distribution, in fp32, computed chunk by chunk (model/logprob_head.py).
        head_mask [B, T] bool (with targets; best on the host): the tokens whose log-probs are wanted;
            the output head runs on those only, and the others get 0 (default: every token).
        """
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        h = self.tok_embeddings(tokens)
        cos, sin = tokenwise(lambda p: self.rope(p, h.dtype), positions)
        layout = sequence_layout(doc_ids, (B, T), tokens.device, group_ids)
        pending = torch.zeros_like(h)
        for layer in self.layers:
            h, pending = layer(h, pending, cos, sin, layout)
        h = tokenwise(self.final_norm, h, pending)
        if targets is None:
            return tokenwise(lambda x: output_logits(x, self.output_weight), h)
        index = None if head_mask is None else to_device(head_mask.reshape(-1).nonzero().squeeze(1), h.device)
        logprobs, entropy = target_logprobs(h, self.output_weight, targets, temperature, index)
        # Cloned out of the views so that FSDP's pre-backward hook sits on a tensor no in-place op can bypass.
        return TokenLogprobs(logprobs.clone(), entropy.clone())

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inference pass over tokens packed on one axis: tokens, positions [N] -> logits [N, V] (in
        the compute dtype, or fp32: batch_invariant.head_logits says when).

        attend(layer, q [N, H, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, H, D] is the caller's
        cache-aware attention (it stores k and v and attends over whatever the cache holds).
        logits_index [M] picks the tokens whose logits are wanted -> [M, V].
        """
        h = self.decode_hidden(tokens, positions, attend)
        h = h if logits_index is None else h[logits_index]
        return tokenwise(lambda x: head_logits(x, self.output_weight), h, lead=1)

    def decode_hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`decode` up to the final norm: tokens, positions [N] -> normalised hidden states [N, dim]
        (an engine that computes logits itself, e.g. vLLM, takes them from here)."""
        h = self.tok_embeddings(tokens)[None]
        cos, sin = tokenwise(lambda p: self.rope(p, h.dtype), positions[None])
        pending = torch.zeros_like(h)
        for i, layer in enumerate(self.layers):
            h, q, k, v = tokenwise(layer.attention_inputs, h, pending, cos, sin)
            h, pending = tokenwise(layer.after_attention, h, attend(i, q[0], k[0], v[0])[None])
        return tokenwise(self.final_norm, h[0], pending[0], lead=1)
