"""The native decoder: Qwen3 / Llama 3 / Qwen2 in one module, built directly in its target dtype.

Two paths share the same layers:
- `forward`: training and scoring over packed rows (several sequences per row, per-token positions,
  attention only within a sequence). Given target tokens it returns their log-probabilities and the
  per-token entropy, computed in chunks so the full `[T, V]` fp32 logits never exist at once.
- `decode`: prefill and single-token steps against a `KVCache` that the caller owns.

Numerics follow the HF reference implementations operation by operation (RMSNorm in fp32, RoPE
tables in fp32 cast to the activation dtype) so that outputs agree with `transformers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.args import ModelArgs

# Tokens per chunk of the log-prob head: bounds the fp32 [chunk, V] logits held at once.
LOGPROB_CHUNK_TOKENS = 1024


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and cast back before the scale (as HF does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
    """Rotate x [B, H, T, D] by the tables [B, T, D] (half-split layout, as HF checkpoints use)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


@dataclass
class KVCache:
    """Per-layer key/value buffers [B, n_kv_heads, max_len, head_dim]; slot s holds position s."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, args: ModelArgs, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (batch_size, args.n_kv_heads, max_len, args.head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)],
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


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

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]. mask: bool [B, 1, T, S] (None = plain causal).

        cache: (k_buffer, v_buffer, input_pos [B, T]); this step's keys/values are written at their
        positions and attention runs over the whole buffer, the mask hiding slots past each query.
        """
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k_buffer, v_buffer, input_pos = cache
            rows = torch.arange(B, device=x.device)[:, None]
            k_buffer[rows, :, input_pos] = k.transpose(1, 2)
            v_buffer[rows, :, input_pos] = v.transpose(1, 2)
            k, v = k_buffer, v_buffer
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_heads != self.n_kv_heads
        )
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.w1 = nn.Linear(args.dim, args.ffn_dim, **kw)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, **kw)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, dtype, device)
        self.attention = Attention(args, dtype, device)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype, device)
        self.feed_forward = FeedForward(args, dtype, device)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        return x + self.feed_forward(self.ffn_norm(x))


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
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False, dtype=dtype, device=device)
        # Derived from args, not state: kept off the state dict and rebuilt wherever the model lives.
        self._inv_freq = rope_inv_freq(args)

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

    def _hidden(self, tokens, positions, mask, kv_cache=None, input_pos=None):
        h = self.tok_embeddings(tokens)
        cos, sin = rope_tables(self._inv_freq, positions, h.dtype)
        for i, layer in enumerate(self.layers):
            cache = None if kv_cache is None else (kv_cache.k[i], kv_cache.v[i], input_pos)
            h = layer(h, cos, sin, mask, cache)
        return self.norm(h)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor | TokenLogprobs:
        """Training / scoring pass over rows of tokens [B, T].

        positions [B, T]: position of each token within its own sequence (default 0..T-1).
        doc_ids [B, T]: sequence id of each token; attention stays within equal ids, and a sequence's
            tokens must be contiguous in the row (default: one sequence per row).
        Without targets: logits [B, T, V] in the compute dtype.
        With targets [B, T]: TokenLogprobs of log softmax(logits / temperature)[target] and the entropy
            of that distribution, in fp32, computed chunk by chunk (forward and backward).
        """
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        mask = None
        if doc_ids is not None:
            causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
            mask = ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]
        h = self._hidden(tokens, positions, mask)
        if targets is None:
            return F.linear(h, self.output_weight)
        return chunked_target_logprobs(h, self.output_weight, targets, temperature)

    def decode(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        kv_cache: KVCache,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prefill or decode step against kv_cache: tokens, input_pos [B, T] -> logits.

        Each row's positions index its cache slots; row b attends to slots <= its query position, so
        rows may sit at different lengths. logits_index [B] picks one position per row (the last
        prompt token at prefill) and returns [B, V]; otherwise [B, T, V].
        """
        slots = torch.arange(kv_cache.max_len, device=tokens.device)
        mask = (slots[None, None, :] <= input_pos[:, :, None])[:, None]
        h = self._hidden(tokens, input_pos, mask, kv_cache, input_pos)
        if logits_index is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logits_index]
        return F.linear(h, self.output_weight)


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = F.linear(hidden, weight).float() / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    target_logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - log_z
    entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return target_logprobs, entropy


def chunked_target_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> TokenLogprobs:
    """log softmax(hidden @ weight.T / temperature)[targets] and entropy, [B, T] fp32.

    Each chunk of LOGPROB_CHUNK_TOKENS tokens is recomputed in backward (activation checkpointing),
    so at most one chunk's fp32 [chunk, V] logits exists at a time in either pass.
    """
    B, T, D = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(B * T, D), targets.reshape(B * T)
    logprobs, entropies = [], []
    for start in range(0, B * T, LOGPROB_CHUNK_TOKENS):
        end = start + LOGPROB_CHUNK_TOKENS
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = checkpoint(
                _chunk_logprobs, flat_hidden[start:end], weight, flat_targets[start:end], temperature, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs(flat_hidden[start:end], weight, flat_targets[start:end], temperature)
        logprobs.append(lp)
        entropies.append(ent)
    # Cloned out of the view so that FSDP's pre-backward hook sits on a tensor no in-place op can bypass.
    return TokenLogprobs(torch.cat(logprobs).view(B, T).clone(), torch.cat(entropies).view(B, T).clone())
