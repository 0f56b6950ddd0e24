"""The trainer's attention with shared prompts (`training.share_prompts`), forward and backward, by
how it reaches the prefix, in one run: one JSON line each.

    python3 bench/prefix_attention.py --device cuda          # bf16, flash attention
    python3 bench/prefix_attention.py --reps 2               # CPU smoke run (fp32, the reference path)

One micro-batch of --groups prompts of --prefix tokens, each continued by --group-size completions
of --completion tokens (Qwen3-0.6B's attention: 16 query heads, 8 K/V heads of 128):
- `split`: the trainer's (model/shared_prefix.py): the prompt packed once; each sequence's own keys
  and its group's prefix in two attention calls, merged through their log-sum-exps;
- `gather`: the prompt packed once; each completion's keys gathered (its prefix's, then its own)
  into one key axis for one attention call, the gradients summed back by an index_add (the
  trainer's layout until the split);
- `plain`: no sharing, each completion packed after its own copy of the prompt (share_prompts off).
Mean of --reps after a warm-up; `vs_gather` is the time against `gather`'s in this run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import flash, shared_prefix  # noqa: E402
from model.attention import concat_ranges, packed_attention, sequence_layout, suffix_prefill  # noqa: E402


class _Gathered(torch.autograd.Function):
    """One causal attention call over keys laid out apart from the queries (aligned at each
    sequence's end): the gather layout's kernel."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k):
        out, lse = flash.forward(q, k, v, cu_q, cu_k, max_q, max_k, True)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.max_q, ctx.max_k = max_q, max_k
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        return (*flash.backward(grad, q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, True), None, None, None, None)


def shared_layout(opts) -> tuple[torch.Tensor, torch.Tensor]:
    """doc_ids, group_ids [1, N] of the shared layout: per group its prefix (doc -1), then its completions."""
    docs, groups = [], []
    for g in range(opts.groups):
        docs += [-1] * opts.prefix
        for c in range(opts.group_size):
            docs += [g * opts.group_size + c] * opts.completion
        groups += [g] * (opts.prefix + opts.group_size * opts.completion)
    return torch.tensor([docs]), torch.tensor([groups])


def gather_call(opts, device: torch.device):
    """The gather layout's attention(q, k, v) on the flat shared layout."""
    q_bounds, k_bounds = [0], [0]
    for _ in range(opts.groups):
        q_bounds.append(q_bounds[-1] + opts.prefix)
        k_bounds.append(k_bounds[-1] + opts.prefix)
        for _ in range(opts.group_size):
            q_bounds.append(q_bounds[-1] + opts.completion)
            k_bounds.append(k_bounds[-1] + opts.prefix + opts.completion)
    # Each sequence's key runs: a prefix alone, or a completion after its prefix.
    runs_start, runs_len = [], []
    for g in range(opts.groups):
        base = g * (opts.prefix + opts.group_size * opts.completion)
        runs_start.append(base)
        runs_len.append(opts.prefix)
        for c in range(opts.group_size):
            runs_start += [base, base + opts.prefix + c * opts.completion]
            runs_len += [opts.prefix, opts.completion]
    key_index = concat_ranges(torch.tensor(runs_start), torch.tensor(runs_len)).to(device)
    cu_q, cu_k = (torch.tensor(b, dtype=torch.int32, device=device) for b in (q_bounds, k_bounds))
    max_q, max_k = max(opts.completion, opts.prefix), opts.prefix + opts.completion

    def call(q, k, v):
        k, v = k.index_select(0, key_index), v.index_select(0, key_index)
        if flash.uses_flash(q):
            return _Gathered.apply(q, k, v, cu_q, cu_k, max_q, max_k)
        return suffix_prefill(q, k, v, cu_q, cu_k, max_q, max_k)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=7)
    parser.add_argument("--prefix", type=int, default=85)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion", type=int, default=200)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    doc_ids, group_ids = shared_layout(opts)
    n = doc_ids.shape[1]
    shared = sequence_layout(doc_ids, (1, n), device, group_ids)
    episode = opts.prefix + opts.completion
    n_plain = opts.groups * opts.group_size * episode
    plain = sequence_layout(torch.arange(n_plain)[None] // episode, (1, n_plain), device)
    gathered = gather_call(opts, device)
    ways = {
        "split": (n, lambda q, k, v: shared_prefix.attend(q, k, v, shared.cu_seqlens, shared.bounds, shared.max_len,
                                                          shared.shared)),
        "gather": (n, gathered),
        "plain": (n_plain, lambda q, k, v: packed_attention(q[None], k[None], v[None], plain)[0]),
    }
    torch.manual_seed(0)
    inputs = {tokens: [torch.randn(tokens, h, 128, device=device, dtype=dtype, requires_grad=True) for h in (16, 8, 8)]
              for tokens in (n, n_plain)}
    # The two shared layouts compute the same attention: their outputs' largest difference.
    with torch.no_grad():
        differ = float((ways["split"][1](*inputs[n]) - gathered(*inputs[n])).abs().max())

    def timed(tokens: int, attend) -> float:
        q, k, v = inputs[tokens]
        grad = torch.randn(tokens, 16, 128, device=device, dtype=dtype)

        def once():
            attend(q, k, v).backward(grad)

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
        print(json.dumps(dict(bench="prefix_attention", layout=name, tokens=ways[name][0], device=opts.device,
                              fwd_bwd_ms=round(s * 1e3, 4), vs_gather=round(s / seconds["gather"], 2),
                              split_vs_gather_max_diff=differ)))


if __name__ == "__main__":
    main()
