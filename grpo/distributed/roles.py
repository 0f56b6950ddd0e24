"""Who does what: the generator and trainer ranks of one launch, their meshes and process groups.

split:     ranks [0, g) generate, ranks [g, world) train. The trainer ranks get a DeviceMesh (FSDP2
           runs over it), consecutive generator ranks form tensor-parallel groups of generator_tp,
           one engine each, and episodes, weights and control messages each get their own process
           groups, so one kind of traffic never queues behind another.
colocated: every rank generates and then trains; one mesh over the world.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class Roles:
    """This rank's role and the communication it needs. trainer_mesh is None on generator ranks."""

    mode: str
    rank: int
    generator_ranks: list[int]
    trainer_ranks: list[int]
    trainer_mesh: DeviceMesh | None
    # all ranks: episodes travel generator -> trainer point to point here
    episode_group: dist.ProcessGroup | None
    # all ranks: step-level decisions (stop, errors) broadcast by the first trainer rank
    control_group: dist.ProcessGroup | None
    # weight_groups[t] joins trainer_ranks[t] with every generator rank
    weight_groups: list[dist.ProcessGroup]
    # generator ranks per engine (tensor parallelism); consecutive generator ranks form a group
    generator_tp: int = 1
    # this generator's TP group (None without tensor parallelism and on trainer ranks)
    tp_group: dist.ProcessGroup | None = None

    @property
    def is_generator(self) -> bool:
        return self.rank in self.generator_ranks

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainer_ranks

    @property
    def split(self) -> bool:
        return self.mode == "split"

    @property
    def tp_rank(self) -> int:
        """This generator's rank within its TP group."""
        return self.generator_ranks.index(self.rank) % self.generator_tp

    @property
    def engines(self) -> int:
        """Engines side by side (data parallel): generator ranks / generator_tp."""
        return len(self.generator_ranks) // self.generator_tp

    @property
    def engine_index(self) -> int:
        """Which engine this generator rank is part of."""
        return self.generator_ranks.index(self.rank) // self.generator_tp

    @property
    def reports_episodes(self) -> bool:
        """Whether this rank hands its engine's episodes on: the first rank of each TP group (the
        others drew the same tokens)."""
        return self.is_generator and self.tp_rank == 0

    @property
    def leader(self) -> int:
        """The rank that logs metrics and writes files: the first trainer rank."""
        return self.trainer_ranks[0]


def build_roles(
    mode: str, generator_ranks: int, device: torch.device, timeout: timedelta | None = None, generator_tp: int = 1
) -> Roles:
    """Split the launched world (process group already initialised) into roles.

    Every rank calls this with the same arguments; process groups are created in the same order
    on all ranks, as torch.distributed requires. Layouts are validated with the config, before
    any process group exists; the checks here guard direct callers. `timeout` bounds every
    collective of the new groups (default: torch's).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "colocated":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("trainer",))
        everyone = list(range(world))
        return Roles(mode, rank, everyone, everyone, mesh, None, None, [])
    if mode != "split":
        raise ValueError(f"unknown parallelism.mode {mode!r}; expected 'split' or 'colocated'")
    if not 1 <= generator_ranks < world:
        raise ValueError(
            f"parallelism.generator_ranks = {generator_ranks} with world size {world}: "
            f"set it between 1 and {world - 1}"
        )
    if generator_ranks % generator_tp:
        raise ValueError(f"parallelism.generator_tp = {generator_tp} does not divide {generator_ranks} generator ranks")
    generators = list(range(generator_ranks))
    trainers = list(range(generator_ranks, world))
    trainer_group = dist.new_group(trainers, timeout=timeout)
    episode_group = dist.new_group(list(range(world)), timeout=timeout)
    control_group = dist.new_group(list(range(world)), timeout=timeout)
    weight_groups = [dist.new_group([t, *generators], timeout=timeout) for t in trainers]
    tp_group = None
    if generator_tp > 1:
        for start in range(0, generator_ranks, generator_tp):
            group = dist.new_group(generators[start : start + generator_tp], timeout=timeout)
            if start <= rank < start + generator_tp:
                tp_group = group
    trainer_mesh = None
    if rank in trainers:
        trainer_mesh = DeviceMesh.from_group(trainer_group, device.type, mesh_dim_names=("trainer",))
    return Roles(
        mode, rank, generators, trainers, trainer_mesh, episode_group, control_group, weight_groups, generator_tp, tp_group
    )
