"""Generation engines behind one interface, `Engine` (types.py): generate / update_weights /
release_cache / outside_bytes / close. `NativeEngine` (native.py) is ours; the pieces it is built from:

- types.py: requests, sampling parameters, completions, the `Engine` interface
- sampling.py: keyed Gumbel-max sampling with top-k / top-p, all on the device
- cache.py: the slotted KV cache and per-slot decode state, allocated once from a memory budget
- decode.py: one decode step over cache slots, eager or replayed from CUDA graphs per batch bucket
- slot_step.py: what a decode step reads from and writes to the per-slot state (slot_kernels.py:
  the same as one Triton kernel each on CUDA)
- collect.py: which slots finished, and their completions read back to the host from a snapshot
  of the slot state

`VLLMEngine` (vllm_engine.py) runs our model inside vLLM behind the same interface: vllm_model.py
is the wrapper vLLM instantiates and the methods our engine calls in vLLM's worker;
vllm_staging.py the buffer both processes map, which weights cross. It is imported only when
`generation.engine = "vllm"` asks for it, so vLLM stays optional.
"""

from grpo.engine.native import NativeEngine
from grpo.engine.types import (
    Completion,
    Engine,
    EngineCapacityError,
    GenerationOutOfMemory,
    GenerationRequest,
    SamplingParams,
    WeightUpdate,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineCapacityError",
    "GenerationOutOfMemory",
    "GenerationRequest",
    "NativeEngine",
    "SamplingParams",
    "WeightUpdate",
]
