"""The decode step's matmuls, one by one: as the engine runs them (a [1, M, K] activation through the
compiled block halves; the head with fp32 output) against a plain 2-D `F.linear` with bf16 output, as
vLLM runs them, in the same run, each timed inside a CUDA graph. One JSON line per (matmul, batch,
variant), with the cuBLAS kernel it ran and the bandwidth achieved on the weight's bytes.

    python3 bench/decode_matmuls.py [--shape 8b] [--batches 64,256] [--matmuls qkv,wo,w13,w2,head] [--autotune]

Why: at the Qwen3-8B shape, batch 256, the fourth GPU session's profile put 2.4 ms more of matmul
time in our decode step than in vLLM's, in two kernel tile shapes that only our step ran
(bench/RESULTS.md). This says which matmul picks them and what the choice costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.provenance import commit  # noqa: E402
from bench.vllm_engines import SHAPES, VOCAB  # noqa: E402


def matmuls(shape: dict) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of each matmul of one decode step (per layer, and the head)."""
    dim, heads, kv, hd, ffn = shape["dim"], shape["n_heads"], shape["n_kv_heads"], shape["head_dim"], shape["ffn_dim"]
    return {"qkv": (dim, (heads + 2 * kv) * hd), "wo": (heads * hd, dim), "w13": (dim, 2 * ffn),
            "w2": (ffn, dim), "head": (dim, VOCAB)}


def variants(name: str, autotune: bool) -> dict:
    """variant -> fn(x [M, K], w [N, K]). `plain` is vLLM's call; `as_decode` and `fp32_out` the
    engine's; `autotuned` Inductor's pick for this one shape among cuBLAS and its Triton templates
    (max-autotune), which the engine does not use."""
    compiled = torch.compile(lambda x, w: F.linear(x, w), dynamic=True)
    out = {"plain": lambda x, w: F.linear(x, w),
           "as_decode": lambda x, w: compiled(x[None], w)}
    if name == "head":
        out["fp32_out"] = lambda x, w: torch.mm(x, w.t(), out_dtype=torch.float32)
    if autotune:
        out["autotuned"] = torch.compile(lambda x, w: F.linear(x, w), dynamic=False, mode="max-autotune-no-cudagraphs")
    return out


def graph_time_us(fn, reps: int) -> float:
    """Microseconds per call of `fn`, `reps` calls captured in one CUDA graph and replayed, as the
    engine's decode step runs them: GPU time only. (Timed from Python, a compiled call's host
    dispatch outlasts these kernels and the figure would be the host's.)"""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one call launches (a cuBLAS kernel's name carries its tile shape)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--matmuls", default="qkv,wo,w13,w2,head")
    parser.add_argument("--autotune", action="store_true", help="add Inductor's max-autotune pick for each shape")
    opts = parser.parse_args()
    if opts.autotune:
        # One compiled graph per (matmul, batch) shape.
        torch._dynamo.config.recompile_limit = 64
    device = torch.device("cuda")
    shape = SHAPES[opts.shape]
    base = dict(bench="decode_matmuls", device=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit(),
                shape=opts.shape)
    for name, (k, n) in matmuls(shape).items():
        if name not in opts.matmuls.split(","):
            continue
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        for batch in [int(b) for b in opts.batches.split(",")]:
            x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
            times = {}
            for variant, fn in variants(name, opts.autotune).items():
                call = lambda: fn(x, w)  # noqa: E731
                times[variant] = graph_time_us(call, opts.reps)
                print(json.dumps(dict(base, matmul=name, k=k, n=n, batch=batch, variant=variant,
                                      us=round(times[variant], 1),
                                      weight_gbps=round(w.numel() * 2 / times[variant] / 1e3, 1),
                                      kernels=kernel_names(call))), flush=True)
            worst = max(times, key=times.get)
            print(json.dumps(dict(base, matmul=name, batch=batch, slowest=worst,
                                  slowest_over_plain=round(times[worst] / times["plain"], 3))), flush=True)


if __name__ == "__main__":
    main()
