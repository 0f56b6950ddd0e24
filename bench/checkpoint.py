"""Checkpoint save / load of the trainer's sharded state vs one gathered file, in one run.

    torchrun --nproc_per_node=2 bench/checkpoint.py --dir /tmp/ckpt-bench      # 2 trainer GPUs

The model is Qwen3-0.6B-shaped with random weights: fp32 masters sharded by FSDP2 over every rank
of the launch, with AdamW state (two fp32 moments), about 12 bytes per parameter. tandem's path is
grpo.train.checkpoint.save_checkpoint / load_checkpoint (DCP: each rank writes and reads its own shards,
written to a temporary folder and renamed). Baseline: the full model and optimizer state gathered
to the first rank and written with torch.save to one file, then read back. Also times the HF
export. Checks that a load restores every parameter bitwise. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.weight_sync import QWEN3_0_6B, start_process_group, timed  # noqa: E402
from grpo.config import GRPOConfig, OptimizerConfig  # noqa: E402
from grpo.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from grpo.train.export import export_hf  # noqa: E402
from grpo.train.trainer import Trainer  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402


def build_trainer(args: ModelArgs, device: torch.device, seed: int) -> Trainer:
    torch.manual_seed(seed)
    model = Transformer(args, dtype=torch.float32, device=device)
    model.init_weights()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return Trainer(model, mesh, device, torch.bfloat16 if device.type == "cuda" else torch.float32, GRPOConfig(),
                   OptimizerConfig(), total_steps=10, micro_batch_tokens=4096, temperature=1.0, max_new_tokens=8)


def take_a_step(trainer: Trainer) -> None:
    """Give AdamW its state with one update on random gradients."""
    for param in trainer.model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def restored_exactly(trainer: Trainer, fresh: Trainer, device: torch.device) -> bool:
    """Whether every rank's shards of fresh's parameters and AdamW moments equal trainer's bit for bit."""
    exact = torch.tensor([1], device=device)
    for saved, loaded in zip(trainer.model.parameters(), fresh.model.parameters()):
        pairs = [(saved, loaded)] + [
            (trainer.optimizer.state[saved][key], fresh.optimizer.state[loaded][key]) for key in ("exp_avg", "exp_avg_sq")
        ]
        for a, b in pairs:
            if not torch.equal(local(a), local(b)):
                exact.zero_()
    dist.all_reduce(exact, op=dist.ReduceOp.MIN)
    return bool(exact)


def gathered_save(trainer: Trainer, path: Path, is_first: bool) -> None:
    """The baseline: the whole model and optimizer state gathered to the host of the first rank,
    which writes it as one file."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer, options=full)
    if is_first:
        torch.save({"model": model_state, "optimizer": optim_state}, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True, help="scratch folder on the disk to measure")
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B.n_layers)
    opts = parser.parse_args()
    device = start_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    args = ModelArgs(**{**QWEN3_0_6B.__dict__, "n_layers": opts.layers})
    root = opts.dir / "checkpoints"
    if rank == 0:
        shutil.rmtree(opts.dir, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()

    trainer = build_trainer(args, device, seed=0)
    take_a_step(trainer)
    params = sum(p.numel() for p in trainer.model.parameters())
    save_s = timed(lambda: save_checkpoint(root, 1, trainer, None, {"step": 1}, rank == 0, keep=1), device)

    fresh = build_trainer(args, device, seed=1)
    take_a_step(fresh)
    load_s = timed(lambda: load_checkpoint(root / "step_1", fresh, None), device)
    exact = restored_exactly(trainer, fresh, device)

    baseline_file = opts.dir / "gathered.pt"
    baseline_save_s = timed(lambda: gathered_save(trainer, baseline_file, rank == 0), device)
    baseline_load_s = timed(lambda: torch.load(baseline_file, weights_only=False) if rank == 0 else None, device)
    export_s = timed(lambda: export_hf(trainer, args, None, opts.dir / "hf", rank == 0), device)

    if rank == 0:
        checkpoint_bytes = folder_bytes(root / "step_1")
        print(json.dumps({
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "ranks": world,
            "params": params,
            "checkpoint_GB": round(checkpoint_bytes / 1e9, 3),
            "save_s": round(save_s, 3),
            "save_GBps": round(checkpoint_bytes / save_s / 1e9, 2),
            "load_s": round(load_s, 3),
            "load_bitwise": bool(exact),
            "baseline_gathered_save_s": round(baseline_save_s, 3),
            "baseline_gathered_load_s": round(baseline_load_s, 3),
            "baseline_GB": round(baseline_file.stat().st_size / 1e9, 3),
            "save_speedup": round(baseline_save_s / save_s, 2),
            "export_hf_s": round(export_s, 3),
        }), flush=True)
        shutil.rmtree(opts.dir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
