"""Decode attention over KV-cache slots: our Triton kernel against PyTorch's flash-attention kernel
(variable-length form, per-row slot offsets + `seqused_k`), in the same run. One JSON line per batch.

    python3 bench/decode_attention.py [--batches 64,256] [--live 256] [--slot 384] [--sweep 4x2,4x3,4x2x128] [--share 85]
    python3 bench/decode_attention.py --splits 1,2,3,4,auto [--batches 16,64,256] [--live 256]

Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128), bf16; every row attends
over `--live` keys of its own slot. Reports microseconds per call and the achieved bandwidth
counting the live K/V bytes read once.

`--sweep WARPSxSTAGES[xBLOCK_N],...`: our kernel alone under each launch configuration (warps per
program, software-pipelining stages, keys per block step: a block size other than the packed
kernel's changes the output's bits), each call timed inside a CUDA graph as the engine replays it,
so the host's launch cost is left out. `--share P` makes rows in groups of 8 read their first P keys
from one slot, as the samples of one prompt do (bandwidth then counts a shared prompt once per
group). One JSON line per batch and configuration.

`--splits N,...`: the default mode's split kernel (model/decode_kernel.py) with each row's keys in
N ranges (`auto`: decode_splits' pick for the batch), against the one-program-a-row kernel (N = 1
runs that kernel itself) in the same run, graph-timed; `vs_unsplit` is the unsplit time over this
one, `max_abs_diff` the largest difference from the unsplit output.
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
from model.decode_kernel import decode_splits, split_slot_attention  # noqa: E402
from model.invariant_kernels import multiprocessors, slot_attention  # noqa: E402

H, HKV, D = 16, 8, 128
GROUP = 8  # rows per shared prompt (--share)


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


def parse_config(config: str) -> dict:
    """'WARPSxSTAGES[xBLOCK_N]' -> the module constants it sets."""
    numbers = [int(x) for x in config.split("x")]
    return {"ATTENTION_WARPS": numbers[0], "ATTENTION_DECODE_STAGES": numbers[1],
            "ATTENTION_BLOCK_N": numbers[2] if len(numbers) > 2 else invariant_kernels.ATTENTION_BLOCK_N}


def sweep(configs: str, attend, live_bytes: int, row: dict) -> None:
    """One line per configuration of our kernel (module constants, restored after)."""
    names = ("ATTENTION_WARPS", "ATTENTION_DECODE_STAGES", "ATTENTION_BLOCK_N")
    saved = {name: getattr(invariant_kernels, name) for name in names}
    reference = attend()
    try:
        for config in configs.split(","):
            for name, value in parse_config(config).items():
                setattr(invariant_kernels, name, value)
            out = attend()
            us = graph_time_us(attend, reps=50)
            print(json.dumps({**row, "config": config, "graph_us": round(us, 2), "GBps": round(live_bytes / us / 1e3),
                              "same_bits": bool(torch.equal(out, reference))}), flush=True)
    finally:
        for name, value in saved.items():
            setattr(invariant_kernels, name, value)


def split_sweep(counts: str, q, k_cache, v_cache, slots, lengths, live_bytes: int, row: dict) -> None:
    """One line per split count: the split kernel against the unsplit one (see --splits)."""
    unsplit = lambda: slot_attention(q, k_cache, v_cache, slots, lengths)  # noqa: E731
    reference, base_us = unsplit(), graph_time_us(unsplit, reps=50)
    for count in counts.split(","):
        n = decode_splits(q.shape[0], HKV, k_cache.shape[1], multiprocessors(q.device)) if count == "auto" else int(count)
        if n == 1:
            fn = unsplit
        else:
            fn = lambda n=n: split_slot_attention(q, k_cache, v_cache, slots, lengths, slots, lengths, None, None,  # noqa: E731
                                                  lengths, n)
        us = graph_time_us(fn, reps=50)
        print(json.dumps({**row, "splits": count, "n": n, "graph_us": round(us, 2), "GBps": round(live_bytes / us / 1e3),
                          "vs_unsplit": round(base_us / us, 3),
                          "max_abs_diff": float((fn().float() - reference.float()).abs().max())}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--live", type=int, default=256)
    parser.add_argument("--slot", type=int, default=384)
    parser.add_argument("--sweep", default="", help="WARPSxSTAGES[xBLOCK_N],... of our kernel, timed in CUDA graphs")
    parser.add_argument("--splits", default="", help="split counts of the split kernel (or 'auto'), against the unsplit one")
    parser.add_argument("--share", type=int, default=0,
                        help="with --sweep: rows in groups of 8 read their first SHARE keys from the group's first slot")
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
        if opts.splits:
            split_sweep(opts.splits, q, k_cache, v_cache, slots, lengths, live_bytes,
                        dict(bench="decode_attention_splits", batch=batch, live=opts.live, slot=opts.slot))
            continue
        if opts.sweep:
            share_slots = slots.view(-1, GROUP)[:, :1].expand(-1, GROUP).reshape(-1) if opts.share else slots
            share_lens = torch.full_like(lengths, opts.share) if opts.share else lengths
            # Bytes that must come from memory: a shared prompt once per group.
            unique_keys = batch * opts.live - (batch - batch // GROUP) * opts.share
            sweep(opts.sweep, lambda: slot_attention(q, k_cache, v_cache, slots, lengths, share_slots, share_lens),
                  2 * unique_keys * HKV * D * 2,
                  dict(bench="decode_attention_sweep", batch=batch, live=opts.live, share=opts.share, slot=opts.slot))
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
