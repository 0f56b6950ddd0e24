"""The shared-prefix key gather of the trainer's attention (`training.share_prompts`), forward and
backward, by how it gathers, in one run: one JSON line each.

    python3 bench/prefix_gather.py                           # CPU, bf16
    python3 bench/prefix_gather.py --device cuda

One micro-batch laid out as `model/attention.py` lays out shared prompts: --groups prompts of
--prefix tokens, each followed by --group-size completions of --completion tokens; every
completion's keys are its prompt's, then its own (Qwen3-0.6B's 8 K/V heads of 128). `index` is
advanced indexing (its backward an accumulating index_put, which sorts the indices), `index_select`
the gather the trainer uses (its backward an index_add), `copy` a same-sized copy without a gather,
the floor. Mean of --reps after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.attention import concat_ranges  # noqa: E402


def key_index(groups: int, prefix: int, group_size: int, completion: int) -> tuple[torch.Tensor, int]:
    """The flat key rows [Nk] of each completion (its prompt's, then its own) and the tokens N."""
    starts, lens, start = [], [], 0
    for _ in range(groups):
        prompt_start, start = start, start + prefix
        for _ in range(group_size):
            starts += [prompt_start, start]
            lens += [prefix, completion]
            start += completion
    return concat_ranges(torch.tensor(starts), torch.tensor(lens)), start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=7)
    parser.add_argument("--prefix", type=int, default=85)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion", type=int, default=200)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    index, n = key_index(opts.groups, opts.prefix, opts.group_size, opts.completion)
    index = index.to(device)
    torch.manual_seed(0)
    keys = torch.randn(n, 8, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(index.numel(), 8, 128, device=device, dtype=torch.bfloat16)
    ways = {
        "copy": (lambda: keys * 1, grad[:n]),
        "index": (lambda: keys[index], grad),
        "index_select": (lambda: keys.index_select(0, index), grad),
    }

    def timed(gather, out_grad) -> float:
        def once():
            gather().backward(out_grad)
            keys.grad = None
        once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(opts.reps):
            once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / opts.reps

    seconds = {name: timed(*way) for name, way in ways.items()}
    for name, s in seconds.items():
        print(json.dumps(dict(bench="prefix_gather", gather=name, tokens=n, key_rows=index.numel(), device=opts.device,
                              fwd_bwd_ms=round(s * 1e3, 4), vs_index=round(s / seconds["index"], 2))))


if __name__ == "__main__":
    main()
