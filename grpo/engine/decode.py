"""One decode step over a batch of cache slots, run eagerly or replayed from CUDA graphs.

The step reads each row's last token and position from the slot state, runs the model with the
slot-aware attention, samples the next token, and writes token, log-prob, EOS and budget checks
back into the slot state: all on the device, so many steps can be queued without the host
looking at any result. On CUDA a step is captured once per (batch-size bucket, sampling
settings); a batch is padded up to its bucket with rows that point at the scratch slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo.engine.cache import SlotCache
from grpo.engine.slot_step import advance_slots, read_slots
from grpo.engine.types import SamplingParams
from model import Transformer
from model.attention import to_device

# Batch sizes a decode graph is captured for; a batch runs in the smallest bucket that holds it.
_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)


def buckets_up_to(limit: int) -> list[int]:
    """The capture buckets for batches of at most `limit` rows (limit itself always included)."""
    sizes = [b for b in _SMALL_BUCKETS if b < limit]
    size = 160
    while size < limit:
        sizes.append(size)
        size += 32 if size < 256 else 64
    return sizes + [limit]


def graph_key(sp: SamplingParams) -> tuple:
    """The sampling settings a captured step bakes in (the token budget is per slot, not baked)."""
    return (sp.temperature, sp.top_k, sp.top_p)


class DecodeStep:
    """Advances rows of the slot cache by one token per call (eager) or per replay (graphs)."""

    def __init__(
        self,
        model: Transformer,
        cache: SlotCache,
        sample: Callable,
        token_hash: torch.Tensor,
        eos_ids: torch.Tensor,
        max_rows: int,
        use_graphs: bool,
    ):
        self.model, self.cache, self.sample = model, cache, sample
        self.token_hash, self.eos_ids = token_hash, eos_ids
        self.use_graphs = use_graphs
        self.buckets = buckets_up_to(max_rows)
        device = cache.device
        # The rows of the batch being decoded (slot ids); graphs read their first `bucket` entries.
        self.rows = torch.full((max_rows,), cache.scratch, dtype=torch.int64, device=device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, slots: list[int], sp: SamplingParams, steps: int) -> None:
        """Advance `slots` by `steps` tokens each (finished ones stay as they are)."""
        n = len(slots)
        if not self.use_graphs:
            rows = to_device(torch.tensor(slots, dtype=torch.int64), self.cache.device)
            for _ in range(steps):
                self.step(rows, sp)
            return
        size = self.bucket(n)
        graph = self.graphs.get((size, graph_key(sp)))
        if graph is None:
            graph = self.capture(size, sp)
        padded = slots + [self.cache.scratch] * (size - n)
        self.rows[:size].copy_(torch.tensor(padded, dtype=torch.int64).pin_memory(), non_blocking=True)
        for _ in range(steps):
            graph.replay()

    def capture(self, size: int, sp: SamplingParams) -> torch.cuda.CUDAGraph:
        """Capture one step for batches of `size` rows. The warm-up runs on scratch rows only, so
        it changes nothing that belongs to a request."""
        rows = self.rows[:size]
        rows.fill_(self.cache.scratch)
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(rows, sp)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Thread-local: a colocated rank on the async schedule captures while its main thread trains,
        # and the trainer's own calls (allocations among them) must not break this capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.step(rows, sp)
        self.graphs[(size, graph_key(sp))] = graph
        return graph

    def release(self) -> None:
        """Drop the captured graphs (after running out of memory; they are recaptured on demand)."""
        self.graphs.clear()

    @torch.no_grad()
    def step(self, rows: torch.Tensor, sp: SamplingParams) -> None:
        """One token for each row of rows [B] (slot ids); padding rows point at the scratch slot."""
        c = self.cache
        reads = read_slots(c, rows)
        logits = self.model.decode(reads.token, reads.position, c.decode_attention(rows, reads))
        new, logprob = self.sample(logits, reads.key, reads.next_position, self.token_hash, sp)
        advance_slots(c, rows, new, logprob, self.eos_ids)
