"""What travels trainer -> generator and when: the whole policy at the start of a run (and of a
resume), then after each step what the step changed. With LoRA that is the adapters and the extra
trainable parameters only: the frozen base reached the engine once, which merges each step's
adapters into its own copy of it (grpo/engine/adapters.py)."""

from __future__ import annotations

import functools
import math

import torch

from grpo.distributed.roles import Roles
from grpo.distributed.weight_sync import WeightSync
from model import ModelArgs
from model.lora import LoRASpec, adapter_shapes
from model.parallelize import tensor_parallel_layout

Shapes = dict[str, tuple[int, ...]]


class WeightPush:
    """The two transfers of one rank: `full` (every parameter, adapters included) and `step` (what
    a training step changes); on split roles each is a WeightSync, colocated ranks copy in process."""

    def __init__(self, shapes: Shapes, trained: Shapes, args: ModelArgs, lora: LoRASpec | None, roles: Roles,
                 dtype: torch.dtype, device: torch.device, bucket_bytes: int):
        """shapes: the plain model's parameter shapes; trained: those of what a step changes
        (model/lora.py trained_shapes with LoRA, else shapes)."""
        self.lora = lora
        self.full_shapes = {**shapes, **adapter_shapes(shapes, lora, args.n_layers)} if lora else shapes
        self.step_shapes = trained
        size = torch.empty((), dtype=dtype).element_size()
        # Bytes one step's sync moves (in the engine's dtype): reported as weight_sync/bytes; and the
        # whole policy's, which goes over at the start (weight_sync/full_bytes).
        self.step_bytes = sum(math.prod(s) for s in self.step_shapes.values()) * size
        self.full_bytes = sum(math.prod(s) for s in self.full_shapes.values()) * size
        self.full, self.step = None, None
        if roles.split:
            layout = None
            if roles.is_generator and roles.generator_tp > 1:
                layout = functools.partial(tensor_parallel_layout, args=args, tp=roles.generator_tp, tp_rank=roles.tp_rank)
            build = functools.partial(WeightSync, trainer_ranks=roles.trainer_ranks, groups=roles.weight_groups,
                                      dtype=dtype, device=device, bucket_bytes=bucket_bytes, generator_layout=layout)
            self.full = build(self.full_shapes)
            self.step = build(self.step_shapes) if lora else self.full

    def names(self, full: bool) -> set[str] | None:
        """The parameter names a colocated refresh copies (None: all)."""
        return None if full or self.lora is None else set(self.step_shapes)

    def sync(self, full: bool) -> WeightSync:
        """The split-role transfer to run."""
        return self.full if full else self.step
