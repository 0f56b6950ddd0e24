"""Parallelism applied to the native model from outside: FSDP2, activation checkpointing, compile.

`model.py` knows nothing of any of this; callers build the model in fp32 (the master weights) and
hand it here with a mesh.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from model.model import Transformer


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype = torch.bfloat16,
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> Transformer:
    """Shard `model` (fp32 parameters = master weights) over `mesh` with FSDP2.

    Parameters are all-gathered in `compute_dtype` for forward and backward; gradients are reduced
    and kept in fp32, so the optimizer steps fp32 masters. Each transformer block is its own FSDP
    unit (one all-gather per block); the embeddings, final norm and head form the root unit.
    """
    for param in model.parameters():
        if param.dtype != torch.float32:
            raise ValueError(f"parallelize expects fp32 master weights, got {param.dtype}")
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        # Both are applied in place rather than through wrapper modules, so parameter names stay
        # those of the plain model (weight sync and HF export match tensors by name).
        if activation_checkpointing:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        if compile:
            block.compile(fullgraph=True)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model
