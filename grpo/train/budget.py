"""training.micro_batch_tokens = 0: the micro-batch size read off the trainer's device memory.

More tokens per micro-batch means fewer forward/backward passes for the same step, and the host's
cost per pass (kernel launches, autograd, compiled-graph calls) is paid fewer times: on one H100 the
realistic step's training took 17% less time at 32k tokens than at 16k. How many fit depends on
the model, compilation, the attention kernel, activation checkpointing and LoRA, so the size is
measured rather than modelled: the first MEASURED_STEPS steps pack FIRST_TOKENS (or the longest
episode), the last of them records its peak of allocated memory above what the step started with
(the first step also allocates the optimizer's state, so it is not the one read), and later steps
pack as many tokens as MEMORY_SHARE of the device's memory holds at that rate, in multiples of
ROUND_TO. Every trainer rank takes the smallest size any of them found.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist

from grpo.config import Config
from grpo.distributed.collectives import all_reduce

FIRST_TOKENS = 16384
MEASURED_STEPS = 2
MEMORY_SHARE = 0.85
ROUND_TO = 8192


def sizing_problem(cfg: Config, device: torch.device) -> str | None:
    """Why micro-batches of this run are not sized from memory (they stay at the first size), or None."""
    if device.type != "cuda":
        return f"no device memory to size them from on {device.type}"
    if cfg.parallelism.mode == "colocated" and cfg.training.schedule == "async":
        return "colocated ranks generate the next batch while they train, with memory needs of their own"
    if cfg.parallelism.mode == "colocated" and cfg.generation.engine == "vllm":
        return "vLLM maps its K/V cache again after each training phase, into memory the trainer must leave free"
    return None


def sized_tokens(usable: int, allocated: int, per_token: float, first: int) -> int:
    """The tokens a micro-batch may pack: MEMORY_SHARE of `usable` bytes (what the allocator could
    hold), less the `allocated` bytes that stay between steps, at `per_token` bytes a token; in
    multiples of ROUND_TO and never below `first`, the size already run."""
    room = MEMORY_SHARE * usable - allocated
    return max(first, int(room / per_token) // ROUND_TO * ROUND_TO)


class DeviceMemory(Protocol):
    """What sizing reads of a device's memory, in bytes."""

    def reset_peak(self) -> None: ...
    def allocated(self) -> int: ...
    def peak(self) -> int: ...
    def usable(self) -> int: ...


class CudaMemory:
    """DeviceMemory of a CUDA device, from PyTorch's caching allocator and the driver."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def usable(self) -> int:
        """What the allocator could hold: the driver's free memory and what it holds already."""
        return torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device)


class MicroBatchSizer:
    """Sizes a trainer's micro-batches (its `micro_batch_tokens`) from what its steps allocate."""

    def __init__(
        self, trainer, device: torch.device, problem: str | None, group: dist.ProcessGroup | None,
        memory: DeviceMemory | None = None,
    ):
        """trainer: its micro_batch_tokens is the first size, and gets the measured one. problem:
        why not to size (sizing_problem), or None. memory: what to read (default: `device`'s)."""
        self.trainer, self.device, self.problem, self.group = trainer, device, problem, group
        self.memory = memory if memory is not None or problem is not None else CudaMemory(device)
        self.first = trainer.micro_batch_tokens
        self.steps_measured = 0
        self.settled = problem is not None
        # The line that says what was chosen, once, for the run's log; None when there is nothing new
        # to say (on the CPU nothing is expected to be sized).
        self.news: str | None = None
        if problem is not None and device.type == "cuda":
            self.news = (f"training.micro_batch_tokens = 0: micro-batches of {self.first} tokens, not sized from "
                         f"memory: {problem}")

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Around one training step: measures it, and after the MEASURED_STEPS-th sets the size."""
        if self.settled:
            yield
            return
        self.memory.reset_peak()
        start = self.memory.allocated()
        yield
        self.steps_measured += 1
        if self.steps_measured < MEASURED_STEPS:
            return
        per_token = max(self.memory.peak() - start, 1) / self.first
        allocated, usable = self.memory.allocated(), self.memory.usable()
        tokens = sized_tokens(usable, allocated, per_token, self.first)
        tokens = int(all_reduce({"tokens": tokens}, self.group, dist.ReduceOp.MIN, self.device)["tokens"])
        self.settle(tokens)
        self.news = (
            f"training.micro_batch_tokens = 0: micro-batches of {tokens} tokens from the next step (a step at "
            f"{self.first} took {per_token / 2**20:.2f} MiB a token above {allocated / 1e9:.1f} GB held; "
            f"{MEMORY_SHARE:.0%} of {usable / 1e9:.1f} GB usable)"
        )

    @property
    def found(self) -> bool:
        """Whether the size was found from memory (by this run or the one it resumes)."""
        return self.settled and self.problem is None

    def settle(self, tokens: int) -> None:
        """Pack `tokens` per micro-batch from now on, without measuring (also on resume)."""
        self.trainer.micro_batch_tokens = tokens
        self.settled = True
