"""Where the device waits: the idle gaps between its kernels in a profiler's Chrome trace, each with
the host operation that launched the kernel after it.

A phase whose device is busy well below its wall time is paced by the host; the kernel table says
how long each kernel ran, not when the device sat idle nor what the host was doing then. A gap
ends when the host launches the next kernel, so the operation around that launch is what the host
was busy with (or waiting in) while the device had nothing to do.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Trace event categories that occupy the device.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Categories of the host calls that put work on the device (they carry its correlation id).
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass
class Gap:
    """One stretch with no device work between two device events."""

    start_ms: float  # from the phase's first device event
    length_us: float
    next_kernel: str  # the device event that ended the gap
    launched_in: str  # the innermost host operation around that event's launch ("" if the trace has none)


@dataclass
class DeviceIdle:
    """The device's busy and idle time between its first and last event, and its longest gaps."""

    busy_us: float
    idle_us: float  # in gaps of at least min_gap_us
    gaps: list[Gap]  # longest first
    min_gap_us: float


def device_idle(trace: dict, min_gap_us: float = 20.0, longest: int = 10) -> DeviceIdle:
    """The gaps of at least min_gap_us between the device events of `trace` (a Chrome trace as
    torch.profiler exports it), the `longest` of them described."""
    events = trace.get("traceEvents", [])
    device = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"]
    )
    if not device:
        return DeviceIdle(0.0, 0.0, [], min_gap_us)
    origin = device[0]["ts"]
    busy = idle = 0.0
    end, found = device[0]["ts"], []
    for event in device:
        start = event["ts"]
        if start - end >= min_gap_us:
            idle += start - end
            found.append((start - end, end, event))
        # Only the part past what earlier events already covered (copies overlap kernels).
        busy += max(0.0, start + event["dur"] - max(start, end))
        end = max(end, start + event["dur"])
    found.sort(key=lambda gap: -gap[0])
    launcher = _Launchers(events)
    gaps = [
        Gap((gap_start - origin) / 1e3, length, event["name"], launcher.op_around(event))
        for length, gap_start, event in found[:longest]
    ]
    return DeviceIdle(busy, idle, gaps, min_gap_us)


class _Launchers:
    """The host operation around each device event's launch, found through its correlation id."""

    def __init__(self, events: list[dict]):
        self.launch_at = {
            (e.get("args") or {}).get("correlation"): (e["ts"], e.get("tid"))
            for e in events
            if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES
        }
        ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
        self.ops, self.starts = ops, [e["ts"] for e in ops]

    def op_around(self, device_event: dict) -> str:
        """The innermost host operation (latest started, still running) on the launching thread."""
        launch = self.launch_at.get((device_event.get("args") or {}).get("correlation"))
        if launch is None:
            return ""
        at, thread = launch
        for i in range(bisect.bisect_right(self.starts, at) - 1, -1, -1):
            op = self.ops[i]
            if op.get("tid") == thread and op["ts"] + op["dur"] >= at:
                return op["name"]
        return ""


def describe(idle: DeviceIdle, wall_ms: float) -> str:
    """A few lines for a profile report's header."""
    if not idle.gaps:
        return "device idle: no gap between kernels in this trace\n"
    lines = [
        f"device idle: {idle.idle_us / 1e3:.1f} ms of {wall_ms:.1f} ms wall in gaps of {idle.min_gap_us:g} µs or more;"
        " the longest (from the first kernel: the gap, the kernel that ended it, the host op that launched it):"
    ]
    for gap in idle.gaps:
        lines.append(f"  +{gap.start_ms:9.2f} ms  {gap.length_us:9.1f} µs  {gap.next_kernel[:70]}  <- "
                     f"{gap.launched_in or '(launch not in trace)'}")
    return "\n".join(lines) + "\n"
