"""Attention for packed sequences that continue a shared prefix (training.share_prompts): a group's
prompt is packed once, and each of the group's sequences attends to all of it, then causally to
itself.

Two attention calls whose softmaxes are merged through their log-sum-exps: every sequence against
its own keys (causal: the plain packed call), and every segment's tokens against its group's prefix
(not causal; a segment is a group's prefix and sequences, back to back). A continuing token's output
is the two partial outputs weighted by their shares of the softmax's total mass; every other token
keeps its own call's output. The backward runs each call's backward from the merged output and
log-sum-exp, which gives each call its exact share of the gradients; tokens that continue no
prefix take no part in the prefix call's (their log-sum-exp there is +inf).

Nothing is copied per sequence: gathering the prefix's keys before each sequence's own would copy a
group's prefix once per sequence and sum its gradients back with an index_add (bench/RESULTS.md).
On CUDA in bf16/fp16 the calls are flash attention's (model/flash.py) and the merge one Triton
kernel (model/merge_kernel.py); elsewhere this module's references of the same contracts, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import flash


@dataclass
class SharedPrefixes:
    """Where packed sequences [N tokens] continue a group's shared prefix, laid out for `attend`.

    The token axis is cut in G segments, one a group, in the order of the groups' prefix runs:
    segment g starts at group g's prefix run (the first segment also holds any tokens before it),
    and every sequence of group g lies inside it.
    """

    cu_segments: torch.Tensor  # [G + 1] int32, on the tokens' device: segment g is tokens cu_segments[g]:cu_segments[g + 1]
    segment_bounds: list[int]  # the same on the host
    max_segment: int  # the longest segment's tokens
    prefix_index: torch.Tensor  # [P] int64, on the tokens' device: the prefix runs' tokens, group after group
    cu_prefix: torch.Tensor  # [G + 1] int32, on the tokens' device: group g's prefix in prefix_index
    prefix_bounds: list[int]  # the same on the host
    max_prefix: int  # the longest prefix's tokens
    continues: torch.Tensor  # [N] bool, on the tokens' device: tokens of the sequences that continue a prefix


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, bounds: list[int], max_len: int,
    shared: SharedPrefixes,
) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D] -> [N, H, D]: causal attention within each sequence (cu_seqlens
    on the device, bounds on the host, max_len its longest), and before it, for a sequence that
    continues a prefix, attention to all of its group's prefix."""
    return _PrefixAttention.apply(q, k, v, cu_seqlens, bounds, max_len, shared)


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, bounds, max_len, shared: SharedPrefixes) -> torch.Tensor:
        fast = flash.uses_flash(q)
        own = (cu_seqlens, cu_seqlens, max_len, max_len) if fast else (bounds, bounds)
        prefix = ((shared.cu_segments, shared.cu_prefix, shared.max_segment, shared.max_prefix) if fast
                  else (shared.segment_bounds, shared.prefix_bounds))
        prefix_k, prefix_v = k.index_select(0, shared.prefix_index), v.index_select(0, shared.prefix_index)
        own_out, own_lse = _forward(fast, q, k, v, own, causal=True)
        prefix_out, prefix_lse = _forward(fast, q, prefix_k, prefix_v, prefix, causal=False)
        if fast:
            from model.merge_kernel import merge  # Triton exists only where CUDA does

            out, lse = merge(own_out, own_lse, prefix_out, prefix_lse, shared.continues)
        else:
            out, lse = merge_reference(own_out, own_lse, prefix_out, prefix_lse, shared.continues)
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse)
        ctx.fast, ctx.own, ctx.prefix, ctx.shared = fast, own, prefix, shared
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, prefix_k, prefix_v, out, lse = ctx.saved_tensors
        shared = ctx.shared
        dq, dk, dv = _backward(ctx.fast, grad, q, k, v, out, lse, ctx.own, causal=True)
        prefix_lse = lse.masked_fill(~shared.continues, float("inf"))
        dq_prefix, dk_prefix, dv_prefix = _backward(
            ctx.fast, grad, q, prefix_k, prefix_v, out, prefix_lse, ctx.prefix, causal=False
        )
        dk = dk.index_add(0, shared.prefix_index, dk_prefix)
        dv = dv.index_add(0, shared.prefix_index, dv_prefix)
        return dq + dq_prefix, dk, dv, None, None, None, None


def merge_reference(
    own_out: torch.Tensor, own_lse: torch.Tensor, prefix_out: torch.Tensor, prefix_lse: torch.Tensor,
    continues: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """model/merge_kernel.merge's contract in plain torch: the two calls' outputs [N, H, D] and
    log-sum-exps [H, N] merged into one softmax's; a token that continues no prefix (continues [N]
    False) keeps its own call's output exactly."""
    prefix_lse = prefix_lse.masked_fill(~continues, float("-inf"))
    lse = torch.logaddexp(own_lse, prefix_lse)
    # The prefix call's share of each query's softmax mass [N, H, 1], 0 where nothing continues.
    share = torch.exp(prefix_lse - lse).transpose(0, 1)[:, :, None]
    own, other = own_out.float(), prefix_out.float()
    return (own + share * (other - own)).to(own_out.dtype), lse


def _forward(fast: bool, q, k, v, segments: tuple, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if fast:
        return flash.forward(q, k, v, *segments, causal)
    return reference_forward(q, k, v, *segments, causal)


def _backward(fast: bool, grad, q, k, v, out, lse, segments: tuple, causal: bool):
    if fast:
        return flash.backward(grad, q, k, v, out, lse, *segments, causal)
    return reference_backward(grad, q, k, v, out, lse, *segments, causal)


def _segments(q_bounds: list[int], k_bounds: list[int]):
    return zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:])


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """One segment's scaled scores [H, Lq, Lk] in fp32 from q [Lq, H, D], k [Lk, H, D] (K heads
    already repeated); causal: query j sees keys up to Lk - Lq + j (aligned at the end), -inf beyond."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_k = q.shape[0], k.shape[0]
        hidden = torch.arange(n_k)[None, :] > torch.arange(n_k - n_q, n_k)[:, None]
        scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
    return scores


def _repeat_heads(k: torch.Tensor, heads: int) -> torch.Tensor:
    """[L, Hkv, D] -> [L, H, D]: query head h reads K/V head h // (H / Hkv)."""
    return k.repeat_interleave(heads // k.shape[1], dim=1)


def reference_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_bounds: list[int], k_bounds: list[int], causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash.forward's contract on any device, segment by segment in fp32 (bounds on the host):
    -> out [Nq, H, D] (q's dtype), log-sum-exp [H, Nq] fp32."""
    H = q.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((H, q.shape[0]), dtype=torch.float32, device=q.device)
    for qa, qb, ka, kb in _segments(q_bounds, k_bounds):
        scores = _scores(q[qa:qb], _repeat_heads(k[ka:kb], H), causal)
        lse[:, qa:qb] = scores.logsumexp(-1)
        weights = torch.softmax(scores, dim=-1)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", weights, _repeat_heads(v[ka:kb], H).float()).to(q.dtype)
    return out, lse


def reference_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    q_bounds: list[int], k_bounds: list[int], causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash.backward's contract (out and lse may be a larger softmax's; lse +inf: no part), segment
    by segment in fp32: -> dq, dk, dv in the inputs' dtypes."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for qa, qb, ka, kb in _segments(q_bounds, k_bounds):
        keys, values = _repeat_heads(k[ka:kb], H).float(), _repeat_heads(v[ka:kb], H).float()
        weights = torch.exp(_scores(q[qa:qb], keys, causal) - lse[:, qa:qb, None])  # [H, Lq, Lk]
        d_out, o = grad[qa:qb].float(), out[qa:qb].float()
        d_weights = torch.einsum("qhd,khd->hqk", d_out, values)
        d_scores = weights * (d_weights - (d_out * o).sum(-1).transpose(0, 1)[:, :, None]) * D**-0.5
        dq[qa:qb] = torch.einsum("hqk,khd->qhd", d_scores, keys)
        n_k = kb - ka
        dk[ka:kb] += torch.einsum("hqk,qhd->khd", d_scores, q[qa:qb].float()).view(n_k, Hkv, H // Hkv, D).sum(2)
        dv[ka:kb] += torch.einsum("hqk,qhd->khd", weights, d_out).view(n_k, Hkv, H // Hkv, D).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
