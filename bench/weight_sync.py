"""Weight sync, trainer -> generator, in memory vs through a file, in one run.

    torchrun --nproc_per_node=2 bench/weight_sync.py                  # 1 generator GPU + 1 trainer GPU
    torchrun --nproc_per_node=3 bench/weight_sync.py --generators 1   # 1 generator + 2 trainers

The model is Qwen3-0.6B-shaped with random weights (fp32 masters sharded by FSDP2 on the trainer
ranks, a bf16 engine on the generator ranks). In-memory: grpo.distributed.weight_sync.WeightSync, bucketed
broadcasts over NCCL. Baseline: the trainers gather the bf16 weights, the first writes them as
safetensors, the generators read them back and copy them into the engine. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.distributed.roles import build_roles  # noqa: E402
from grpo.distributed.weight_sync import WeightSync  # noqa: E402
from grpo.engine import NativeEngine, SamplingParams  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from model.parallelize import parallelize  # noqa: E402

QWEN3_0_6B = ModelArgs(
    arch="qwen3", vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
    ffn_dim=3072, rope_theta=1e6, tie_embeddings=True,
)


def timed(fn, device: torch.device, group=None) -> float:
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
    return time.perf_counter() - start


def start_process_group() -> torch.device:
    """This rank's device, with the process group up (NCCL for CUDA tensors, gloo for the host's)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device)
    return device


def through_file(roles, params, engine, folder: Path, dtype: torch.dtype, device: torch.device) -> None:
    """The baseline: the trainers gather full bf16 tensors (a collective), the first writes them as
    safetensors, the generators read them back and copy them into the engine."""
    if roles.is_trainer:
        full = {n: p.full_tensor().to(dtype) for n, p in params.items()}
        if roles.rank == roles.leader:
            folder.mkdir(exist_ok=True)
            save_file({n: t.contiguous() for n, t in full.items()}, str(folder / "model.safetensors"))
        del full
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    if roles.is_generator:
        loaded = load_file(str(folder / "model.safetensors"), device=str(device))
        engine.update_weights([((n, (), t) for n, t in loaded.items())], version=2)


def engine_holds_masters(roles, engine, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every engine holds the trainer's fp32 masters cast to `dtype`, bit for bit: the
    generators rebuild the same seeded init and compare (a collective)."""
    exact = torch.ones(1)
    if roles.is_generator:
        torch.manual_seed(0)
        reference = Transformer(args, dtype=torch.float32, device=device)
        reference.init_weights()
        engine_params = dict(engine.model.named_parameters())
        exact[0] = float(all(torch.equal(engine_params[n], p.to(dtype)) for n, p in reference.named_parameters()))
        del reference
    dist.all_reduce(exact, op=dist.ReduceOp.MIN)
    return bool(exact[0])


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--generators", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--file-reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B.n_layers)
    return parser.parse_args()


def build_side(roles, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> tuple[dict | None, NativeEngine | None]:
    """This rank's side of the sync: a trainer's sharded fp32 parameters by name, or a generator's engine."""
    if not roles.is_trainer:
        return None, NativeEngine(args, SamplingParams(1), eos_ids=[0], seed=0, dtype=dtype, device=device)
    torch.manual_seed(0)
    trainer_model = Transformer(args, dtype=torch.float32, device=device)
    trainer_model.init_weights()
    parallelize(trainer_model, roles.trainer_mesh, compute_dtype=dtype)
    return dict(trainer_model.named_parameters()), None


def main() -> None:
    opts = parse()
    device = start_process_group()
    roles = build_roles("split", opts.generators, device)
    args = ModelArgs(**{**QWEN3_0_6B.__dict__, "n_layers": opts.layers})
    dtype = torch.bfloat16
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
    sync = WeightSync(shapes, roles.trainer_ranks, roles.weight_groups, dtype, device, opts.bucket_mb * 2**20)
    params, engine = build_side(roles, args, dtype, device)

    def in_memory() -> None:
        if roles.is_trainer:
            sync.send(params)
        else:
            sync.receive(engine, version=1)

    for _ in range(2):
        timed(in_memory, device)
    memory_s = sorted(timed(in_memory, device) for _ in range(opts.reps))
    exact = engine_holds_masters(roles, engine, args, dtype, device)

    folder = Path(tempfile.gettempdir()) / f"tandem-bench-{os.environ.get('MASTER_PORT', '0')}"
    file_sync = functools.partial(through_file, roles, params, engine, folder, dtype, device)
    timed(file_sync, device)
    file_s = sorted(timed(file_sync, device) for _ in range(opts.file_reps))
    memory_median, file_median = memory_s[len(memory_s) // 2], file_s[len(file_s) // 2]
    result = {
        "bench": "weight_sync",
        "params": sum(math.prod(s) for s in shapes.values()),
        "bytes": sync.total_bytes,
        "generators": len(roles.generator_ranks),
        "trainers": len(roles.trainer_ranks),
        "bucket_mb": opts.bucket_mb,
        "in_memory_bitwise_exact": exact,
        "in_memory_s_median": memory_median,
        "in_memory_s_min": memory_s[0],
        "in_memory_GBps": sync.total_bytes / memory_median / 1e9,
        "file_s_median": file_median,
        "speedup_vs_file": file_median / memory_median,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if roles.rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
