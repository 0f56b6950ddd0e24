"""The native generation engine: a slotted KV cache, each prompt prefilled once for its whole
group, decode steps captured in CUDA graphs, and continuous batching.

A request takes a cache slot when one is free (longest token budget first); its prompt is
prefilled (once for every request with the same prompt admitted together: their slots receive the
same prompt K/V, which decode then reads from one of them, shares.py) and its first token sampled;
then it joins the decode batch. Decode steps run on the device without the host reading anything;
every `sync_every` steps, or sooner when the token budgets say a refill round (or the end) is
nearer, the host collects finished sequences (EOS, budget, stop strings), gives their slots to
waiting requests, and goes on.
A conversation's next turn (a request with `keep_kv`) takes back the slot its previous turn left
and prefills only the tokens appended since (kept.py).

A completion depends only on its key (seed, step, prompt index, sample index) and the weights,
never on which other requests share its batch (see sampling.py). Out of memory: the engine halves
its batch limit and runs the interrupted requests again from the start (same keys, same
completions); only a single request that does not fit stops generation with
`GenerationOutOfMemory`.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from grpo.engine.adapters import AdapterMerge
from grpo.engine.cache import SlotCache, kv_budget_bytes, slot_bytes, slots_for_budget
from grpo.engine.collect import StateSnapshot, finished_completions
from grpo.engine.decode import DecodeStep
from grpo.engine.kept import KeptKV, request_key, take_slot
from grpo.engine.prefill import prefill_appended, prefill_prompts
from grpo.engine.sampling import request_keys, sample, vocab_hash
from grpo.engine.schedule import admission_round, steps_to_check
from grpo.engine.shares import PrefixShares
from grpo.engine.slot_step import start_slots
from grpo.engine.types import (
    Completion,
    EngineCapacityError,
    GenerationOutOfMemory,
    GenerationRequest,
    SamplingParams,
    WeightUpdate,
)
from grpo.engine.vmm import mapped_bytes
from model import ModelArgs, Transformer
from model.attention import check_decode_kernel, to_device
from model.lora import LoRASpec
from model.parallelize import apply_tensor_parallel, compile_blocks, tensor_parallel_args


class NativeEngine:
    """Generates completions with its own copy of the model, in its own dtype and buffers.

    Interface (`Engine`, types.py) and its queue: `submit(requests)` queues, `poll()` runs everything
    queued and returns the finished completions in submission order, `generate(requests)` does both;
    `update_weights(buckets, version)` copies new weights into the existing parameters; `close()`.

    max_seq_len: a slot's capacity (prompt + completion), allocated once; None = sized at each poll
        to the longest request seen so far (the cache is reallocated when a longer one comes).
    kv_cache_gb: the K/V budget (0 = room for max_batch_size slots, on CUDA at most
        kv_cache_fraction of the free device memory).
    cuda_graphs / compile: CUDA only (CPU always runs eagerly).
    overlap_checks: with nothing waiting to be admitted, queue the next decode steps before reading
        a check (None: on CUDA, where the device then decodes while the host reads; on the CPU the
        steps run before the host reads anything, so they could only add work at the end).
    tensor_parallel: (tp, group): this engine is one rank of a TP group of tp ranks; `args` are the
        whole model's, the engine holds this rank's shard (model/parallelize.py) and its share of
        the K/V heads in the cache. Every rank of the group runs the same requests and draws the
        same tokens (the logits are whole and equal on every rank).
    lora: the trainer trains these adapters: the adapted layers' base weights and adapters arrive
        by name (adapters.py) and are merged into the engine's weights at the end of each update.
    """

    def __init__(
        self,
        args: ModelArgs,
        sampling: SamplingParams,
        eos_ids: Sequence[int],
        seed: int,
        dtype: torch.dtype,
        device: torch.device | str,
        stop_strings: Sequence[str] = (),
        decode_text: Callable[[list[int]], str] | None = None,
        max_batch_size: int = 512,
        max_seq_len: int | None = None,
        kv_cache_gb: float = 0.0,
        kv_cache_fraction: float = 0.4,
        share_prefix: bool = True,
        cuda_graphs: bool = True,
        compile: bool = True,
        sync_every: int = 8,
        prefill_tokens: int = 16384,
        overlap_checks: bool | None = None,
        tensor_parallel: tuple[int, dist.ProcessGroup] | None = None,
        lora: LoRASpec | None = None,
    ):
        if stop_strings and decode_text is None:
            raise ValueError("stop strings need a decode_text function to read the completion text")
        self.args, self.sampling, self.seed, self.dtype = args, sampling, seed, dtype
        self.device = torch.device(device)
        self.eos_ids = torch.tensor(list(eos_ids), dtype=torch.int64, device=self.device)
        self.stop_strings, self.decode_text = list(stop_strings), decode_text
        self.max_batch_size, self.share_prefix = max_batch_size, share_prefix
        self.kv_cache_gb, self.kv_cache_fraction = kv_cache_gb, kv_cache_fraction
        self.sync_every, self.prefill_tokens = sync_every, prefill_tokens
        on_cuda = self.device.type == "cuda"
        self.overlap_checks = on_cuda if overlap_checks is None else overlap_checks
        if tensor_parallel is not None:
            args = self.args = tensor_parallel_args(args, tensor_parallel[0])
        check_decode_kernel(args.n_heads, args.n_kv_heads, args.head_dim, self.device, dtype)
        self.use_graphs, self.use_compile = cuda_graphs and on_cuda, compile and on_cuda
        self._build_model(tensor_parallel[1] if tensor_parallel is not None else None)
        self.adapters = AdapterMerge(self._params, lora, args.n_layers) if lora is not None else None
        self._token_hash = vocab_hash(args.vocab_size, self.device)
        self.cache: SlotCache | None = None
        self.decoder: DecodeStep | None = None
        self.kept = KeptKV()
        # During a poll: key -> (slot, tokens with valid K/V) of the requests that continue a kept slot.
        self._resume: dict[tuple[int, int, int], tuple[int, int]] = {}
        self._auto_size = max_seq_len is None
        if max_seq_len is not None:
            self._allocate(max_seq_len)
        self.version = -1
        self.peak_active = 0
        self._in_flight = 0
        self._queue: list[tuple[GenerationRequest, SamplingParams]] = []

    def _build_model(self, tp_group: dist.ProcessGroup | None) -> None:
        """The engine's model (this rank's shard under tensor parallelism), uninitialised until the
        first weight update, with fused projections, and the sampler; compiled on CUDA."""
        with torch.device("meta"):
            self.model = Transformer(self.args, dtype=self.dtype)
        self.model.to_empty(device=self.device)
        if tp_group is not None:
            apply_tensor_parallel(self.model, tp_group)
        self.model.keep_rope_on(self.device)
        self.model.fuse_projections()
        self.model.eval().requires_grad_(False)
        self._params = dict(self.model.named_parameters())
        self._sample = sample
        if self.use_compile:
            # Each block's two halves (model/parallelize.py) and the sampler: one graph each, reused
            # by every layer and every batch size.
            compile_blocks(self.model)
            self._sample = torch.compile(sample, dynamic=True)

    def release_cache(self) -> None:
        """Free the KV cache's K/V memory, so that a colocated trainer can use it. The next poll
        brings the same slots back; on CUDA at the same addresses, so the decode graphs stay."""
        self.kept.clear()
        if self.cache is not None:
            self.cache.release_kv()

    def outside_bytes(self) -> int:
        """Device memory the engine holds outside PyTorch's allocator: the mapped KV cache (CUDA)."""
        return mapped_bytes()

    def _allocate(self, max_seq_len: int) -> None:
        """Allocate the KV cache: as many slots of max_seq_len tokens as the budget holds."""
        if self.decoder is not None:
            self.decoder.release()
        self.cache = self.decoder = None
        self.kept.clear()
        per_slot = slot_bytes(self.args, max_seq_len, self.dtype)
        # + 1: the scratch slot
        budget = kv_budget_bytes(per_slot, self.max_batch_size + 1, self.device, self.kv_cache_gb, self.kv_cache_fraction)
        num_slots = slots_for_budget(self.args, max_seq_len, self.dtype, budget, self.max_batch_size)
        if num_slots < 1:
            raise EngineCapacityError(
                f"generator: a KV cache of {budget / 1e9:.3g} GB holds no sequence of {max_seq_len} tokens "
                f"({2 * per_slot / 1e9:.3g} GB needed for one slot plus the scratch slot); raise "
                f"generation.kv_cache_gb or lower generation.max_seq_len"
            )
        self._build_cache(max_seq_len, num_slots)

    def _build_cache(self, max_seq_len: int, num_slots: int) -> None:
        """The cache of num_slots slots and the decode step over it."""
        self.cache = SlotCache(self.args, num_slots, max_seq_len, self.dtype, self.device)
        self.shares = PrefixShares(self.cache)
        self.decoder = DecodeStep(
            self.model, self.cache, self._sample, self._token_hash, self.eos_ids, num_slots, self.use_graphs
        )

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Iterable[WeightUpdate]], version: int) -> None:
        """Copy (name, index, tensor) updates, bucket by bucket, into the engine's own parameters:
        `param[index] = tensor`, where index is a tuple of slices (empty for the whole parameter).
        With LoRA, an adapted layer's base weight and adapters go to `adapters`, and every layer
        they touched is merged again at the end of the call."""
        for bucket in buckets:
            for name, index, tensor in bucket:
                if self.adapters is not None and self.adapters.owns(name):
                    self.adapters.write(name, index, tensor)
                    continue
                if name not in self._params:
                    raise KeyError(f"engine model has no parameter {name!r}")
                target = self._params[name][index]
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"weight update for {name!r}{list(index) if index else ''} has shape "
                        f"{list(tensor.shape)}, the engine holds {list(target.shape)}"
                    )
                target.copy_(tensor)
        if self.adapters is not None:
            self.adapters.merge()
        self.kept.clear()  # K/V of the old weights
        self.version = version

    def submit(self, requests: Iterable[GenerationRequest], sampling: SamplingParams | None = None) -> None:
        """Queue requests, sampled with `sampling` (default: the engine's)."""
        self._queue.extend((r, sampling or self.sampling) for r in requests)

    def generate(
        self, requests: Iterable[GenerationRequest], sampling: SamplingParams | None = None,
        on_finished: Callable[[list[Completion]], None] | None = None,
    ) -> list[Completion]:
        self.submit(requests, sampling)
        return self.poll(on_finished)

    def close(self) -> None:
        self._queue = []
        if self.decoder is not None:
            self.decoder.release()

    def poll(self, on_finished: Callable[[list[Completion]], None] | None = None) -> list[Completion]:
        """Run every queued request to completion; runs of equal sampling params share batches.
        `on_finished` hears of each check's finished completions as the host collects them (with
        the next interval already queued where checks overlap it)."""
        queued, self._queue = self._queue, []
        if queued and self.cache is not None and self.cache.kv_released:
            try:
                self.cache.restore_kv()
            except torch.OutOfMemoryError:
                # The trainer's allocator holds the pages: empty its cache only then, since the
                # trainer would otherwise allocate its activations from the driver afresh every step.
                torch.cuda.empty_cache()
                self.cache.restore_kv()
        if queued and self._auto_size:
            need = max(len(r.prompt_tokens) + self._budget(r, sp) for r, sp in queued)
            if self.cache is None or need > self.cache.max_len:
                self._allocate(need)
        self._resume = self.kept.claim(r for r, _ in queued)
        finished: list[Completion] = []
        start = 0
        while start < len(queued):
            end = start
            while end < len(queued) and queued[end][1] == queued[start][1]:
                end += 1
            finished.extend(self._run([r for r, _ in queued[start:end]], queued[start][1], on_finished))
            start = end
        return finished

    @staticmethod
    def _budget(request: GenerationRequest, sp: SamplingParams) -> int:
        return sp.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens

    def _check_fits(self, requests: list[GenerationRequest], sp: SamplingParams) -> None:
        for r in requests:
            budget = self._budget(r, sp)
            if not 1 <= budget <= sp.max_new_tokens:
                raise ValueError(f"request max_new_tokens {budget} is outside 1..{sp.max_new_tokens}")
            if len(r.prompt_tokens) + budget > self.cache.max_len:
                raise EngineCapacityError(
                    f"generator: a prompt of {len(r.prompt_tokens)} tokens + {budget} new tokens exceeds the "
                    f"KV slot of {self.cache.max_len} tokens; raise generation.max_seq_len"
                )

    def _run(self, requests: list[GenerationRequest], sp: SamplingParams, on_finished=None) -> list[Completion]:
        """Continuous batching over `requests` (one sampling setting); completions in their order."""
        self._check_fits(requests, sp)
        keys = request_keys(self.seed, requests)
        results: list[Completion | None] = [None] * len(requests)
        # Requests that continue a kept slot first (they need no free slot); then longest budget
        # first: a poll ends when its last request does, so long requests must not be the last to
        # start (equal budgets keep submission order).
        waiting = deque(sorted(
            range(len(requests)),
            key=lambda i: (request_key(requests[i]) not in self._resume, -self._budget(requests[i], sp)),
        ))
        while waiting:
            try:
                self._drain(requests, keys, sp, waiting, results, on_finished)
            except torch.OutOfMemoryError as exc:
                # Restarted from scratch below; keyed sampling makes the rerun produce the same completions.
                interrupted = [i for i, c in enumerate(results) if c is None and i not in waiting]
                waiting.extendleft(sorted(interrupted, key=lambda i: self._budget(requests[i], sp)))
                self._shrink(exc, requests[waiting[0]], sp)
        return results

    def _shrink(self, exc: torch.OutOfMemoryError, request: GenerationRequest, sp: SamplingParams) -> None:
        """After running out of memory: free cached memory and halve the batch limit."""
        # Half of what was in flight, not of the limit: a short last batch may be far below it.
        limit = self._in_flight
        if limit <= 1:
            raise GenerationOutOfMemory(
                f"generator: out of memory on a single request (prompt of {len(request.prompt_tokens)} tokens, "
                f"max_new_tokens {self._budget(request, sp)}); lower generation.max_new_tokens or "
                f"data.max_prompt_tokens, or give the generator more memory"
            ) from exc
        self.decoder.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.max_batch_size = limit // 2
        print(f"generator: out of memory with {limit} sequences at once; retrying with at most {self.max_batch_size}",
              file=sys.stderr, flush=True)

    def _drain(self, requests, keys, sp, waiting: deque, results: list, on_finished=None) -> None:
        """Admit, decode and collect until every request in `waiting` has a completion.

        With nothing left to admit, the next interval of decode steps is queued before the host
        reads the check of the last one, so the device does not idle while the host collects."""
        limit = min(self.max_batch_size, self.cache.num_slots)
        self.shares.reset()
        held = self.kept.slots() | {slot for slot, _ in self._resume.values()}
        free = [slot for slot in range(self.cache.num_slots) if slot not in held]
        active: dict[int, int] = {}  # slot -> request index
        checked: dict[int, int] = {}  # slot -> completion tokens already checked for stop strings
        # slot -> decode steps until its budget ends (EOS or a stop string may end it sooner)
        remaining: dict[int, int] = {}
        # Refill in rounds of at least a quarter of the batch (or whatever is still waiting): each
        # prefill call has a fixed cost, so admitting one request per check would pay it too often.
        refill = max(1, limit // 4)
        queued_ahead = False
        while waiting or active:
            if not queued_ahead:
                if limit - len(active) >= min(refill, len(waiting)) or not active:
                    room = limit - len(active)
                    for admit in admission_round(waiting, requests, room, self.prefill_tokens, self.share_prefix):
                        self._admit(requests, keys, sp, admit, free, active, checked)
                for slot, i in active.items():
                    # The first token comes from the prefill.
                    remaining.setdefault(slot, self._budget(requests[i], sp) - 1)
                self.peak_active = max(self.peak_active, len(active))
                self._in_flight = len(active)
                self._decode_interval(active, remaining, limit - len(active), min(refill, len(waiting)), sp)
            snapshot = StateSnapshot(self.cache, sorted(active))
            # Only budgets left to run: the next interval cannot depend on what this check finds.
            queued_ahead = self.overlap_checks and not waiting and max(remaining.values(), default=0) > 0
            if queued_ahead:
                self._decode_interval(active, remaining, limit - len(active), 0, sp)
            ended = finished_completions(
                self.cache, snapshot, requests, active, checked, self.stop_strings, self.decode_text, self.version
            )
            self.shares.leave(ended)
            for slot, result in ended.items():
                results[active.pop(slot)] = result
                del remaining[slot]
                if result.request.keep_kv:
                    self.kept.keep(result.request, slot, result.tokens)
                else:
                    free.append(slot)
            free.sort()
            if ended and on_finished is not None:
                on_finished(list(ended.values()))

    def _decode_interval(self, active: dict[int, int], remaining: dict[int, int], free: int, round_size: int,
                         sp: SamplingParams) -> None:
        """Queue the decode steps until the next check (schedule.steps_to_check) for the active slots."""
        steps = steps_to_check(remaining, free, round_size, self.sync_every)
        self._decode_steps(sorted(active), sp, steps)
        for slot in active:
            remaining[slot] = max(0, remaining[slot] - steps)

    def _admit(self, requests, keys, sp, admit: list[int], free: list[int], active: dict, checked: dict) -> None:
        taken = [take_slot(requests[i], free, self.kept, self._resume) for i in admit]
        self._in_flight = len(active) + len(admit)
        for appended in (False, True):
            group = [j for j, (_, cached) in enumerate(taken) if (cached > 0) == appended]
            if not group:
                continue
            batch, slots = [requests[admit[j]] for j in group], [taken[j][0] for j in group]
            if appended:
                logits = prefill_appended(self.model, self.cache, batch, slots, [taken[j][1] for j in group])
                self.shares.appended(slots)
            else:
                logits = prefill_prompts(self.model, self.cache, batch, slots, self.share_prefix)
                self.shares.prefilled(slots, [r.prompt_tokens for r in batch], self.share_prefix)
            self._start(batch, keys[[admit[j] for j in group]], slots, logits, sp)
        for (slot, _), i in zip(taken, admit):
            active[slot] = i
            checked[slot] = 0

    def _decode_steps(self, slots: list[int], sp: SamplingParams, steps: int) -> None:
        self.decoder.run(slots, sp, steps)

    @torch.no_grad()
    def _start(
        self, requests: list[GenerationRequest], keys: torch.Tensor, slots: list[int], logits: torch.Tensor,
        sp: SamplingParams,
    ) -> None:
        """Draw each prefilled request's first token from its logits [R, V] and set its slot's decode state."""
        dev = self.device
        prompt_lens = to_device(torch.tensor([len(r.prompt_tokens) for r in requests]), dev)
        keys = to_device(keys, dev)
        first, logprob = self._sample(logits, keys, prompt_lens, self._token_hash, sp)
        budgets = to_device(torch.tensor([self._budget(r, sp) for r in requests]), dev)
        start_slots(self.cache, to_device(torch.tensor(slots), dev), first, logprob, prompt_lens, keys, budgets,
                    self.eos_ids)
