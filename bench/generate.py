"""Generation throughput: tandem's engine against HF `generate`, in the same run, one JSON line per
configuration.

    python3 bench/generate.py [--shapes 0.6b,1.7b] [--batches 64,256] [--baselines hf,hf_static]
                              [--long-tail] [--one-batch-tail] [--profile] [--gaps] [--quick]

Random bf16 weights of a Qwen3 shape; prompts of 128 random tokens; 256 new tokens forced (no EOS);
sampling at temperature 1 over the full vocabulary. Each line reports output tokens/s over the
whole `generate` call (prefill included), the fraction of the decode memory roofline, and peak
memory. Baselines: HF `generate` with its dynamic cache (SDPA), and HF `generate` with a static
cache (which transformers compiles with torch.compile for decoding).

Roofline: every decode step reads the weights once plus each live sequence's K/V, at the measured
4.3 TB/s of an H200 (`--bandwidth`): tok/s = B / ((weights + B * mean live tokens * KV bytes per
token) / bandwidth).

`--profile`: before each batch's timed runs, one decode step's kernels by device time: a profiled
call that only prefills (one new token per request) taken from a profiled call of full budgets,
per decode step; its header gives both calls' wall time, so the wall time per step beyond the
kernels' shows too.

`--gaps`: where one profiled call leaves the device idle: the gaps between consecutive kernels by
size, and the host's CUDA calls by total time.

On CUDA, torch runs one CPU thread, as the generator ranks of `train_grpo.py` do
(`train_grpo.one_host_thread`; set OMP_NUM_THREADS to choose another count).

`--long-tail`: 2048 requests whose budgets follow a truncated Pareto(alpha = 1) on 32..1024 tokens
(median ~64), decoded at most 256 at a time, against the same 2048 prompts with every budget equal
to the long-tail mean: continuous batching refills each finished sequence's slot, so the long-tail
run should stay near the equal-length throughput.

`--one-batch-tail`: 128 requests decoded in one batch with no refill, as one RL step's episodes are,
with budgets on a truncated Pareto(alpha = 1) over 32..2048 tokens: the last few rows decode long
after the rest have ended, so the call's time is mostly steps of a handful of long rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.provenance import commit  # noqa: E402
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams  # noqa: E402
from model import ModelArgs  # noqa: E402
from train_grpo import one_host_thread  # noqa: E402

SHAPES = {
    "0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072),
    "1.7b": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144),
    "8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, tie_embeddings=False),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128),
}
VOCAB = 151936
PROMPT, NEW = 128, 256


def model_args(shape: str, vocab: int) -> ModelArgs:
    return ModelArgs(arch="qwen3", vocab_size=vocab, rope_theta=1e6, **SHAPES[shape])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def roofline(args: ModelArgs, batch: int, mean_live: float, bandwidth: float) -> float:
    weights = 2 * (args.vocab_size * args.dim + args.n_layers * (
        args.dim * (args.n_heads + 2 * args.n_kv_heads) * args.head_dim + args.n_heads * args.head_dim * args.dim
        + 3 * args.dim * args.ffn_dim))
    kv_per_token = 2 * args.n_layers * args.n_kv_heads * args.head_dim * 2
    return batch / ((weights + batch * mean_live * kv_per_token) / bandwidth)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, PROMPT), generator=g).tolist()


def long_tail_budgets(n: int, seed: int = 0, hi: float = 1024.0) -> list[int]:
    """Truncated Pareto(alpha = 1) on [32, hi]: median ~64 tokens, a tail out to the cap."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    lo = 32.0
    return (lo / (1 - u * (1 - lo / hi))).round().long().tolist()


def budget_requests(budgets: list[int], vocab: int, seed: int) -> list[GenerationRequest]:
    """One request per budget, each with its own random prompt."""
    plist = prompts(len(budgets), vocab, seed=seed)
    return [GenerationRequest(p, 0, i, 0, max_new_tokens=n) for i, (p, n) in enumerate(zip(plist, budgets))]


def build_engine(args, device, batch, max_seq_len, **engine_options) -> NativeEngine:
    engine = NativeEngine(
        args, SamplingParams(max_new_tokens=max_seq_len - PROMPT, temperature=1.0), eos_ids=[], seed=0,
        dtype=torch.bfloat16, device=device, max_batch_size=batch, max_seq_len=max_seq_len, **engine_options,
    )
    torch.manual_seed(0)
    engine.model.init_weights()
    engine.version = 0
    return engine


def time_engine(engine: NativeEngine, requests: list[GenerationRequest], device, reps: int) -> tuple[float, list]:
    """(best wall seconds over reps after one warm-up run, the warm-up's completions)."""
    out = engine.generate(requests)  # warm-up: compile, graph capture
    best = math.inf
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        engine.generate(requests)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def output_tokens(completions: list) -> int:
    return sum(len(c.tokens) for c in completions)


def hf_model(args: ModelArgs, device, static: bool):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, tie_word_embeddings=True, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def time_hf(model, batch_prompts, device, static: bool, reps: int) -> float:
    ids = torch.tensor(batch_prompts, device=device)
    kw = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True,
        temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
    )
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        # Warm-up: the static variant compiles here; the dynamic one only needs its kernels loaded.
        model.generate(ids, **{**kw, **({} if static else dict(max_new_tokens=8, min_new_tokens=8))})
        best = math.inf
        for _ in range(reps):
            sync(device)
            start = time.perf_counter()
            model.generate(ids, **kw)
            sync(device)
            best = min(best, time.perf_counter() - start)
    return best


def kernel_times(
    engine: NativeEngine, requests: list[GenerationRequest], device
) -> tuple[float, dict[str, float], dict[str, int]]:
    """(wall seconds, device µs per kernel name, launches per kernel name) of one profiled generate call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync(device)
        start = time.perf_counter()
        engine.generate(requests)
        sync(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    return wall, {e.key: e.self_device_time_total for e in kernels}, {e.key: e.count for e in kernels}


def profile(engine: NativeEngine, requests: list[GenerationRequest], device, rows: int = 30) -> None:
    """One decode step's kernels: a profiled call that only prefills (one new token each) taken from
    a profiled call of full budgets, divided by the NEW - 1 decode steps between them. A whole
    call's table mixes the prompts' prefill into every kernel that both phases run (the matmuls)."""
    prefill_only = [GenerationRequest(r.prompt_tokens, r.step, r.prompt_index, r.sample_index, max_new_tokens=1)
                    for r in requests]
    engine.generate(requests)  # warm-up: compile, graph capture
    engine.generate(prefill_only)
    short_wall, short, short_counts = kernel_times(engine, prefill_only, device)
    full_wall, full, full_counts = kernel_times(engine, requests, device)
    steps = NEW - 1
    per_step = {k: (full.get(k, 0.0) - short.get(k, 0.0)) / steps for k in full}
    launches = {k: (full_counts[k] - short_counts.get(k, 0)) / steps for k in full_counts}
    busy = sum(per_step.values())
    print(f"batch {len(requests)}: whole call {full_wall * 1e3:.1f} ms, prefill-only call {short_wall * 1e3:.1f} ms "
          f"(device {sum(short.values()) / 1e3:.1f} ms); per decode step: wall {(full_wall - short_wall) / steps * 1e3:.2f} ms, "
          f"device {busy / 1e3:.2f} ms, {sum(launches.values()):.0f} kernels", flush=True)
    for name, us in sorted(per_step.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"{us:9.1f} µs  {us / busy:6.1%}  {launches[name]:6.1f}×  {name[:100]}", flush=True)


def idle_gaps(engine: NativeEngine, requests: list[GenerationRequest], device) -> None:
    """Where one generate call leaves the device idle: the gaps between consecutive kernels by size
    (under a microsecond they are kernel boundaries inside a graph; the large ones are the host's
    checks and prefill), and the host's CUDA calls by total time (`cudaGraphLaunch` per replay)."""
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine.generate(requests)  # warm-up: compile, graph capture
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(requests)
        sync(device)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        print("no device kernels in the trace (a CPU run)", flush=True)
        return
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(kernels, kernels[1:])]
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy = sum(e["dur"] for e in kernels)
    print(f"batch {len(requests)}: {len(kernels)} kernels over {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, "
          f"idle {(span - busy) / 1e3:.1f} ms", flush=True)
    for lo, hi in ((0, 1), (1, 10), (10, 200), (200, math.inf)):
        inside = [g for g in gaps if lo <= g < hi]
        print(f"  gaps of {lo}-{hi} µs: {len(inside):7d}, {sum(inside) / 1e3:8.2f} ms", flush=True)
    calls: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            calls.setdefault(e["name"], []).append(e["dur"])
    for name, durations in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:6]:
        print(f"  host {name}: {len(durations)} calls, {sum(durations) / 1e3:.2f} ms "
              f"({sum(durations) / len(durations):.1f} µs each)", flush=True)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.6b")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--baselines", default="hf,hf_static", help="comma list of hf, hf_static; '' for none")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--long-tail", action="store_true")
    parser.add_argument("--one-batch-tail", action="store_true", help="one batch of long-tailed budgets, no refill")
    parser.add_argument("--groups", type=int, default=8, help="also time batch-sized runs of prompts x this many samples")
    parser.add_argument("--bandwidth", type=float, default=4.3e12)
    parser.add_argument("--quick", action="store_true", help="tiny shape, small vocab: a CPU smoke test")
    parser.add_argument("--sync-every", type=int, default=8, help="the engine's generation.sync_every")
    parser.add_argument("--profile", action="store_true", help="print one decode step's kernels (prefill taken out)")
    parser.add_argument("--gaps", action="store_true", help="print where one call leaves the device idle")
    return parser.parse_args()


def reset_peak(device: torch.device) -> int:
    """Start one configuration's memory peak: free what earlier ones left for the garbage collector
    (an engine's graphs and K/V cache), then return the bytes still allocated, which `peak_gb` takes off."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_gb(device: torch.device, before: int) -> float | None:
    """GB this configuration allocated at its peak beyond the `before` bytes it started with."""
    return (torch.cuda.max_memory_allocated(device) - before) / 1e9 if device.type == "cuda" else None


def time_ours(opts: argparse.Namespace, args: ModelArgs, batch: int, vocab: int, device: torch.device,
              base: dict) -> tuple[float, float]:
    """Our engine on `batch` prompts (and, with --groups, on batch/groups prompts x groups samples):
    emits its line; returns its tok/s and the roofline's."""
    reqs = [GenerationRequest(p, 0, i, 0) for i, p in enumerate(prompts(batch, vocab))]
    before = reset_peak(device)
    engine = build_engine(args, device, batch, PROMPT + NEW, sync_every=opts.sync_every)
    if opts.profile:
        profile(engine, reqs, device)
    if opts.gaps:
        idle_gaps(engine, reqs, device)
    seconds, out = time_engine(engine, reqs, device, opts.reps)
    ours = output_tokens(out) / seconds
    roof = roofline(args, batch, PROMPT + NEW / 2, opts.bandwidth)
    record = dict(base, bench="generate", batch=batch, engine="tandem", tok_s=round(ours), roofline_tok_s=round(roof),
                  roofline_fraction=round(ours / roof, 3), peak_gb=peak_gb(device, before))
    if opts.groups > 1 and batch % opts.groups == 0:
        grouped = [GenerationRequest(p, 0, i, s) for i, p in enumerate(prompts(batch // opts.groups, vocab))
                   for s in range(opts.groups)]
        g_seconds, g_out = time_engine(engine, grouped, device, opts.reps)
        record[f"tok_s_{batch // opts.groups}x{opts.groups}_shared_prefill"] = round(output_tokens(g_out) / g_seconds)
    emit(record)
    engine.close()
    return ours, roof


def time_baseline(name: str, opts: argparse.Namespace, args: ModelArgs, batch: int, vocab: int, device: torch.device,
                  base: dict, ours: float, roof: float) -> None:
    """HF `generate` (`name`: hf, or hf_static with a static cache and compile) on the same prompts."""
    before = reset_peak(device)
    model = hf_model(args, device, static=name == "hf_static")
    hf_seconds = time_hf(model, prompts(batch, vocab), device, name == "hf_static", max(1, opts.reps - 1))
    hf = batch * NEW / hf_seconds
    emit(dict(base, bench="generate", batch=batch, engine=name, tok_s=round(hf), roofline_fraction=round(hf / roof, 3),
              tandem_over_this=round(ours / hf, 2), peak_gb=peak_gb(device, before)))


def time_long_tail(opts: argparse.Namespace, args: ModelArgs, vocab: int, device: torch.device, base: dict) -> None:
    """Long-tailed completion budgets against equal ones of the same mean, on one engine."""
    budgets = long_tail_budgets(64 if opts.quick else 2048)
    mean_budget = round(sum(budgets) / len(budgets))
    batch = 16 if opts.quick else 256
    engine = build_engine(args, device, batch, PROMPT + max(budgets), sync_every=opts.sync_every)
    runs = {}
    for name, per_request in (("long_tail", budgets), ("equal_length", [mean_budget] * len(budgets))):
        seconds, out = time_engine(engine, budget_requests(per_request, vocab, seed=1), device, opts.reps)
        runs[name] = output_tokens(out) / seconds
    emit(dict(base, bench="generate_long_tail", requests=len(budgets), max_batch=batch,
              budget_min=min(budgets), budget_median=sorted(budgets)[len(budgets) // 2],
              budget_mean=mean_budget, budget_max=max(budgets),
              long_tail_tok_s=round(runs["long_tail"]), equal_length_tok_s=round(runs["equal_length"]),
              ratio=round(runs["long_tail"] / runs["equal_length"], 3)))
    engine.close()


def time_one_batch_tail(opts: argparse.Namespace, args: ModelArgs, vocab: int, device: torch.device,
                        base: dict) -> None:
    """One batch of long-tailed budgets, no refill: the time the last long rows take alone."""
    budgets = long_tail_budgets(16 if opts.quick else 128, hi=64.0 if opts.quick else 2048.0)
    engine = build_engine(args, device, len(budgets), PROMPT + max(budgets), sync_every=opts.sync_every)
    seconds, out = time_engine(engine, budget_requests(budgets, vocab, seed=2), device, opts.reps)
    emit(dict(base, bench="generate_one_batch_tail", requests=len(budgets), budget_median=sorted(budgets)[len(budgets) // 2],
              budget_max=max(budgets), seconds=round(seconds, 3), tok_s=round(output_tokens(out) / seconds)))
    engine.close()


def main() -> None:
    opts = parse()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        # As a generator rank does (and for the HF baselines alike): one host thread ran the engine
        # 2-3% faster than a thread per core on an H100.
        one_host_thread()
    vocab = 512 if opts.quick else VOCAB
    shapes = ["tiny"] if opts.quick else opts.shapes.split(",")
    base = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__, commit=commit(), prompt=PROMPT, new_tokens=NEW)
    for shape in shapes:
        args = model_args(shape, vocab)
        for batch in [int(b) for b in opts.batches.split(",")]:
            ours, roof = time_ours(opts, args, batch, vocab, device, dict(base, shape=shape))
            for name in [b for b in opts.baselines.split(",") if b]:
                time_baseline(name, opts, args, batch, vocab, device, dict(base, shape=shape), ours, roof)
        if opts.long_tail:
            time_long_tail(opts, args, vocab, device, dict(base, shape=shape))
        if opts.one_batch_tail:
            time_one_batch_tail(opts, args, vocab, device, dict(base, shape=shape))

if __name__ == "__main__":
    main()
