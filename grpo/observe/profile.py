"""One RL step under torch.profiler, phase by phase (`metrics.profile_step`).

Each phase of the chosen step (generate, score, train, weight_sync) runs under its own profiler, so
each gets its own kernel table: <job.output_dir>/profile/step<N>_rank<R>_<phase>.txt, headed by
the phase's wall time and the device's busy time in it (busy well below wall: the host sets the
pace) and, on CUDA, the longest gaps between kernels with the host operation that ended each
(grpo/observe/gaps.py, read back from the trace); and a gzipped Chrome trace of the same events
next to it (.json.gz, for Perfetto or chrome://tracing; a generation phase holds about 10^5 kernels).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from grpo.observe.gaps import describe, device_idle

# Kernel-table rows written per phase: enough to cover every kernel of a decoder block and the head.
TABLE_ROWS = 60


class StepProfiler:
    """Profiles the phases of one step (`step`); inert on every other step."""

    def __init__(self, output_dir: str | Path, profile_step: int, rank: int, device: torch.device):
        self.folder = Path(output_dir) / "profile"
        self.profile_step, self.rank, self.device = profile_step, rank, device

    @contextlib.contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        """Profile the block as phase `name` of `step` when step is the profiled one."""
        if step != self.profile_step:
            yield
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - start
        write_report(prof, self.folder / f"step{step}_rank{self.rank}_{name}", name, wall, self.device.type == "cuda")


def write_report(prof: profile, stem: Path, name: str, wall: float, on_cuda: bool, rows: int = TABLE_ROWS) -> None:
    """`prof`'s kernel table to stem.txt, headed by the wall time and how busy the device was, and
    its trace to stem.json.gz."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    if on_cuda:
        # Kernels only, not the host ops that launched them.
        busy = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / 1e6
        header = f"{name}: wall {wall * 1e3:.1f} ms, device busy {busy * 1e3:.1f} ms ({busy / wall:.0%})\n"
        sort_by = "self_cuda_time_total"
    else:
        header = f"{name}: wall {wall * 1e3:.1f} ms (CPU: host ops only)\n"
        sort_by = "self_cpu_time_total"
    table = averages.table(sort_by=sort_by, row_limit=rows, max_name_column_width=90)
    trace = stem.with_name(stem.name + ".json.gz")
    prof.export_chrome_trace(str(trace))
    if on_cuda:
        with gzip.open(trace, "rt", encoding="utf-8") as f:
            header += describe(device_idle(json.load(f)), wall * 1e3)
    stem.with_name(stem.name + ".txt").write_text(header + table, encoding="utf-8")
