"""One decode step over a batch of cache slots, run eagerly or replayed from CUDA graphs.

The step reads each row's last token and position from the slot state, runs the model with the
slot-aware attention, samples the next token, and writes token, log-prob, EOS and budget checks
back into the slot state: all on the device, so many steps can be queued without the host
looking at any result. On CUDA a step is captured once per (batch-size bucket, sampling
settings); a batch is padded up to its bucket with rows that point at the scratch slot.

A batch of at least `split_rows` rows (CUDA) runs the model in two halves, the second on a side
stream: the halves are independent until the sampler, so one half's attention, bound by memory,
can run beside the other's matmuls, bound by arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo.engine.cache import SlotCache
from grpo.engine.slot_step import SlotReads, advance_slots, read_slots
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
        split_rows: int = 0,
    ):
        self.model, self.cache, self.sample = model, cache, sample
        self.token_hash, self.eos_ids = token_hash, eos_ids
        self.use_graphs = use_graphs
        self.split_rows = split_rows if cache.device.type == "cuda" else 0
        self.side = torch.cuda.Stream(cache.device) if self.split_rows else None
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
        if self.split_rows and rows.shape[0] >= self.split_rows:
            hidden = self._hidden_in_halves(rows, reads)
        else:
            hidden = self.model.decode_hidden(reads.token, reads.position, c.decode_attention(rows, reads))
        logits = self.model.decode_logits(hidden)
        new, logprob = self.sample(logits, reads.key, reads.next_position, self.token_hash, sp)
        advance_slots(c, rows, new, logprob, self.eos_ids)

    def _hidden_in_halves(self, rows: torch.Tensor, reads: SlotReads) -> torch.Tensor:
        """The model's hidden states [B, dim] for rows [B], the first half on the current stream and
        the second on the side stream; nothing is shared between them but the weights. Each half
        writes into `out`, which the current stream owns, so no tensor of the side stream outlives it."""
        half = rows.shape[0] // 2
        main = torch.cuda.current_stream(rows.device)
        out = torch.empty(rows.shape[0], self.model.args.dim, dtype=self.cache.dtype, device=rows.device)
        self.side.wait_stream(main)
        for part, stream in ((slice(0, half), main), (slice(half, None), self.side)):
            r = SlotReads(*(t[part] for t in reads))
            with torch.cuda.stream(stream):
                out[part] = self.model.decode_hidden(r.token, r.position, self.cache.decode_attention(rows[part], r))
        main.wait_stream(self.side)
        return out
