"""Generation and weight sync on one GPU: the native engine, vLLM running our model (the vLLM
engine), and vLLM running its own Qwen3, in the same run, one JSON line per configuration.

    python3 bench/vllm_engines.py [--shapes 0.6b,8b] [--batches 64,256] [--engines native,tandem_vllm,vllm]

The workload of bench/generate.py: random bf16 weights of a Qwen3 shape, prompts of 128 random
tokens, 256 new tokens forced, sampling at T = 1 over the full vocabulary, output tokens/s over the
whole call (prefill included), best of `--reps` after a warm-up. Each engine runs in a process of
its own (a fresh GPU), one after another.

- native: `NativeEngine` (CUDA graphs, compile).
- tandem_vllm: `VLLMEngine`, our model inside vLLM (its CUDA graphs, torch.compile, attention);
  `seeded` (each request seeded by its key, our batch-independence contract) and `unseeded`
  (vLLM's one generator for the batch).
- vllm: vLLM's own Qwen3 (`load_format="dummy"`), with the sampled tokens' log-probs (as RL needs
  them: `logprobs=0`) and `plain`.

`--profile DIR`: after the timed runs, one more generate call at the largest batch runs under the
torch profiler (vLLM's own profiler config for the vLLM engines, in their worker); the parent
prints its kernels' device time per decode step, by kernel, as one JSON line per engine.

Weight sync: the same bf16 weights pushed into the native engine and into the vLLM engine (one
bucket of every parameter, as a colocated rank does; best of 3), then checked bitwise in vLLM's
worker through a hash of each parameter's bits.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generate import NEW, PROMPT, VOCAB, output_tokens, prompts, roofline, time_engine  # noqa: E402
from bench.provenance import commit  # noqa: E402
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams  # noqa: E402
from grpo.engine.cache import slot_bytes  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

SHAPES = {
    "0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072, tie_embeddings=True),
    "8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, tie_embeddings=False),
    "tiny": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, tie_embeddings=True),
}

def model_args(shape: str) -> ModelArgs:
    return ModelArgs(arch="qwen3", vocab_size=VOCAB, rope_theta=1e6, **SHAPES[shape])


def weights(args: ModelArgs) -> list:
    """The trainer's cast weights: one bucket of (name, (), bf16 tensor) on the GPU."""
    torch.manual_seed(0)
    model = Transformer(args, dtype=torch.bfloat16, device="cuda")
    model.init_weights()
    return [[(n, (), p.detach()) for n, p in model.named_parameters()]]


def time_sync(engine, bucket: list) -> float:
    best = math.inf
    for version in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.update_weights(bucket, version)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def bit_hash(t: torch.Tensor) -> list[int]:
    bits = t.contiguous().view(torch.int16).flatten().to(torch.int64)
    return [int(bits.sum()), int((bits * (torch.arange(bits.numel(), device=bits.device) % 65521)).sum())]


def worker_bit_hashes(worker) -> dict[str, list[int]]:
    """Run inside vLLM's worker: bit_hash of each of the model's parameters."""
    return {n: bit_hash(p.detach()) for n, p in worker.model_runner.get_model().model.named_parameters()}


def profiler_options(folder: str | None) -> dict:
    """vllm.LLM's profiler config writing torch traces of the worker to `folder` (none: no profiler)."""
    if not folder:
        return {}
    return dict(profiler_config=dict(profiler="torch", torch_profiler_dir=folder, torch_profiler_with_stack=False,
                                     ignore_frontend=True))


def kernel_summary(folder: str, steps: int, top: int = 15) -> dict:
    """Device time of the kernels in the newest trace under `folder`, per decode step: total and the
    `top` kernels by time (names cut to 90 characters), in microseconds."""
    traces = sorted(Path(folder).rglob("*.json*"), key=lambda f: f.stat().st_mtime)
    if not traces:
        return dict(error=f"no trace under {folder}")
    opener = gzip.open if traces[-1].suffix == ".gz" else open
    with opener(traces[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    totals: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            totals[e["name"][:90]] = totals.get(e["name"][:90], 0.0) + e.get("dur", 0.0)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return dict(device_us_per_step=round(sum(totals.values()) / steps, 1),
                top_us_per_step=[[name, round(us / steps, 1)] for name, us in ranked])


def profile_native(engine: NativeEngine, reqs: list, folder: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(reqs)
        torch.cuda.synchronize()
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, "native.json"))


def run_native(args: ModelArgs, batches: list[int], reps: int, profile_dir: str | None = None) -> list[dict]:
    engine = NativeEngine(args, SamplingParams(max_new_tokens=NEW), eos_ids=[], seed=0, dtype=torch.bfloat16,
                          device="cuda", max_batch_size=max(batches), max_seq_len=PROMPT + NEW)
    bucket = weights(args)
    sync_s = time_sync(engine, bucket)
    del bucket
    out = []
    for batch in batches:
        reqs = [GenerationRequest(p, 0, i, 0) for i, p in enumerate(prompts(batch, VOCAB))]
        seconds, done = time_engine(engine, reqs, torch.device("cuda"), reps)
        out.append(dict(engine="native", batch=batch, tok_s=round(output_tokens(done) / seconds)))
    if profile_dir:
        profile_native(engine, reqs, profile_dir)
    out.append(dict(engine="native", sync_s=round(sync_s, 4)))
    return out


def run_tandem_vllm(args: ModelArgs, batches: list[int], reps: int, profile_dir: str | None = None) -> list[dict]:
    from grpo.engine.vllm_engine import VLLMEngine

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the bitwise check sends a function to the worker
    engine = VLLMEngine(args, SamplingParams(max_new_tokens=NEW), eos_ids=[], seed=0, dtype=torch.bfloat16,
                        device="cuda", max_seq_len=PROMPT + NEW, max_batch_size=max(batches),
                        llm_options=profiler_options(profile_dir))
    bucket = weights(args)
    sync_s = time_sync(engine, bucket)
    want = {n: bit_hash(t) for n, _, t in bucket[0]}
    got = engine.llm.collective_rpc(worker_bit_hashes)[0]
    rpc = []
    for _ in range(20):
        start = time.perf_counter()
        engine.llm.collective_rpc("tandem_device_bytes")
        rpc.append(time.perf_counter() - start)
    del bucket
    out = []
    for batch in batches:
        reqs = [GenerationRequest(p, 0, i, 0) for i, p in enumerate(prompts(batch, VOCAB))]
        for seeded in (True, False):
            engine.request_seeds = seeded
            seconds, done = time_engine(engine, reqs, torch.device("cuda"), reps)
            out.append(dict(engine="tandem_vllm", variant="seeded" if seeded else "unseeded", batch=batch,
                            tok_s=round(output_tokens(done) / seconds)))
    if profile_dir:
        engine.request_seeds = True
        engine.llm.start_profile()
        engine.generate(reqs)
        engine.llm.stop_profile()
    out.append(dict(engine="tandem_vllm", sync_s=round(sync_s, 4), sync_bitwise_equal=got == want,
                    rpc_ms_median=round(sorted(rpc)[len(rpc) // 2] * 1e3, 3), staging_mb=engine._staging.numel * 2 / 2**20,
                    outside_gb=round(engine.outside_bytes() / 1e9, 2)))
    engine.close()
    return out


def run_vllm(args: ModelArgs, batches: list[int], reps: int, profile_dir: str | None = None) -> list[dict]:
    from vllm import LLM
    from vllm import SamplingParams as VLLMSampling
    from vllm.inputs import TokensPrompt

    folder = tempfile.mkdtemp(prefix="vllm-qwen3-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(args.to_hf_config(), f)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    kv = int(slot_bytes(args, PROMPT + NEW, torch.bfloat16) * max(batches) * 1.1)
    free, total = torch.cuda.mem_get_info()
    llm = LLM(model=folder, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", seed=0,
              max_model_len=PROMPT + NEW, max_num_seqs=max(batches), kv_cache_memory_bytes=kv,
              gpu_memory_utilization=(free - 2**31) / total, **profiler_options(profile_dir))
    out = []
    for batch in batches:
        batch_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts(batch, VOCAB)]
        for variant, logprobs in (("logprobs", 0), ("plain", None)):
            params = VLLMSampling(temperature=1.0, max_tokens=NEW, min_tokens=NEW, ignore_eos=True,
                                  logprobs=logprobs, detokenize=False)
            llm.generate(batch_prompts, params, use_tqdm=False)
            best = math.inf
            for _ in range(reps):
                start = time.perf_counter()
                done = llm.generate(batch_prompts, params, use_tqdm=False)
                best = min(best, time.perf_counter() - start)
            tokens = sum(len(o.outputs[0].token_ids) for o in done)
            out.append(dict(engine="vllm", variant=variant, batch=batch, tok_s=round(tokens / best)))
    if profile_dir:  # the RL variant, at the largest batch
        params = VLLMSampling(temperature=1.0, max_tokens=NEW, min_tokens=NEW, ignore_eos=True, logprobs=0, detokenize=False)
        llm.start_profile()
        llm.generate(batch_prompts, params, use_tqdm=False)
        llm.stop_profile()
    return out


RUNNERS = {"native": run_native, "tandem_vllm": run_tandem_vllm, "vllm": run_vllm}


def first_exception(stderr: str) -> str:
    """The first exception line of a child's stderr: in a chain of tracebacks the first is the cause
    (a missing package surfaces as a later import error of something else)."""
    found = re.search(r"^(\w+\.)*\w*(Error|Exception): .*$", stderr, flags=re.MULTILINE)
    return found.group(0)[:300] if found else "no exception line in its stderr"


def child(opts) -> None:
    args = model_args(opts.shape)
    folder = os.path.join(os.path.abspath(opts.profile), f"{opts.shape}-{opts.engine}") if opts.profile else None
    for record in RUNNERS[opts.engine](args, [int(b) for b in opts.batches.split(",")], opts.reps, folder):
        print("RESULT " + json.dumps(record), flush=True)


def base_record() -> dict:
    """What every JSON line of this run repeats: the bench, device, versions (vLLM's where it imports) and workload."""
    base = dict(bench="vllm_engines", device=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit(),
                prompt=PROMPT, new_tokens=NEW)
    try:
        import vllm

        base["vllm"] = vllm.__version__
    except ImportError:
        pass
    return base


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.6b,8b")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--engines", default="native,tandem_vllm,vllm")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--timeout", type=int, default=900, help="seconds per engine process (vLLM starts in 1-3 min: it compiles)"
    )
    parser.add_argument("--profile", default="", help="folder for one profiled generate call per engine (largest batch)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        return child(opts)
    base = base_record()
    for shape in opts.shapes.split(","):
        results: dict[tuple, int] = {}
        for engine in opts.engines.split(","):
            command = [sys.executable, __file__, "--child", "--shape", shape, "--engine", engine,
                       "--batches", opts.batches, "--reps", str(opts.reps), "--profile", opts.profile]
            start = time.perf_counter()
            try:
                proc = subprocess.run(command, capture_output=True, text=True, timeout=opts.timeout)
            except subprocess.TimeoutExpired:
                print(json.dumps(dict(base, shape=shape, engine=engine, error=f"timed out after {opts.timeout} s")), flush=True)
                continue
            records = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                error = f"exit {proc.returncode}: {first_exception(proc.stderr)}"
                print(json.dumps(dict(base, shape=shape, engine=engine, error=error)), flush=True)
            for record in records:
                record = dict(base, shape=shape, **record, process_s=round(time.perf_counter() - start, 1))
                if "batch" in record:
                    results[(record["engine"], record.get("variant"), record["batch"])] = record["tok_s"]
                    record["roofline_fraction"] = round(
                        record["tok_s"] / roofline(model_args(shape), record["batch"], PROMPT + NEW / 2, 4.3e12), 3)
                print(json.dumps(record), flush=True)
            if opts.profile:
                folder = os.path.join(os.path.abspath(opts.profile), f"{shape}-{engine}")
                summary = kernel_summary(folder, NEW)
                print(json.dumps(dict(base, shape=shape, engine=engine, profile_batch=max(map(int, opts.batches.split(","))),
                                      **summary)), flush=True)
        for batch in (int(b) for b in opts.batches.split(",")):
            vllm_rl = results.get(("vllm", "logprobs", batch))
            ratios = {}
            for name, key in (("native", ("native", None, batch)), ("tandem_vllm", ("tandem_vllm", "seeded", batch)),
                              ("tandem_vllm_unseeded", ("tandem_vllm", "unseeded", batch))):
                if vllm_rl and key in results:
                    ratios[f"{name}_over_vllm_logprobs"] = round(results[key] / vllm_rl, 3)
            if ratios:
                print(json.dumps(dict(base, shape=shape, batch=batch, **ratios)), flush=True)


if __name__ == "__main__":
    main()
