"""Keyed sampling: a completion depends only on its key (seed, step, prompt, sample) and the weights.

The draw is Gumbel-max with noise hashed from (key, position, token id), so no random generator
state is shared between requests and batching never changes a sample. Log-probs are
log softmax(logits / temperature) over the full vocabulary; top-k / top-p only restrict which
tokens may be drawn. Everything here is device-side tensor code without host synchronisation, so
it can be captured in a CUDA graph together with the decode step. On CUDA, without top-k / top-p,
one Triton kernel (sampling_kernel.py) draws the token and computes its log-prob in one read of
the logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo.engine.types import GenerationRequest, SamplingParams
from model import batch_invariant
from model.logprob_head import chunk_stats

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int64 tensors holding values < 2**32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def combine(h: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """Hash `value` into the running hash h (both int64 holding 32-bit values)."""
    return mix32((h ^ (torch.as_tensor(value, device=h.device) & _M32)) + 0x9E3779B9 & _M32)


def vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] int64: the per-token-id part of the noise hash, computed once per engine."""
    return mix32(torch.arange(vocab_size, device=device, dtype=torch.int64))


def request_keys(seed: int, requests: Sequence[GenerationRequest]) -> torch.Tensor:
    """[R] int64 (CPU): each request's noise key from (seed, step, prompt index, sample index)."""
    keys = torch.full((len(requests),), seed & _M32, dtype=torch.int64)
    for field in ("step", "prompt_index", "sample_index"):
        keys = combine(keys, torch.tensor([getattr(r, field) for r in requests], dtype=torch.int64))
    return keys


def sample(
    logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, token_hash: torch.Tensor, sp: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob: logits [B, V] (any float dtype), keys and positions [B] int64
    (the position the drawn token will occupy) -> tokens [B] int64, logprobs [B] fp32.

    Greedy (temperature 0) reports the log-prob at temperature 1.
    """
    if sp.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, token_logprobs(logits.float(), tokens, 1.0)
    if logits.is_cuda and sp.top_k == 0 and sp.top_p >= 1.0:
        from grpo.engine.sampling_kernel import gumbel_sample  # Triton exists only where CUDA does

        tokens, logprobs = gumbel_sample(logits, combine(keys, positions), sp.temperature)
        if batch_invariant.enabled():
            logprobs = token_logprobs(logits, tokens, sp.temperature)  # the trainer's own kernel
        return tokens, logprobs
    logits = logits.float()
    scaled = logits / sp.temperature
    allowed = scaled
    if sp.top_k > 0:
        kth = torch.topk(scaled, min(sp.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        allowed = allowed.masked_fill(scaled < kth, float("-inf"))
    if sp.top_p < 1.0:
        probs, order = torch.softmax(allowed, dim=-1).sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop tokens whose preceding mass already does.
        drop_sorted = probs.cumsum(-1) - probs >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        allowed = allowed.masked_fill(drop, float("-inf"))
    row_hash = combine(keys, positions)[:, None]
    bits = mix32(row_hash ^ token_hash[None, :]) >> 8
    uniform = (bits.float() + 0.5) / 2**24
    tokens = (allowed - torch.log(-torch.log(uniform))).argmax(-1)
    return tokens, token_logprobs(logits, tokens, sp.temperature)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[tokens]: logits [B, V] (fp32, or any float dtype on CUDA),
    tokens [B] -> [B] fp32, by the trainer's formula (model/logprob_head.py): on CUDA by the
    trainer's own kernel, which reads each row once; with batch-invariant numerics on the CPU, on
    the fixed blocks of rows the trainer's head uses, so that the two agree bitwise."""
    if batch_invariant.uses_kernels(logits) or logits.is_cuda:
        from model.head_kernel import chunk_stats_triton  # the trainer's kernel: one program per row

        return chunk_stats_triton(logits.contiguous(), tokens, temperature)[0]
    if batch_invariant.enabled():
        return batch_invariant.in_blocks(lambda rows, t: chunk_stats(rows, t, temperature)[0], logits, tokens)
    scaled = logits / temperature
    return scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
