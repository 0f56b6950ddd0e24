"""Per-step training statistics kept on the device and reduced over the trainer ranks once, at the
end of the step: reading them per micro-batch would make the host wait for the device every time."""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo.distributed.collectives import all_reduce
from grpo.train.loss import SUMMED_STATS


class Tally:
    """Per-step statistics as device scalars: sums and maxima, reduced over ranks once at the end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def max(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.maxima[key] = torch.maximum(self.maxima[key], value) if key in self.maxima else value

    def global_values(self, group) -> tuple[dict[str, float], dict[str, float]]:
        """(sums, maxima) over every rank of group. Collective: every rank must have tallied the
        same keys (a rank with no micro-batches has none, and then takes part with zeros)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = {k: self.sums.get(k, zero) for k in (*SUMMED_STATS, "diff_sum", "diff_exact", "packed_tokens")}
        maxima = {k: self.maxima.get(k, zero) for k in ("ratio_max", "diff_max")}
        return (
            all_reduce(sums, group, device=self.device),
            all_reduce(maxima, group, dist.ReduceOp.MAX, device=self.device),
        )
