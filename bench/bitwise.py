"""The cost and the effect of batch-invariant numerics (`job.bitwise_logprobs`), default against
bitwise in the same run, one JSON line per mode.

    python3 bench/bitwise.py [--prompts 16] [--group 4] [--new-tokens 32] [--dim 64] [--layers 2]

A random fp32 model of the demo's kind on the CPU (the reference path; bench/bitwise_runs.py
measures whole runs, on a GPU the kernels): the engine generates `--group` completions of
`--prompts` prompts of mixed lengths (decode tokens/s), then the trainer runs one step on them
(training tokens/s: forward, backward and AdamW over prompt + completion tokens), and reports the
gap between the engine's log-probs and its own recomputation (`logprob_diff/{max,mean,exact_frac}`).
Each mode gets a fresh engine and trainer built from the same weights; times are the best of --reps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.provenance import commit  # noqa: E402
from grpo.config import GRPOConfig, OptimizerConfig  # noqa: E402
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams  # noqa: E402
from grpo.rollout.generate import episodes_from_completions  # noqa: E402
from grpo.train.trainer import Trainer  # noqa: E402
from model import ModelArgs, Transformer, batch_invariant  # noqa: E402


def run(mode: str, opts, args: ModelArgs, prompts: list[list[int]]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    batch_invariant.enable(mode == "bitwise")
    torch.manual_seed(0)
    model = Transformer(args, dtype=torch.float32)
    model.init_weights(std=0.1)
    sampling = SamplingParams(max_new_tokens=opts.new_tokens, temperature=1.0)
    requests = [GenerationRequest(p, 0, i, s) for i, p in enumerate(prompts) for s in range(opts.group)]
    decode_s, completions = float("inf"), None
    for _ in range(opts.reps):
        engine = NativeEngine(args, sampling, eos_ids=[], seed=1, dtype=torch.float32, device="cpu",
                              max_batch_size=len(requests))
        engine.update_weights([[(n, (), p.detach()) for n, p in model.named_parameters()]], version=0)
        start = time.perf_counter()
        completions = engine.generate(requests)
        decode_s = min(decode_s, time.perf_counter() - start)
    batch = episodes_from_completions(completions, pad_id=0)
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))
    train_s, metrics = float("inf"), {}
    for _ in range(opts.reps):
        trainer = Trainer(Transformer(args, dtype=torch.float32).requires_grad_(True), init_device_mesh("cpu", (1,)),
                          torch.device("cpu"), torch.float32, GRPOConfig(group_size=opts.group),
                          OptimizerConfig(lr=1e-4, warmup_steps=0), total_steps=2, micro_batch_tokens=2048,
                          temperature=1.0, max_new_tokens=opts.new_tokens)
        trainer.model.load_state_dict(model.state_dict())
        start = time.perf_counter()
        metrics = trainer.train(batch)
        train_s = min(train_s, time.perf_counter() - start)
    new_tokens = sum(len(c.tokens) for c in completions)
    return dict(
        mode=mode, decode_tok_s=round(new_tokens / decode_s), train_tok_s=round(int(batch.seq_lens.sum()) / train_s),
        logprob_diff_max=metrics["logprob_diff/max"], logprob_diff_mean=metrics["logprob_diff/mean"],
        exact_frac=round(metrics["logprob_diff/exact_frac"], 4),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    opts = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    dist.init_process_group("gloo", rank=0, world_size=1)
    args = ModelArgs(vocab_size=64, dim=opts.dim, n_layers=opts.layers, n_heads=4, n_kv_heads=2,
                     head_dim=opts.dim // 4, ffn_dim=4 * opts.dim)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 63, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 48, (opts.prompts,), generator=g)]
    base = dict(bench="bitwise", commit=commit(), torch=torch.__version__, threads=torch.get_num_threads(),
                dim=opts.dim, layers=opts.layers, requests=opts.prompts * opts.group, new_tokens=opts.new_tokens)
    rows = {}
    for mode in ("default", "bitwise"):
        rows[mode] = run(mode, opts, args, prompts)
        print(json.dumps(dict(base, **rows[mode])), flush=True)
    d, b = rows["default"], rows["bitwise"]
    print(json.dumps(dict(base, bench="bitwise_cost", decode_slowdown=round(d["decode_tok_s"] / b["decode_tok_s"], 2),
                          train_slowdown=round(d["train_tok_s"] / b["train_tok_s"], 2))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
