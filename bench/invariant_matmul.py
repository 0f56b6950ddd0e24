"""The batch-invariant matmul (model/invariant_kernels.py) against cuBLAS (`F.linear`) in the same
process, on the projection shapes of SmolLM2-135M and Qwen3-0.6B, for decode-sized and
training-sized row counts, with the tile `matmul_tiles` chooses; then whether other tile settings
give the same bits. One JSON line per case.

    python3 bench/invariant_matmul.py [--reps 50]

Times are medians of --reps CUDA-event timings of a CUDA graph of 10 calls, per call: the device's
time without the host's launches, which decode's graphs do not pay either. `same_bits_as_chosen_tiles`
says, per alternative (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), whether its output equals the
chosen tile's bitwise: the choice by shape keeps a row's bits only while every alternative does at
every row count (the tensor-core instruction, not the tiling, fixes each element's summation
order); `alternative_ms` is each alternative's time, so the line shows how good the choice is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import commit  # noqa: E402
from model import invariant_kernels as kernels  # noqa: E402

# (name, N, K) per model: fused q/k/v, attention output, fused SwiGLU gate/up, SwiGLU down, head.
SHAPES = {
    "smollm2": [("qkv", 960, 576), ("wo", 576, 576), ("w13", 3072, 576), ("w2", 576, 1536), ("head", 49152, 576)],
    "qwen3": [("qkv", 4096, 1024), ("wo", 1024, 2048), ("w13", 6144, 1024), ("w2", 1024, 3072), ("head", 151936, 1024)],
}
ROWS = (64, 256, 512, 2048, 16384)
CALLS_PER_GRAPH = 10
ALTERNATIVE_TILES = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (128, 64, 32, 4, 4), (128, 256, 64, 8, 3),
                     (64, 32, 128, 4, 4), (64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3)]


def median_ms(fn, reps: int) -> float:
    """Median device time of one call of fn, from CUDA graphs of CALLS_PER_GRAPH calls (as the
    engine's decode replays its matmuls), so the host's launch time is not counted."""
    for _ in range(3):
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS_PER_GRAPH)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    opts = parser.parse_args()
    base = dict(bench="invariant_matmul", commit=commit(), device=torch.cuda.get_device_name(),
                torch=torch.__version__)
    torch.manual_seed(0)
    for model, shapes in SHAPES.items():
        for name, N, K in shapes:
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
            for M in ROWS:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                out_dtype = torch.float32 if name == "head" else torch.bfloat16
                cublas = median_ms(lambda: F.linear(x, w), opts.reps)
                ours = median_ms(lambda: kernels.matmul(x, w, None, out_dtype), opts.reps)
                reference = kernels.matmul(x, w, None, out_dtype)
                same, alternative_ms = {}, {}
                for tiles in ALTERNATIVE_TILES:
                    same[str(tiles)] = torch.equal(kernels.matmul(x, w, None, out_dtype, tiles), reference)
                    alternative_ms[str(tiles)] = round(
                        median_ms(lambda: kernels.matmul(x, w, None, out_dtype, tiles), opts.reps), 4)
                print(json.dumps(dict(base, model=model, layer=name, M=M, N=N, K=K,
                                      tiles=kernels.matmul_tiles(M, N, x.device), cublas_ms=round(cublas, 4),
                                      invariant_ms=round(ours, 4), slowdown=round(ours / cublas, 2),
                                      tflops=round(2 * M * N * K / ours / 1e9, 1),
                                      same_bits_as_chosen_tiles=same, alternative_ms=alternative_ms)), flush=True)

if __name__ == "__main__":
    main()
