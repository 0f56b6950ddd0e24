"""Trainer -> generator weight sync, in memory, in fixed-size buckets.

The trainer's parameters are DTensors sharded by FSDP2 over the trainer mesh; the generator's are
laid out over the generator mesh by their own placements: replicated, or the tensor-parallel shards
of model/parallelize.py's plan (column and row splits, K/V heads replicated within a group).
`redistribute` cannot cross meshes, so the route is computed explicitly: every shard is a box of
index ranges derived from (global shape, placements, mesh shape, coordinate) with `torch.chunk`
semantics, the same rule FSDP2 uses for uneven first dimensions. Both sides compute the same bucket
plan from parameter shapes alone, so no metadata travels at sync time.

Each trainer rank casts its own shards to the generator dtype into a bucket buffer and broadcasts
it over a process group that joins it with every generator rank; each generator copies the
intersection of every received box with its own box into the engine's existing parameters. Two
buffers alternate on each side, so packing, the transfer and unpacking of consecutive buckets
overlap; no rank holds more than two buckets beyond its own shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

Box = tuple[tuple[int, int], ...]


def shard_box(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coordinate: Sequence[int]) -> Box:
    """Index ranges [start, stop) per dimension held by the rank at `coordinate` of the mesh.

    Shard(d) splits dimension d as torch.chunk does: chunks of ceil(n / k), the last ones possibly
    shorter or empty. Placements apply in mesh-dimension order, each splitting what the previous left.
    """
    box = [(0, n) for n in shape]
    for placement, size, index in zip(placements, mesh_shape, coordinate):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"weight sync supports Shard and Replicate placements, not {placement}")
        start, stop = box[placement.dim]
        chunk = math.ceil((stop - start) / size)
        lo = min(start + index * chunk, stop)
        box[placement.dim] = (lo, min(lo + chunk, stop))
    return tuple(box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of a and b, None if empty."""
    common = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in common) else common


def _numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """`box` as slices into a tensor whose element [0, ...] sits at `origin`'s start."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _bucket_numel(bucket: list[BucketEntry]) -> int:
    last = bucket[-1]
    return last.offset + _numel(last.box)


@dataclass(frozen=True)
class BucketEntry:
    """One trainer shard (or a piece of it, if larger than a bucket) inside a bucket."""

    name: str
    box: Box
    offset: int


def plan_buckets(
    shapes: dict[str, Sequence[int]],
    trainer_placements: Sequence[Placement],
    num_trainers: int,
    bucket_numel: int,
) -> list[list[list[BucketEntry]]]:
    """For each trainer rank, its buckets: lists of entries packed up to bucket_numel elements.

    Parameters are taken in `shapes` order; a shard larger than a bucket is cut along its first
    dimension into pieces that fit (a single row larger than a bucket gets a bucket of its own).
    """
    plans = []
    for rank in range(num_trainers):
        buckets: list[list[BucketEntry]] = [[]]
        used = 0
        for name, shape in shapes.items():
            box = shard_box(shape, trainer_placements, (num_trainers,), (rank,))
            if _numel(box) == 0:
                continue
            row_numel = _numel(box[1:])
            rows_per_piece = max(1, bucket_numel // max(row_numel, 1))
            (start, stop), rest = box[0], box[1:]
            for lo in range(start, stop, rows_per_piece):
                piece = ((lo, min(lo + rows_per_piece, stop)), *rest)
                size = _numel(piece)
                if used and used + size > bucket_numel:
                    buckets.append([])
                    used = 0
                buckets[-1].append(BucketEntry(name, piece, used))
                used += size
        plans.append([b for b in buckets if b])
    return plans


class WeightSync:
    """One side of the sync: a trainer rank sends its shards, a generator rank receives everything.

    trainer_ranks: global ranks of the trainer mesh, in mesh order; groups[t]: the process group
    joining trainer rank trainer_ranks[t] with every generator rank (created on all ranks).
    generator_placements / generator_mesh_shape / generator_coordinate describe this generator's
    layout (Replicate: it needs every element); generator_layout(name), when given, returns that
    triple per parameter instead (a tensor-parallel engine: model/parallelize.py's plan).
    """

    def __init__(
        self,
        shapes: dict[str, Sequence[int]],
        trainer_ranks: list[int],
        groups: list[dist.ProcessGroup],
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int,
        generator_placements: Sequence[Placement] = (Replicate(),),
        generator_mesh_shape: Sequence[int] = (1,),
        generator_coordinate: Sequence[int] = (0,),
        generator_layout: Callable[[str], tuple[Sequence[Placement], Sequence[int], Sequence[int]]] | None = None,
    ):
        self.trainer_ranks, self.groups = trainer_ranks, groups
        self.dtype, self.device = dtype, device
        bucket_numel = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        self.plans = plan_buckets(shapes, (Shard(0),), len(trainer_ranks), bucket_numel)
        self.bucket_numel = max((_bucket_numel(b) for p in self.plans for b in p), default=1)
        uniform = (generator_placements, generator_mesh_shape, generator_coordinate)
        self._gen_boxes = {
            name: shard_box(shape, *(generator_layout(name) if generator_layout else uniform))
            for name, shape in shapes.items()
        }
        self.total_bytes = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()

    def send(self, params: dict[str, torch.Tensor]) -> None:
        """Trainer side: broadcast this rank's shards of `params` (FSDP2 DTensors), bucket by bucket.

        Two bucket buffers alternate: bucket i + 1 is packed while bucket i is on the wire, and a
        buffer is refilled only once its last broadcast is done."""
        me = self.trainer_ranks.index(dist.get_rank())
        plan = self.plans[me]
        buffers = [torch.empty(self.bucket_numel, dtype=self.dtype, device=self.device) for _ in range(min(2, len(plan)))]
        in_flight: list[dist.Work | None] = [None] * len(buffers)
        for i, bucket in enumerate(plan):
            slot = i % len(buffers)
            if in_flight[slot] is not None:
                in_flight[slot].wait()
            buffer = buffers[slot]
            for entry in bucket:
                param = params[entry.name]
                local = param.to_local() if isinstance(param, DTensor) else param
                own = shard_box(param.shape, (Shard(0),), (len(self.trainer_ranks),), (me,))
                piece = local.detach()[_slices(entry.box, own)]
                buffer[entry.offset : entry.offset + piece.numel()].view(piece.shape).copy_(piece)
            in_flight[slot] = dist.broadcast(buffer[: _bucket_numel(bucket)], src=dist.get_rank(),
                                             group=self.groups[me], async_op=True)
        for work in in_flight:
            if work is not None:
                work.wait()

    def receive(self, engine, version: int) -> None:
        """Generator side: receive every trainer rank's buckets and write them into `engine`.

        Two bucket buffers alternate: bucket i + 1 arrives while bucket i is unpacked. Buckets
        of different trainer ranks travel on different groups; those are not overlapped, so no
        two groups' collectives are ever in flight at once on this rank."""
        schedule = [(t, bucket) for t, plan in enumerate(self.plans) for bucket in plan]
        buffers = [torch.empty(self.bucket_numel, dtype=self.dtype, device=self.device)
                   for _ in range(min(2, len(schedule)))]

        def post(i: int) -> dist.Work:
            t, bucket = schedule[i]
            return dist.broadcast(buffers[i % len(buffers)][: _bucket_numel(bucket)], src=self.trainer_ranks[t],
                                  group=self.groups[t], async_op=True)

        work = post(0) if schedule else None
        for i, (t, bucket) in enumerate(schedule):
            work.wait()
            overlap = i + 1 < len(schedule) and schedule[i + 1][0] == t
            work = post(i + 1) if overlap else None
            engine.update_weights([self._unpack(bucket, buffers[i % len(buffers)])], version)
            if not overlap and i + 1 < len(schedule):
                work = post(i + 1)

    def _unpack(self, bucket: list[BucketEntry], buffer: torch.Tensor):
        for entry in bucket:
            mine = self._gen_boxes[entry.name]
            common = intersect(entry.box, mine)
            if common is None:
                continue
            shape = tuple(hi - lo for lo, hi in entry.box)
            received = buffer[entry.offset : entry.offset + _numel(entry.box)].view(shape)
            yield entry.name, _slices(common, mine), received[_slices(common, entry.box)]
