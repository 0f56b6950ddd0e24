"""The engine's KV cache: fixed-size slots allocated once from a memory budget, and the per-slot
decode state that lives beside it on the device.

A slot holds one sequence (prompt + completion) of up to `max_len` tokens. Slots are taken by
requests as they are admitted and given back when they finish (continuous batching); the buffers
themselves are allocated once per engine and never resized, so weight updates and CUDA graphs
keep pointing at the same memory; a colocated engine releases the K/V memory while the trainer
trains and gets it back at the same addresses. One extra slot (index `num_slots`) is scratch: padding rows of a
captured decode batch read and write it, and nothing real lives there.
"""

from __future__ import annotations

import math

import torch

from grpo.engine.slot_step import SlotReads
from model import ModelArgs, batch_invariant
from model.attention import concat_ranges, slot_decode, suffix_prefill, to_device, varlen_prefill


def slot_bytes(args: ModelArgs, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V over all layers for one slot of max_len tokens."""
    per_token = 2 * args.n_layers * args.n_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
    return per_token * max_len


def kv_budget_bytes(
    per_sequence: int, sequences: int, device: torch.device, kv_cache_gb: float, kv_cache_fraction: float
) -> int:
    """The K/V budget of an engine: kv_cache_gb when set, else room for `sequences` sequences of
    `per_sequence` bytes, on CUDA at most kv_cache_fraction of the device memory free now."""
    if kv_cache_gb > 0:
        return int(kv_cache_gb * 1e9)
    budget = per_sequence * sequences
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, int(free * kv_cache_fraction))
    return budget


def slots_for_budget(args: ModelArgs, max_len: int, dtype: torch.dtype, budget_bytes: int, max_slots: int) -> int:
    """How many slots of max_len tokens fit in budget_bytes (the scratch slot included), at most max_slots."""
    return max(0, min(max_slots, budget_bytes // slot_bytes(args, max_len, dtype) - 1))


class SlotCache:
    """K/V buffers [num_slots + 1, max_len, n_kv_heads, head_dim] per layer, plus per-slot state."""

    def __init__(self, args: ModelArgs, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.num_slots, self.max_len, self.device = num_slots, max_len, device
        self.scratch = num_slots
        self.shape = (num_slots + 1, max_len, args.n_kv_heads, args.head_dim)
        self.n_layers, self.dtype = args.n_layers, dtype
        self._nbytes = slot_bytes(args, max_len, dtype) * (num_slots + 1)
        # On CUDA the K/V buffers sit at fixed virtual addresses, so release_kv() can return their
        # memory without invalidating the decode graphs captured on them (grpo/engine/vmm.py).
        self._virtual = None
        if device.type == "cuda":
            from grpo.engine.vmm import VirtualBuffer

            self._virtual = VirtualBuffer(self._nbytes, device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.kv_released = True
        self.restore_kv()
        n = num_slots + 1
        # Per slot: the token to feed next and its position, the noise key, the request's budget,
        # tokens generated so far, whether it is finished and whether EOS finished it.
        self.last_token = torch.zeros(n, dtype=torch.int64, device=device)
        self.position = torch.zeros(n, dtype=torch.int64, device=device)
        self.key = torch.zeros(n, dtype=torch.int64, device=device)
        self.budget = torch.ones(n, dtype=torch.int64, device=device)
        self.generated = torch.zeros(n, dtype=torch.int64, device=device)
        self.done = torch.ones(n, dtype=torch.bool, device=device)
        self.eos = torch.zeros(n, dtype=torch.bool, device=device)
        # Completion tokens and log-probs per slot, written in place as they are drawn.
        self.out_tokens = torch.zeros((n, max_len), dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros((n, max_len), dtype=torch.float32, device=device)
        # Per slot: the slot whose copy of the shared prompt K/V decode reads (itself, or the slot
        # of another live sequence of its group prefilled with it), and that prompt's length.
        self.share_slot = torch.arange(n, dtype=torch.int64, device=device)
        self.share_len = torch.zeros(n, dtype=torch.int32, device=device)
        # For the host's reads of finished completions, which must not wait for the decode steps
        # queued after them (collect.py).
        self.read_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def release_kv(self) -> None:
        """Free the K/V buffers' memory (their contents are lost) until restore_kv()."""
        if self.kv_released:
            return
        if self._virtual is not None:
            self._virtual.unmap()
        else:
            self.k, self.v = [], []
        self.kv_released = True

    def restore_kv(self) -> None:
        """Zeroed K/V buffers again: on CUDA at the addresses they had, so captured graphs still hold."""
        if not self.kv_released:
            return
        if self._virtual is not None:
            self._virtual.remap()
            flat = self._virtual.tensor.view(self.dtype)
            flat.zero_()
            layers = flat.split(math.prod(self.shape))
            self.k = [t.view(self.shape) for t in layers[: self.n_layers]]
            self.v = [t.view(self.shape) for t in layers[self.n_layers : 2 * self.n_layers]]
        else:
            self.k = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
            self.v = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.kv_released = False

    @property
    def nbytes(self) -> int:
        """Bytes the K/V buffers hold when allocated."""
        return self._nbytes

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's K, V viewed as [(num_slots + 1) * max_len, n_kv_heads, head_dim]."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def prefill_attention(
        self, write_source: torch.Tensor, write_target: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
    ):
        """attend() for Transformer.decode over packed prompts.

        Token write_source[j] of the packed batch is stored at flat cache row write_target[j]
        (slot * max_len + position); a prompt shared by several slots is listed once per slot.
        Attention runs over the packed prompts themselves (causal within each), not the cache.
        """

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_flat, v_flat = self.flat(layer)
            k_flat.index_copy_(0, write_target, k.index_select(0, write_source))
            v_flat.index_copy_(0, write_target, v.index_select(0, write_source))
            return varlen_prefill(q, k, v, cu_seqlens, max_len)

        return attend

    def append_attention(self, slots: list[int], cached: list[int], appended: list[int]):
        """attend() for tokens appended to slots that hold K/V already: sequence i's appended[i]
        tokens (packed in that order) sit at positions cached[i]... of slot slots[i]; they are
        stored there and attend causally over the slot's keys up to their own.

        With batch-invariant numerics each token runs as a decode row (the trainer's numbers);
        otherwise each slot's keys are gathered and the appended tokens attend in one varlen call.
        """
        dev, L = self.device, self.max_len
        appended_t = torch.tensor(appended)
        rows = torch.tensor(slots).repeat_interleave(appended_t)
        positions = concat_ranges(torch.tensor(cached), appended_t)
        write_target = to_device(rows * L + positions, dev)
        if batch_invariant.enabled():
            rows_d, lengths = to_device(rows, dev), to_device((positions + 1).to(torch.int32), dev)
        else:
            keys = [c + n for c, n in zip(cached, appended)]
            gather = to_device(concat_ranges(torch.tensor(slots) * L, torch.tensor(keys)), dev)
            cu_q = to_device(torch.tensor([0] + appended).cumsum(0).to(torch.int32), dev)
            cu_k = to_device(torch.tensor([0] + keys).cumsum(0).to(torch.int32), dev)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_flat, v_flat = self.flat(layer)
            k_flat.index_copy_(0, write_target, k)
            v_flat.index_copy_(0, write_target, v)
            if batch_invariant.enabled():
                return slot_decode(q, self.k[layer], self.v[layer], rows_d, lengths)
            return suffix_prefill(q, k_flat.index_select(0, gather), v_flat.index_select(0, gather), cu_q, cu_k,
                                  max(appended), max(keys))

        return attend

    def decode_attention(self, slots: torch.Tensor, reads: SlotReads):
        """attend() for one decode step over slots [B]: row b's token sits at reads.position[b] of
        slot slots[b]; its K/V are stored there and it attends over the slot's first
        reads.lengths[b] keys (a finished row over one key only: reads.attended), the shared
        prompt's read from reads.share_slots[b] (PrefixShares)."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return slot_decode(
                q, self.k[layer], self.v[layer], slots, reads.lengths, reads.share_slots, reads.share_lens, k, v,
                reads.attended,
            )

        return attend
