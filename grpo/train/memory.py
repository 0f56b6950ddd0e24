"""The trainer running out of device memory, said in one line: how much was in use, and which
settings of this run would lower it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from grpo.config import Config
from grpo.errors import TandemError


class TrainingOutOfMemory(TandemError, RuntimeError):
    """A training step did not fit in the trainer's device memory."""


@contextmanager
def explain_out_of_memory(cfg: Config, device: torch.device, held_elsewhere: Callable[[], int]) -> Iterator[None]:
    """Turn torch.OutOfMemoryError inside the block into TrainingOutOfMemory. held_elsewhere()
    gives the bytes this rank's device holds outside PyTorch's allocator (the native engine's mapped
    KV cache, vLLM's process)."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise TrainingOutOfMemory(out_of_memory_advice(cfg, device, held_elsewhere())) from None


def out_of_memory_advice(cfg: Config, device: torch.device, held_elsewhere_bytes: int) -> str:
    """The one line: what was in use, then the settings that would lower it, most effective first."""
    in_use = ""
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device) / 1e9
        in_use = (f" ({allocated:.1f} GB allocated by PyTorch, {held_elsewhere_bytes / 1e9:.1f} GB held outside it by "
                  "the generation engine)")
    t, g = cfg.training, cfg.generation
    remedies = [f"lower training.micro_batch_tokens (now {t.micro_batch_tokens})"]
    if not cfg.model.activation_checkpointing:
        remedies.append("set model.activation_checkpointing = true")
    if cfg.parallelism.mode == "colocated":
        if t.schedule == "async":
            remedies.append(
                "lower generation.kv_cache_fraction or kv_cache_gb: the async schedule keeps the KV cache while "
                'the rank trains (training.schedule = "sync" frees it)'
            )
        elif not g.release_kv_cache:
            remedies.append("set generation.release_kv_cache = true, which frees the KV cache while the rank trains")
    if cfg.lora.rank == 0:
        remedies.append("train LoRA adapters (lora.rank > 0)")
    return f"the trainer ran out of device memory on {device}{in_use}: " + "; or ".join(remedies)
