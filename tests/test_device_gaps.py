"""The profile report's device-idle lines: gaps between kernels found in a hand-built Chrome trace,
each named by the host operation that launched the kernel ending it."""

from __future__ import annotations

from grpo.observe.gaps import describe, device_idle


def op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def launch(ts, correlation, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
            "args": {"correlation": correlation}}


def kernel(name, ts, dur, correlation):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": correlation}}


def trace():
    """Device, in µs from 1000: mm 0-100, overlapped by a copy 50-120; a 30 µs gap; norm 150-200;
    a 500 µs gap while the host packs the next micro-batch; mm 700-800; a 10 µs gap (below the
    threshold); add 810-820, launched from the backward thread (tid 2)."""
    return {"traceEvents": [
        op("aten::mm", 990, 20), launch(995, 1), kernel("gemm", 1000, 100, 1),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1050, "dur": 70, "tid": 8, "args": {"correlation": 2}},
        op("aten::rms_norm", 1100, 40), op("aten::empty", 1120, 5), launch(1130, 3), kernel("norm", 1150, 50, 3),
        op("pack_micro_batch", 1200, 480), op("aten::mm", 1690, 15), launch(1695, 4), kernel("gemm", 1700, 100, 4),
        op("autograd::engine::evaluate_function: AddBackward0", 1790, 30, tid=2), launch(1800, 5, tid=2),
        kernel("add", 1810, 10, 5),
        {"ph": "X", "cat": "kernel", "name": "graph kernel", "ts": 1815, "dur": 1, "tid": 7, "args": {"correlation": 99}},
    ]}


def test_gaps_are_found_longest_first_with_the_op_that_ended_each():
    idle = device_idle(trace(), min_gap_us=20.0)
    # Busy: 0-120 (the copy overlaps the mm), 150-200, 700-800, 810-820 and 815-816 inside it.
    assert idle.busy_us == 120 + 50 + 100 + 10
    assert idle.idle_us == 30 + 500
    assert [(g.start_ms, g.length_us, g.next_kernel, g.launched_in) for g in idle.gaps] == [
        (0.2, 500, "gemm", "aten::mm"),  # the innermost op around the launch, not pack_micro_batch
        (0.12, 30, "norm", "aten::rms_norm"),  # aten::empty ended before the launch
    ]


def test_the_threshold_and_the_count_of_gaps_described():
    idle = device_idle(trace(), min_gap_us=5.0, longest=2)
    assert idle.idle_us == 30 + 500 + 10
    assert [g.length_us for g in idle.gaps] == [500, 30]
    assert device_idle(trace(), min_gap_us=600.0).gaps == []


def test_a_launch_on_another_thread_is_matched_to_that_threads_op():
    idle = device_idle(trace(), min_gap_us=5.0)
    assert [g.launched_in for g in idle.gaps if g.next_kernel == "add"] == ["autograd::engine::evaluate_function: AddBackward0"]


def test_a_kernel_whose_launch_is_not_in_the_trace_is_described_so():
    events = [kernel("a", 0, 10, 1), kernel("b", 100, 10, 2)]
    idle = device_idle({"traceEvents": events})
    assert idle.gaps[0].launched_in == ""
    text = describe(idle, wall_ms=1.0)
    assert "0.1 ms of 1.0 ms wall" in text and "(launch not in trace)" in text


def test_a_trace_without_device_work_says_so():
    idle = device_idle({"traceEvents": [op("aten::mm", 0, 10)]})
    assert (idle.busy_us, idle.idle_us, idle.gaps) == (0.0, 0.0, [])
    assert describe(idle, wall_ms=5.0) == "device idle: no gap between kernels in this trace\n"
