"""The one all-reduce of named numbers that the run, the trainer and its statistics share.

Metrics are not reduced here: `grpo.observe.metrics.reduce_across` combines each key by its own
rule (weighted mean, max or sum) from one all_gather, so that every rank reduces the same table in
the same order and a rank of weight 0 cannot spread its NaN; an all-reduce guarantees neither.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

import torch
import torch.distributed as dist

Key = TypeVar("Key", bound=Hashable)

_CPU = torch.device("cpu")


def all_reduce(
    values: Mapping[Key, float | torch.Tensor],
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    device: torch.device = _CPU,
) -> dict[Key, float]:
    """Reduce `values` with `op` over every rank of `group` (None: the whole launch) in one
    collective; returns the reduced values under the same keys, in the same order.

    Every rank must pass the same keys in the same order (it is not checked). Values are python
    numbers or 0-d tensors; they are reduced as one float64 vector on `device`, so each value keeps
    float64's precision whatever it arrived as. `device` picks the backend under the launch's
    "cuda:nccl,cpu:gloo" group: the CPU (the default) for gloo, the rank's CUDA device for NCCL,
    which also spares a copy to the host before the reduction when the values are CUDA tensors.
    """
    items = list(values.values())
    if any(isinstance(v, torch.Tensor) for v in items):
        tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in items])
    else:
        tensor = torch.tensor(items, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return dict(zip(values, tensor.tolist()))
