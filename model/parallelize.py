"""Parallelism applied to the native model from outside: FSDP2, activation checkpointing, compile
for the trainer; the tensor-parallel plan for the generator's engine.

`model.py` knows nothing of any of this; callers build the model in fp32 (the master weights) and
hand it here with a mesh.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard
from torch.utils.checkpoint import checkpoint

from model.args import ModelArgs
from model.model import Transformer, TransformerBlock


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype = torch.bfloat16,
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> Transformer:
    """Shard `model` (fp32 parameters = master weights) over `mesh` with FSDP2.

    Parameters are all-gathered in `compute_dtype` for forward and backward; gradients are reduced
    and kept in fp32, so the optimizer steps fp32 masters. Frozen parameters (LoRA's base,
    model/lora.py) are already in `compute_dtype` and gathered as they are. On several ranks each transformer block
    is its own FSDP unit (one all-gather per block) and the embeddings, final norm and head form
    the root unit; on one rank the whole model is one unit.
    """
    # A frozen fp32 model (the KL reference) is cast by the all-gather, as masters are.
    check_master_dtypes(model, (compute_dtype, torch.float32))
    model.keep_rope_on(next(model.parameters()).device)
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
            checkpoint_block(block)
        if per_block_units:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=per_block_units)
    return model


def checkpoint_block(block: TransformerBlock) -> None:
    """Recompute `block`'s activations in its backward. A checkpoint keeps the block's inputs until
    then, and the block takes the residual stream as two tensors (x, pending; model.py); here they
    are added first and handed over as one tensor and broadcast zeros, so the block keeps half the
    memory. The block's first norm then reads the sum rounded to the compute dtype: as eager code
    and the batch-invariant mode (Inductor emulating eager's casts) read it anyway, where a compiled
    block in the default mode reads it unrounded (one bf16 rounding apart from the engine's)."""
    forward = block.forward

    def checkpointed(x: torch.Tensor, pending: torch.Tensor, *rest):
        zeros = torch.zeros((), dtype=x.dtype, device=x.device).expand_as(x)
        return checkpoint(forward, x + pending, zeros, *rest, use_reentrant=False)

    block.forward = checkpointed


def check_master_dtypes(model: torch.nn.Module, frozen_dtypes: tuple[torch.dtype, ...]) -> None:
    """Trainable parameters must be fp32 masters, frozen ones in one of frozen_dtypes."""
    for name, param in model.named_parameters():
        expected = (torch.float32,) if param.requires_grad else frozen_dtypes
        if param.dtype not in expected:
            kind = "trainable (an fp32 master)" if param.requires_grad else "frozen"
            raise ValueError(f"{name} is {kind} and should be {' or '.join(map(str, expected))}, got {param.dtype}")


# Inductor fuses the two reductions of RMSNorm's backward (over the row, for the input's gradient;
# over the tokens, for the weight's) only when a micro-batch holds at least 5 * 2**20 / dim tokens
# (5,120 at dim 1024), and guards the graph on that side of the line. Micro-batches of a token
# budget end in a shorter remainder, so without this a step whose remainder first falls on the
# other side recompiled both halves (7 s at the Qwen3-0.6B shape on one H200). The non-strict mode
# drops the size checks: the fused kernel for every token count, one graph.
_INDUCTOR_OPTIONS = {"triton.mix_order_reduction_non_strict_mode": True}


def compile_blocks(model: Transformer) -> None:
    """torch.compile each block's two halves around its attention (norms, projections, RoPE,
    SwiGLU and the residuals fuse into few kernels); the attention call between them runs
    eagerly. Also the RoPE tables and the final norm, which eagerly take several kernels each: a
    decode step runs them every time. Shapes are dynamic, so micro-batches (or decode batches) of
    any token count share one graph per half. Measured on one H200 at the Qwen3-0.6B shape, this
    beat compiling each block whole, attention included (80.2k against 76.7k tokens/s in the same
    process; bench/RESULTS.md). Used by the trainer and the engine alike, so both compute the same
    way."""
    import torch._dynamo.config as dynamo_config

    # Every block shares one code object per half; leave room for the guards of each block, and
    # for the batch size 1 that dynamic shapes specialise.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 * len(model.layers), 64)
    for block in model.layers:
        block.attention_inputs = torch.compile(block.attention_inputs, dynamic=True, options=_INDUCTOR_OPTIONS)
        block.after_attention = torch.compile(block.after_attention, dynamic=True, options=_INDUCTOR_OPTIONS)
    model.rope = torch.compile(model.rope, dynamic=True)
    # The final norm's backward has the same two reductions as a block's norms.
    model.final_norm = torch.compile(model.final_norm, dynamic=True, options=_INDUCTOR_OPTIONS)


# Tensor parallelism for the generator's engine. A TP group of `tp` ranks holds one engine: query
# heads, K/V heads and the SwiGLU width split evenly (Megatron's column-parallel q/k/v and w1/w3,
# row-parallel wo and w2, whose partial outputs are summed over the group); K/V heads replicated
# when there are fewer than tp, each rank keeping the one its query heads use. Embeddings, norms
# and the output head stay whole: sampling needs each token's full row of logits, and a sharded
# head would cost a gather per decode step for a matrix that is a small part of the model.
_COLUMN_PARALLEL = ("attention.wq.", "feed_forward.w1.", "feed_forward.w3.")
_KV = ("attention.wk.", "attention.wv.")
_ROW_PARALLEL = ("attention.wo.weight", "feed_forward.w2.weight")


def tensor_parallel_problem(args: ModelArgs, tp: int) -> str | None:
    """Why a TP group of `tp` cannot hold this model, or None when it can."""
    if tp < 1:
        return f"must be >= 1, got {tp}"
    if args.n_heads % tp:
        return f"does not divide the {args.n_heads} query heads"
    if args.ffn_dim % tp:
        return f"does not divide the SwiGLU width {args.ffn_dim}"
    if args.n_kv_heads % tp and tp % args.n_kv_heads:
        return f"neither divides nor is a multiple of the {args.n_kv_heads} K/V heads"
    return None


def tensor_parallel_args(args: ModelArgs, tp: int) -> ModelArgs:
    """The shapes one rank of a TP group of `tp` holds (a model of these args is its shard)."""
    problem = tensor_parallel_problem(args, tp)
    if problem:
        raise ValueError(f"tensor parallelism {tp} {problem}")
    return dataclasses.replace(
        args, n_heads=args.n_heads // tp, n_kv_heads=max(1, args.n_kv_heads // tp), ffn_dim=args.ffn_dim // tp
    )


def tensor_parallel_layout(
    name: str, args: ModelArgs, tp: int, tp_rank: int
) -> tuple[tuple[Placement, ...], tuple[int, ...], tuple[int, ...]]:
    """(placements, mesh shape, coordinate) of parameter `name` on rank tp_rank of a TP group:
    where its shard sits in the whole tensor, in DTensor's terms (torch.chunk splits). Replicated
    K/V heads are a 2-D mesh (K/V heads, ranks sharing one) with the second dimension replicated.
    LoRA's adapters (model/lora.py) follow their layer's split: B [out, r] is split as a
    column-parallel weight's rows, A [r, in] as a row-parallel weight's columns; each is whole
    otherwise (the product B·A is then the layer's shard of the update)."""
    module, _, leaf = name.rpartition(".")
    if leaf in ("lora_A", "lora_B"):
        placements, mesh_shape, coordinate = tensor_parallel_layout(f"{module}.weight", args, tp, tp_rank)
        split_dim = 1 if leaf == "lora_A" else 0
        if not any(isinstance(p, Shard) and p.dim == split_dim for p in placements):
            return (Replicate(),), (tp,), (tp_rank,)
        return placements, mesh_shape, coordinate
    if any(key in name for key in _COLUMN_PARALLEL):
        return (Shard(0),), (tp,), (tp_rank,)
    if any(key in name for key in _KV):
        if args.n_kv_heads >= tp:
            return (Shard(0),), (tp,), (tp_rank,)
        share = tp // args.n_kv_heads
        return (Shard(0), Replicate()), (args.n_kv_heads, share), (tp_rank // share, tp_rank % share)
    if any(name.endswith(key) for key in _ROW_PARALLEL):
        return (Shard(1),), (tp,), (tp_rank,)
    return (Replicate(),), (tp,), (tp_rank,)


def apply_tensor_parallel(model: Transformer, group: dist.ProcessGroup) -> None:
    """Sum the row-parallel outputs (attention's wo, SwiGLU's w2) of a TP shard over `group`, in
    place, so every rank carries the whole residual stream. `model` holds this rank's shard."""

    def all_reduce(module: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output

    for block in model.layers:
        block.attention.wo.register_forward_hook(all_reduce)
        block.feed_forward.w2.register_forward_hook(all_reduce)
