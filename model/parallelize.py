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
    and kept in fp32, so the optimizer steps fp32 masters. On several ranks each transformer block
    is its own FSDP unit (one all-gather per block) and the embeddings, final norm and head form
    the root unit; on one rank the whole model is one unit.
    """
    for param in model.parameters():
        if param.dtype != torch.float32:
            raise ValueError(f"parallelize expects fp32 master weights, got {param.dtype}")
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if compile:
        compile_blocks(model)
    # On one rank nothing is sharded, so per-block units would buy no memory, only their hooks'
    # host time (about 1 ms per block per pass, more than the GPU needs for a small block): the
    # whole model is then one unit, gathered once before forward and reduced once after backward.
    per_block_units = mesh.size() > 1
    for block in model.layers:
        # Applied in place rather than through wrapper modules, so parameter names stay those of
        # the plain model (weight sync and HF export match tensors by name).
        if activation_checkpointing:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        if per_block_units:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=per_block_units)
    return model


def compile_blocks(model: Transformer) -> None:
    """torch.compile each block's two halves around its attention (norms, projections, RoPE,
    SwiGLU and the residuals fuse into few kernels); the flash attention call between them runs
    eagerly. Shapes are dynamic, so micro-batches of any token count share one graph per half.
    Measured on one H200 at the Qwen3-0.6B shape, this beat compiling each block whole, attention
    included (80.2k against 76.7k tokens/s in the same process; bench/RESULTS.md)."""
    import torch._dynamo.config as dynamo_config

    # Every block shares one code object per half; leave room for the guards of each block.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 * len(model.layers))
    for block in model.layers:
        block.attention_inputs = torch.compile(block.attention_inputs, dynamic=True)
        block.after_attention = torch.compile(block.after_attention, dynamic=True)
