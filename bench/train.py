"""Trainer throughput: one optimizer step of tandem's `Trainer` against HF transformers' eager
training step, in the same run, one JSON line per configuration.

    python3 bench/train.py [--configs a,b,c] [--baselines hf] [--compile both|on|off] [--reps 3]
                           [--logits fp32,bf16] [--attention flash,fa4] [--profile DIR]

Qwen3-0.6B shape (596M parameters, vocab 151936, tied embeddings), random weights, random tokens.
- (a) 16 sequences x 1024 tokens;
- (b) a GRPO-like batch: 512 sequences, lengths uniform on 100..600, prompts the first 35%;
- (c) 8 sequences x 8192 tokens, activation checkpointing on.

tandem: `Trainer.train` on a 1-rank mesh (FSDP2, fp32 master weights, bf16 compute, fused AdamW),
sequences packed into micro-batches of at most `--micro-batch-tokens` tokens, the GRPO loss on the
completion tokens; its log-prob head reads fp32 logits (`model.fp32_logits`, the default), and
`--logits fp32,bf16` adds a run on bf16 logits (`_bf16_logits` in its name), and `--attention
flash,fa4` one on FlashAttention 4 (`model.train_attention`; `_fa4` in its name). HF:
`AutoModelForCausalLM` in bf16 (SDPA attention), cross-entropy over the batch, `torch.optim.AdamW`;
(b) runs padded micro-batches of sequences sorted by length, (c) one sequence per micro-batch with
gradient checkpointing. Both take one optimizer step per batch.

Both run with one CPU thread for torch, as the trainer ranks do (`train_grpo.one_host_thread`; set
OMP_NUM_THREADS to choose another count). Reported per line: tokens/s over the batch's tokens (best
of --reps after a warm-up step, whose time is `first_step_s`: compile included), MFU = model FLOP/s
over the bf16 matmul rate measured in this run (8192^3), and peak memory. Model FLOPs per token:
6 x matmul parameters (the tied head included) + 12 x layers x heads x head_dim x the mean causal
context; recomputation not counted. tandem's output head runs on the completion tokens only (65% of
each batch: the tokens that carry the loss), HF's on every token, and each one's MFU counts the head
where it runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generate import SHAPES, VOCAB, model_args  # noqa: E402
from bench.provenance import commit  # noqa: E402
from grpo.config import GRPOConfig, OptimizerConfig  # noqa: E402
from grpo.observe.profile import write_report  # noqa: E402
from grpo.rollout.episode import EpisodeBatch  # noqa: E402
from grpo.train.trainer import Trainer  # noqa: E402
from model import (  # noqa: E402
    ModelArgs,
    Transformer,
    batch_invariant,  # noqa: E402
)
from model.attention import set_packed_kernel  # noqa: E402
from train_grpo import one_host_thread  # noqa: E402

CONFIGS = {
    "a": dict(lengths="fixed", n=16, length=1024, checkpointing=False),
    "b": dict(lengths="grpo", n=512, low=100, high=600, checkpointing=False),
    "c": dict(lengths="fixed", n=8, length=8192, checkpointing=True),
}


def sequence_lengths(config: dict, seed: int = 0) -> list[int]:
    if config["lengths"] == "fixed":
        return [config["length"]] * config["n"]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(config["low"], config["high"] + 1, (config["n"],), generator=g).tolist()


def episode_batch(lengths: list[int], vocab: int, seed: int = 0) -> EpisodeBatch:
    """Random episodes: prompts the first 35% of each sequence, groups of 8, random advantages."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), max(lengths)
    seq = torch.tensor(lengths)
    prompt = (seq * 0.35).long().clamp(min=1)
    return EpisodeBatch(
        tokens=torch.randint(0, vocab, (n, width), generator=g),
        prompt_lens=prompt,
        completion_lens=seq - prompt,
        gen_logprobs=-torch.rand(n, width, generator=g),
        truncated=torch.zeros(n, dtype=torch.bool),
        version=torch.zeros(n, dtype=torch.long),
        prompt_index=torch.arange(n) // 8,
        sample_index=torch.arange(n) % 8,
        rewards=torch.zeros(n),
        advantages=torch.randn(n, generator=g),
    )


def matmul_params(args: ModelArgs) -> int:
    attention = args.dim * (args.n_heads + 2 * args.n_kv_heads) * args.head_dim + args.n_heads * args.head_dim * args.dim
    return args.n_layers * (attention + 3 * args.dim * args.ffn_dim) + args.vocab_size * args.dim


def model_flops(args: ModelArgs, lengths: list[int], head_tokens: int) -> float:
    """Forward + backward FLOPs of the batch (no recomputation), the output head on head_tokens."""
    tokens = sum(lengths)
    context = sum(n * (n + 1) / 2 for n in lengths)  # keys attended, summed over tokens
    head = args.vocab_size * args.dim
    return (6 * (matmul_params(args) - head) * tokens + 6 * head * head_tokens
            + 12 * args.n_layers * args.n_heads * args.head_dim * context)


def matmul_rate(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * 8192**3 * reps / (time.perf_counter() - start)


def timed(step, reps: int, device: torch.device) -> tuple[float, float]:
    """(first step seconds, best of reps seconds after it)."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    torch.cuda.synchronize(device)
    first = time.perf_counter() - start
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return first, best


def profile(step, stem: Path) -> None:
    """One more step under the profiler: the kernels by device time to stem.txt, the trace to stem.json.gz."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    write_report(prof, stem, stem.name, wall, on_cuda=True, rows=80)


def tandem_step(args: ModelArgs, device, batch: EpisodeBatch, micro_batch_tokens: int, checkpointing: bool, compile: bool):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    model = Transformer(args, dtype=torch.float32, device=device)
    model.init_weights()
    trainer = Trainer(
        model, mesh, device, torch.bfloat16, GRPOConfig(group_size=8), OptimizerConfig(lr=1e-6, warmup_steps=0),
        total_steps=100, micro_batch_tokens=micro_batch_tokens, temperature=1.0,
        max_new_tokens=int(batch.completion_lens.max()), activation_checkpointing=checkpointing, compile=compile,
    )
    return trainer, lambda: trainer.train(batch)


def hf_step(args: ModelArgs, device, lengths: list[int], micro_batch_tokens: int, checkpointing: bool):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, tie_word_embeddings=True, max_position_embeddings=max(lengths),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    order = sorted(lengths, reverse=True)
    micro_batches, current = [], []
    for n in order:  # padded micro-batches: as many sequences as fit the token budget at the longest's width
        if current and (len(current) + 1) * current[0] > micro_batch_tokens:
            micro_batches.append(current)
            current = []
        current.append(n)
    micro_batches.append(current)
    inputs = []
    for mb in micro_batches:
        ids = torch.randint(0, args.vocab_size, (len(mb), mb[0]), generator=g)
        labels = ids.clone()
        for row, n in enumerate(mb):
            labels[row, n:] = -100
        inputs.append((ids.to(device), labels.to(device)))

    def step():
        for ids, labels in inputs:
            (model(input_ids=ids, labels=labels).loss / len(inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def run_one(opts: argparse.Namespace, args: ModelArgs, device: torch.device, config: dict, run: tuple,
            lengths: list[int], budget: int, seconds_at_peak: float, profile_stem: Path | None) -> dict:
    """One implementation's timed steps on one config: its JSON fields (tok/s, step time, MFU, peak
    memory), or the out-of-memory error it met. run: (impl, compiled, logits dtype, attention);
    seconds_at_peak: the step's FLOPs over the GPU's matmul rate (its time at an MFU of 1);
    profile_stem: where its kernel table goes, or None for no profile."""
    impl, compiled, logits, attention = run
    batch_invariant.set_fp32_logits(logits != "bf16")
    set_packed_kernel(attention)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    owner = step = None
    try:
        if impl == "tandem":
            owner, step = tandem_step(args, device, episode_batch(lengths, args.vocab_size), budget,
                                      config["checkpointing"], compiled)
        else:
            owner, step = hf_step(args, device, lengths, budget, config["checkpointing"])
        first, best = timed(step, opts.reps, device)
        if profile_stem is not None:
            profile(step, profile_stem)
        record = dict(tok_s=round(sum(lengths) / best), step_s=round(best, 4), first_step_s=round(first, 2),
                      mfu=round(seconds_at_peak / best, 3),
                      peak_gb=round(torch.cuda.max_memory_allocated(device) / 1e9, 1))
    except torch.OutOfMemoryError as exc:
        record = dict(error=f"out of memory: {str(exc).splitlines()[0]}")
    del owner, step  # frees the model before the next run
    gc.collect()
    return record


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="a,b,c")
    parser.add_argument("--baselines", default="hf")
    parser.add_argument("--compile", choices=("both", "on", "off"), default="both")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    parser.add_argument("--logits", default="fp32", help="the head's logits dtypes to run tandem with: fp32,bf16")
    parser.add_argument("--attention", default="flash", help="the trainer's attention kernels to run: flash,fa4")
    parser.add_argument("--profile", default="", help="a folder: write each run's kernel table there")
    return parser.parse_args()


def main() -> None:
    opts = parse()
    if not torch.cuda.is_available():
        raise SystemExit("bench/train.py measures a GPU; no CUDA device is visible")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # As a trainer rank does: with torch's default of a thread per core, the packing's host ops ran 30-45% of
    # (a)'s step longer while Inductor's compile workers started beside a run whose graphs came from the cache.
    one_host_thread()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    args = model_args(opts.shape, VOCAB)
    peak = matmul_rate(device)
    base = dict(commit=commit(), device=torch.cuda.get_device_name(device), torch=torch.__version__,
                shape=opts.shape, matmul_tflops=round(peak / 1e12, 1))
    print(json.dumps(dict(base, bench="matmul_8192")), flush=True)
    compile_modes = {"both": (False, True), "on": (True,), "off": (False,)}[opts.compile]
    for name in opts.configs.split(","):
        config = CONFIGS[name]
        lengths = sequence_lengths(config)
        budget = max(opts.micro_batch_tokens, max(lengths))
        completions = int(episode_batch(lengths, args.vocab_size).completion_lens.sum())
        flops = {"tandem": model_flops(args, lengths, completions), "hf": model_flops(args, lengths, sum(lengths))}
        rows = {}
        runs = [("tandem", c, logits, attention) for c in compile_modes for logits in opts.logits.split(",")
                for attention in opts.attention.split(",")]
        runs += [(b, False, "", "flash") for b in opts.baselines.split(",") if b]
        for impl, compiled, logits, attention in runs:
            key = (f"{impl}{'_compiled' if compiled else ''}{'_bf16_logits' if logits == 'bf16' else ''}"
                   f"{'_fa4' if attention == 'fa4' else ''}")
            seconds_at_peak = flops["tandem" if impl == "tandem" else "hf"] / peak
            profile_stem = Path(opts.profile) / f"{name}_{key}" if opts.profile else None
            rows[key] = run_one(opts, args, device, config, (impl, compiled, logits, attention), lengths, budget,
                                seconds_at_peak, profile_stem)
            print(json.dumps(dict(base, bench="train", config=name, impl=key, sequences=len(lengths),
                                  tokens=sum(lengths), micro_batch_tokens=budget,
                                  activation_checkpointing=config["checkpointing"], **rows[key])), flush=True)
        best_ours = max((r.get("tok_s", 0) for k, r in rows.items() if k.startswith("tandem")), default=0)
        for b in opts.baselines.split(","):
            if b and rows.get(b, {}).get("tok_s"):
                print(json.dumps(dict(base, bench="train_ratio", config=name, baseline=b,
                                      tandem_over_baseline=round(best_ours / rows[b]["tok_s"], 2))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
