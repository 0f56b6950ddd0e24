"""The attention kernels behind the model's two paths, chosen per device and dtype.

- `packed_attention`: training and scoring over sequences packed back to back (`SequenceLayout`),
  causal within each sequence, with no mask tensor: memory and work grow with the sum of the
  squared sequence lengths, not with the square of the packed width.
- `varlen_prefill`: causal attention over prompts packed into one token axis, each prompt alone.
- `slot_decode`: one query per sequence against its KV-cache slot, reading only the slot's live
  keys (the first `lengths[b]` positions).

On CUDA in bf16/fp16, training and prefill run PyTorch's flash-attention kernel in its
variable-length form (aten's flash ops over `cu_seqlens`, forward and backward), or for training
FlashAttention 4 where `set_packed_kernel("fa4")` chose it (model/fa4.py), and decode
runs our Triton kernel (invariant_kernels.py `slot_attention`), which reads exactly the live keys
once per KV head.
Elsewhere (CPU, fp32) the sequences of each length run as one batched, causal
`scaled_dot_product_attention` call: the reference path the tests use. With batch-invariant
numerics on (model/batch_invariant.py), all three run its fixed-order block attention instead:
on CUDA the invariant Triton kernels (model/invariant_kernels.py), elsewhere the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import batch_invariant, fa4, flash, shared_prefix
from model.flash import fast_kernels_serve, uses_flash
from model.shared_prefix import SharedPrefixes

PACKED_KERNELS = ("flash", "fa4")
# The CUDA kernel behind `packed_attention` outside batch-invariant mode (`model.train_attention`).
_packed_kernel = {"name": "flash"}


def set_packed_kernel(name: str) -> None:
    """Choose the CUDA kernel of the packed (training and scoring) attention: "flash", aten's
    FlashAttention 2 ops, or "fa4", FlashAttention 4 (`fa4.fa4_problem` says whether it serves)."""
    if name not in PACKED_KERNELS:
        raise ValueError(f"packed attention kernel {name!r}: expected one of {PACKED_KERNELS}")
    _packed_kernel["name"] = name


@dataclass
class SequenceLayout:
    """Sequences laid back to back on a flat token axis: sequence s spans bounds[s]:bounds[s + 1].

    cu_seqlens: the bounds as an int32 tensor [S + 1] on the tokens' device (for the flash kernel);
    bounds: the same on the host (for the per-sequence CPU path); max_len: the longest sequence;
    shared: where sequences also attend to a shared prefix (None: each sequence attends to itself only).
    """

    cu_seqlens: torch.Tensor
    bounds: list[int]
    max_len: int
    shared: SharedPrefixes | None = None


def sequence_layout(
    doc_ids: torch.Tensor | None, shape: tuple[int, int], device: torch.device, group_ids: torch.Tensor | None = None
) -> SequenceLayout:
    """The layout of rows [B, T] flattened row after row: each maximal run of equal doc_ids [B, T]
    within a row is one sequence (padding runs included: they attend among themselves and carry no
    loss). doc_ids None: one sequence per row. Reads doc_ids on the host once (doc_ids may
    already be there: then the device is not waited for).

    group_ids [B, T] (host, optional): sequences of one group id >= 0 share a prefix. The group's
    run with doc id -1 is that prefix, and every other run of the group attends to it before
    itself (a prompt computed once for all of its completions); -1: no group."""
    B, T = shape
    if doc_ids is None:
        bounds = list(range(0, B * T + 1, T))
    else:
        flat = doc_ids.reshape(-1)
        starts = torch.ones(B * T, dtype=torch.bool, device=flat.device)
        starts[1:] = flat[1:] != flat[:-1]
        starts[::T] = True  # a row always starts a sequence
        bounds = starts.nonzero().flatten().tolist() + [B * T]
    max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    shared = None
    if group_ids is not None and bool((group_ids >= 0).any()):
        if doc_ids is None:
            raise ValueError("group_ids (shared prefixes) need doc_ids: the prefix runs are those of doc id -1")
        shared = _shared_prefixes(doc_ids.reshape(-1), group_ids.reshape(-1), bounds, device)
    return SequenceLayout(to_device(torch.tensor(bounds, dtype=torch.int32), device), bounds, max_len, shared)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`; from the host to CUDA pinned and asynchronous (a pageable copy would wait for
    the work already queued)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _shared_prefixes(
    doc_ids: torch.Tensor, group_ids: torch.Tensor, bounds: list[int], device: torch.device
) -> SharedPrefixes:
    """SharedPrefixes of the runs `bounds` (see sequence_layout's group_ids): a segment per group
    from its prefix run on, which must hold the group's other runs."""
    runs = list(zip(group_ids[bounds[:-1]].tolist(), doc_ids[bounds[:-1]].tolist(), bounds[:-1], bounds[1:]))
    prefixes = {g: (a, b) for g, d, a, b in runs if g >= 0 and d == -1}  # in the order of the token axis
    segment_bounds = [0] + [a for a, _ in list(prefixes.values())[1:]] + [bounds[-1]]
    segment = {g: s for s, g in enumerate(prefixes)}
    for g, d, a, b in runs:
        if g < 0 or d == -1:
            continue
        if g not in prefixes:
            raise ValueError(f"packed sequence of group {g} has no prefix run (doc id -1) in its rows")
        s = segment[g]
        if not segment_bounds[s] <= a < b <= segment_bounds[s + 1]:
            raise ValueError(f"packed sequence of group {g} (tokens {a}:{b}) lies outside its group's segment "
                             f"(tokens {segment_bounds[s]}:{segment_bounds[s + 1]}, from its prefix run to the next)")
    starts, ends = torch.tensor(list(prefixes.values()), dtype=torch.long).unbind(1)
    prefix_bounds = [0] + torch.cumsum(ends - starts, 0).tolist()
    flags = torch.tensor([g >= 0 and d != -1 for g, d, _, _ in runs])
    continues = flags.repeat_interleave(torch.tensor([b - a for _, _, a, b in runs]), output_size=bounds[-1])
    return SharedPrefixes(
        cu_segments=to_device(torch.tensor(segment_bounds, dtype=torch.int32), device),
        segment_bounds=segment_bounds,
        max_segment=max(b - a for a, b in zip(segment_bounds[:-1], segment_bounds[1:])),
        prefix_index=to_device(concat_ranges(starts, ends - starts), device),
        cu_prefix=to_device(torch.tensor(prefix_bounds, dtype=torch.int32), device),
        prefix_bounds=prefix_bounds,
        max_prefix=int((ends - starts).max()),
        continues=to_device(continues, device),
    )


def concat_ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """arange(starts[r], starts[r] + lens[r]) of each run r [R], back to back [sum lens], in a few
    vectorised ops rather than one arange per run."""
    total = int(lens.sum())
    return torch.arange(total) + (starts - (lens.cumsum(0) - lens)).repeat_interleave(lens, output_size=total)


def _invariant_grads(layout: SequenceLayout):
    """The backward of the invariant packed attention over `layout` (invariant_ops.PackedAttention's
    `grads`). On CUDA, flash attention's backward from the invariant forward's output and
    log-sum-exp: flash's forward is not run again. Elsewhere the reference path's gradients, from
    a recomputed forward."""

    def grads(grad, q, k, v, out, lse):
        if uses_flash(q):
            cu, n = layout.cu_seqlens, layout.max_len
            return flash.backward(grad, q, k, v, out, lse, cu, cu, n, n, True)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            again = _by_length(q, k, v, layout.bounds)
        return torch.autograd.grad(again, (q, k, v), grad)

    return grads


def _varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """Flash varlen attention with autograd: q [N, H, D], k/v [N, Hkv, D] -> [N, H, D]."""
    return flash.FlashVarlen.apply(q, k, v, layout.cu_seqlens, layout.max_len)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, T, H, D]: causal attention within each sequence
    of `layout` (over the B * T tokens flattened row after row)."""
    B, T, H, D = q.shape
    if batch_invariant.enabled():
        if layout.shared is not None:
            raise ValueError("shared prompt prefixes do not apply with batch-invariant numerics (job.bitwise_logprobs)")
        q, k, v = (t.reshape(B * T, -1, D) for t in (q, k, v))
        if not batch_invariant.uses_kernels(q):
            return batch_invariant.packed_attention(q, k, v, layout.bounds).view(B, T, H, D)

        grads = _invariant_grads(layout)
        out = batch_invariant.kernel_packed_attention(q, k, v, layout.cu_seqlens, layout.max_len, grads)
        return out.view(B, T, H, D)
    if not uses_flash(q) and len(layout.bounds) == B + 1 and layout.max_len == T:
        return _causal(q, k, v)  # one sequence per row: one batched call
    q, k, v = q.reshape(B * T, H, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)
    if layout.shared is not None:
        return _with_shared_prefixes(q, k, v, layout).view(B, T, H, D)
    if not uses_flash(q):
        out = _by_length(q, k, v, layout.bounds)
    elif _packed_kernel["name"] == "fa4":
        out = fa4.packed_causal(q, k, v, layout.cu_seqlens, layout.max_len)
    else:
        out = _varlen_causal(q, k, v, layout)
    return out.view(B, T, H, D)


def _with_shared_prefixes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """packed_attention's flat q [N, H, D], k/v [N, Hkv, D] where sequences also attend to a shared
    prefix (model/shared_prefix.py)."""
    if _packed_kernel["name"] != "flash" and uses_flash(q):
        raise ValueError('shared prompt prefixes need model.train_attention = "flash"')
    return shared_prefix.attend(q, k, v, layout.cu_seqlens, layout.bounds, layout.max_len, layout.shared)


def _by_length(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """The reference path: q [N, H, D], k/v [N, Hkv, D] -> [N, H, D], the sequences of each length
    gathered into one batched SDPA call (a packed batch of short episodes has few distinct lengths)."""
    starts_by_length: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        starts_by_length.setdefault(b - a, []).append(a)
    out = torch.empty_like(q)
    for length, starts in starts_by_length.items():
        rows = (torch.tensor(starts)[:, None] + torch.arange(length)[None, :]).to(q.device)  # [n, length]
        out[rows] = _causal(q[rows], k[rows], v[rows])
    return out


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rows of one sequence each: q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D], causal SDPA."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=q.shape[2] != k.shape[2]
    )
    return out.transpose(1, 2)


def check_decode_kernel(n_heads: int, n_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before any work, an attention shape the CUDA decode kernel cannot serve."""
    if not fast_kernels_serve(device, dtype):
        return
    from model.invariant_kernels import slot_attention_unsupported

    reason = slot_attention_unsupported(n_heads, n_kv_heads, head_dim)
    if reason is not None:
        raise ValueError(f"generator: the CUDA decode kernel does not support {reason}; use model.dtype = \"float32\"")


def varlen_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D] of prompts packed back to back -> [N, H, D].

    cu_seqlens [P + 1] int32: prompt p spans tokens cu_seqlens[p]:cu_seqlens[p + 1]; attention is
    causal within each prompt. max_len: the longest prompt.
    """
    if batch_invariant.enabled():
        if batch_invariant.uses_kernels(q):
            return batch_invariant.kernel_packed_attention(q, k, v, cu_seqlens, max_len)
        return batch_invariant.packed_attention(q, k, v, cu_seqlens.tolist())
    if uses_flash(q):
        return flash.forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, True)[0]
    return _by_length(q, k, v, cu_seqlens.tolist())


def suffix_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int
) -> torch.Tensor:
    """The last tokens of sequences against the whole sequences: q [Nq, H, D], k/v [Nk, Hkv, D],
    both packed -> [Nq, H, D].

    cu_q / cu_k [P + 1] int32: sequence p's queries are q[cu_q[p]:cu_q[p + 1]], its keys
    k[cu_k[p]:cu_k[p + 1]]; its queries are its last tokens, so query j attends to the keys up to
    position (keys - queries + j): causal, aligned at the end (as flash attention aligns it).
    """
    if uses_flash(q):
        return flash.forward(q, k, v, cu_q, cu_k, max_q, max_k, True)[0]
    out = torch.empty_like(q)
    for qa, qb, ka, kb in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        n_q, n_k = qb - qa, kb - ka
        visible = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        out[qa:qb] = F.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1), attn_mask=visible,
            enable_gqa=q.shape[1] != k.shape[1],
        ).transpose(0, 1)
    return out


def slot_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
    share_slots: torch.Tensor | None = None, share_lens: torch.Tensor | None = None,
    new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None, attended: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one query per row) against cache slots -> [B, H, D].

    k_cache / v_cache [S, L, Hkv, D]: slot s holds its sequence's keys at positions 0..L-1.
    slots [B] int64: each row's slot; lengths [B] int32: the live keys of each row (its query's
    position + 1). Rows may sit in any slot at any length.
    share_slots [B] int64 / share_lens [B] int32 (optional, together): row b reads its first
    share_lens[b] keys from slot share_slots[b] instead, which holds the same values there (a prompt
    prefilled once for several rows); reading one copy for many rows saves memory traffic.
    new_k / new_v [B, Hkv, D] (optional, together): each row's own key and value, stored at
    position lengths[b] - 1 of its slot first (on CUDA by the attention kernel itself).
    attended [B] int32 (optional): row b attends only to its first attended[b] (<= lengths[b])
    keys, fewer bytes read for a row whose output nobody uses (a finished row still in its decode
    graph attends to one key).
    On CUDA in the default mode, a batch too small to fill the device gives each row's keys to
    several programs (model/decode_kernel.py); the bitwise mode keeps one program a row.
    """
    if share_slots is None:
        share_slots, share_lens = slots, lengths
    kernel = batch_invariant.uses_kernels(q) if batch_invariant.enabled() else uses_flash(q)
    if new_k is not None and not kernel:
        at = (slots, lengths.long() - 1)
        k_cache.index_put_(at, new_k)
        v_cache.index_put_(at, new_v)
        new_k = new_v = None
    if batch_invariant.enabled():
        if kernel:
            return batch_invariant.kernel_slot_attention(
                q, k_cache, v_cache, slots, lengths, share_slots, share_lens, new_k, new_v, attended
            )
        keys, values = _slot_keys(k_cache, v_cache, slots, share_slots, share_lens)
        return batch_invariant.slot_attention(q, keys, values, lengths, attended)
    if kernel:
        # Imported here: Triton exists only where CUDA does.
        from model.decode_kernel import decode_splits, split_slot_attention
        from model.invariant_kernels import multiprocessors, slot_attention

        splits = decode_splits(q.shape[0], k_cache.shape[2], k_cache.shape[1], multiprocessors(q.device))
        if splits > 1:
            return split_slot_attention(q, k_cache, v_cache, slots, lengths, share_slots, share_lens, new_k, new_v,
                                        lengths if attended is None else attended, splits)
        return slot_attention(q, k_cache, v_cache, slots, lengths, share_slots, share_lens, new_k, new_v, attended)
    keys, values = _slot_keys(k_cache, v_cache, slots, share_slots, share_lens)
    attended = lengths if attended is None else attended
    live = (torch.arange(keys.shape[1], device=q.device)[None, :] < attended[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=live, enable_gqa=q.shape[1] != keys.shape[2]
    )
    return out[:, :, 0]


def _slot_keys(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, share_slots: torch.Tensor,
    share_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys and values [B, L, Hkv, D], its first share_lens[b] positions read from its share slot."""
    L = k_cache.shape[1]
    shared = torch.arange(L, device=slots.device)[None, :] < share_lens[:, None]
    source = torch.where(shared, share_slots[:, None], slots[:, None])  # [B, L]
    position = torch.arange(L, device=slots.device).expand_as(source)
    return k_cache[source, position], v_cache[source, position]
