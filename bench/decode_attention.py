"""Decode attention over KV-cache slots: our Triton kernel against PyTorch's flash-attention kernel
(variable-length form, per-row slot offsets + `seqused_k`), in the same run. One JSON line per batch.

    python3 bench/decode_attention.py [--batches 64,256] [--live 256] [--slot 384] [--sweep 4x2,4x3,8x2]

Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128), bf16; every row attends
over `--live` keys of its own slot. Reports microseconds per call and the achieved bandwidth
counting the live K/V bytes read once.

`--sweep WARPSxSTAGES,...`: our kernel alone under each launch configuration (warps per program,
software-pipelining stages), each call timed inside a CUDA graph as the engine replays it, so the
host's launch cost is left out. One JSON line per batch and configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode_matmuls import graph_time_us  # noqa: E402
from model import invariant_kernels  # noqa: E402
from model.invariant_kernels import slot_attention  # noqa: E402

H, HKV, D = 16, 8, 128


def flash_varlen(q, k_cache, v_cache, slots, lengths):
    """The same attention through aten._flash_attention_forward, one query row per sequence."""
    S, L = k_cache.shape[:2]
    starts = torch.cat((slots * L, slots.new_full((1,), S * L))).to(torch.int32)
    cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    flat_k, flat_v = k_cache.view(S * L, HKV, D), v_cache.view(S * L, HKV, D)
    return torch.ops.aten._flash_attention_forward(
        q, flat_k, flat_v, cu_q, starts, 1, L, 0.0, False, False, seqused_k=lengths
    )[0]


def time_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def sweep(configs: str, batch: int, q, k_cache, v_cache, slots, lengths, live_bytes: int, row: dict) -> None:
    """One line per WARPSxSTAGES configuration of our kernel (module constants, restored after)."""
    saved = invariant_kernels.ATTENTION_WARPS, invariant_kernels.ATTENTION_DECODE_STAGES
    reference = slot_attention(q, k_cache, v_cache, slots, lengths)
    try:
        for config in configs.split(","):
            warps, stages = (int(x) for x in config.split("x"))
            invariant_kernels.ATTENTION_WARPS, invariant_kernels.ATTENTION_DECODE_STAGES = warps, stages
            out = slot_attention(q, k_cache, v_cache, slots, lengths)
            us = graph_time_us(lambda: slot_attention(q, k_cache, v_cache, slots, lengths), reps=50)
            print(json.dumps({**row, "warps": warps, "stages": stages, "graph_us": round(us, 2),
                              "GBps": round(live_bytes / us / 1e3), "same_bits": bool(torch.equal(out, reference))}),
                  flush=True)
    finally:
        invariant_kernels.ATTENTION_WARPS, invariant_kernels.ATTENTION_DECODE_STAGES = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--live", type=int, default=256)
    parser.add_argument("--slot", type=int, default=384)
    parser.add_argument("--sweep", default="", help="WARPSxSTAGES,... of our kernel, timed in CUDA graphs")
    opts = parser.parse_args()
    device = torch.device("cuda")
    for batch in [int(b) for b in opts.batches.split(",")]:
        torch.manual_seed(0)
        k_cache = torch.randn(batch + 1, opts.slot, HKV, D, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(batch, H, D, device=device, dtype=torch.bfloat16)
        slots = torch.randperm(batch, device=device)
        lengths = torch.full((batch,), opts.live, dtype=torch.int32, device=device)
        ours = slot_attention(q, k_cache, v_cache, slots, lengths)
        theirs = flash_varlen(q, k_cache, v_cache, slots, lengths)
        live_bytes = 2 * batch * opts.live * HKV * D * 2
        if opts.sweep:
            sweep(opts.sweep, batch, q, k_cache, v_cache, slots, lengths, live_bytes,
                  dict(bench="decode_attention_sweep", batch=batch, live=opts.live, slot=opts.slot))
            continue
        row = dict(bench="decode_attention", batch=batch, live=opts.live, slot=opts.slot,
                   max_abs_diff=float((ours.float() - theirs.float()).abs().max()))
        for name, fn in (("triton", slot_attention), ("flash_varlen", flash_varlen)):
            us = time_us(lambda: fn(q, k_cache, v_cache, slots, lengths))
            row[f"{name}_us"] = round(us, 1)
            row[f"{name}_GBps"] = round(live_bytes / us / 1e3)
        row["speedup"] = round(row["flash_varlen_us"] / row["triton_us"], 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
