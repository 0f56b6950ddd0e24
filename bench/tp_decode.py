"""Tensor-parallel decoding: one engine over N GPUs (`parallelism.generator_tp = N`) against one
whole engine on one GPU, in the same launch, one JSON line per batch size.

    torchrun --standalone --nproc_per_node=2 bench/tp_decode.py [--shape 1.7b] [--batches 64,256] [--reps 2]
    torchrun --standalone --nproc_per_node=2 bench/tp_decode.py --shape tiny --batches 4 --new 8   # CPU smoke test

Random weights of a Qwen3 shape (bench/generate.py's shapes, bf16 on GPUs, fp32 on the CPU),
prompts of 128 random tokens, greedy decoding of --new tokens (no EOS). Rank 0 times the whole
engine alone while the other ranks wait; then every rank runs its shard of the TP engine, the same
weights sliced by model/parallelize.py's plan. Reported: output tokens/s of each (best of --reps
after a warm-up that compiles and captures), their ratio, and how many completions are equal
token for token. In bf16 the row-parallel partial sums add in another order than the whole
matmul's, so a near-tie can flip a greedy token; for unequal completions the first differing
position is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generate import PROMPT, VOCAB, model_args, output_tokens, prompts, time_engine  # noqa: E402
from bench.provenance import commit  # noqa: E402
from fixtures.shards import tp_shard  # noqa: E402
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams  # noqa: E402
from model import Transformer  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1.7b")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--new", type=int, default=256, help="new tokens per completion")
    parser.add_argument("--reps", type=int, default=2)
    opts = parser.parse_args()
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if cuda else torch.float32
    args = model_args(opts.shape, VOCAB if opts.shape != "tiny" else 512)
    torch.manual_seed(0)
    full = Transformer(args, dtype=torch.float32, device=device)
    full.init_weights()
    weights = {name: p.detach().to(dtype) for name, p in full.named_parameters()}
    del full
    sampling = SamplingParams(max_new_tokens=opts.new, temperature=0.0)
    base = dict(bench="tp_decode", shape=opts.shape, tp=world, new_tokens=opts.new, commit=commit(),
                device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    for batch in (int(b) for b in opts.batches.split(",")):
        requests = [GenerationRequest(p, 0, i, 0) for i, p in enumerate(prompts(batch, args.vocab_size))]
        options = dict(eos_ids=[], seed=0, dtype=dtype, device=device, max_batch_size=batch,
                       max_seq_len=PROMPT + opts.new)
        whole_s, whole_tokens = math.inf, None
        if rank == 0:
            whole = NativeEngine(args, sampling, **options)
            whole.update_weights([list((n, (), w) for n, w in weights.items())], version=0)
            whole_s, whole_out = time_engine(whole, requests, device, opts.reps)
            whole_tokens = [c.tokens for c in whole_out]
            whole.close()
            del whole
            if cuda:
                torch.cuda.empty_cache()
        dist.barrier()
        engine = NativeEngine(args, sampling, tensor_parallel=(world, dist.group.WORLD), **options)
        engine.update_weights([[(n, (), tp_shard(n, w, args, world, rank)) for n, w in weights.items()]], version=0)
        tp_s, tp_out = time_engine(engine, requests, device, opts.reps)
        tp_tokens = [c.tokens for c in tp_out]
        engine.close()
        del engine
        if rank == 0:
            new_tokens = output_tokens(tp_out)
            unequal = [first_difference(a, b) for a, b in zip(tp_tokens, whole_tokens) if a != b]
            print(json.dumps(dict(
                base, batch=batch, whole_tok_s=round(new_tokens / whole_s), tp_tok_s=round(new_tokens / tp_s),
                speedup=round(whole_s / tp_s, 2), equal_completions=f"{batch - len(unequal)}/{batch}",
                first_difference=sorted(unequal)[:8],
            )), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
