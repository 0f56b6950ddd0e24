"""tandem: GRPO post-training in native PyTorch, generation and training in one launch.

Launch (every rank generates, then trains; see config.toml for every key):

    torchrun --nproc_per_node=2 train_grpo.py --parallelism.mode=colocated
    python train_grpo.py --training.steps=20                 # one process
    torchrun --nproc_per_node=8 train_grpo.py --config my.toml --optimizer.lr=1e-6
"""

from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import closing

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from grpo.config import Config, ConfigError, load_config, write_resolved_config
from grpo.data import CharTokenizer, ReverseDigitsTask
from grpo.engine import NativeEngine, SamplingParams
from grpo.metrics import MetricsLogger
from grpo.rollout import evaluate, rollout
from grpo.scorer import Scorer
from grpo.trainer import Trainer
from model import ModelArgs, Transformer
from rewards import RewardError


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: Config) -> torch.device:
    """Join the process group (a one-rank group when not launched by torchrun) and pick the device."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    use_cuda = cfg.job.device == "cuda" or (cfg.job.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        # nccl for CUDA tensors, gloo for the small CPU tensors of control messages.
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.model.dtype)


def builtin_model_args(cfg: Config, vocab_size: int) -> ModelArgs:
    m = cfg.model
    return ModelArgs(
        arch="qwen3",
        vocab_size=vocab_size,
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        head_dim=m.dim // m.n_heads,
        ffn_dim=m.ffn_dim,
        tie_embeddings=True,
    )


def all_reduce_sums(values: dict[str, float], device: torch.device) -> dict[str, float]:
    tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return dict(zip(values, tensor.tolist()))


def run(cfg: Config) -> None:
    device = init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.job.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if rank == 0:
        write_resolved_config(cfg, os.path.join(cfg.job.output_dir, "config.toml"))
    scorer = Scorer(cfg.rewards.functions, cfg.rewards.weights, cfg.rewards.timeout_s, cfg.rewards.num_workers)
    try:
        _train(cfg, device, rank, world, scorer)
    finally:
        scorer.close()
        dist.destroy_process_group()


def _train(cfg: Config, device: torch.device, rank: int, world: int, scorer: Scorer) -> None:
    start = time.perf_counter()
    dtype = compute_dtype(cfg, device)
    tokenizer = CharTokenizer()
    task = ReverseDigitsTask(tokenizer, cfg.data.digits_min, cfg.data.digits_max, cfg.job.seed, cfg.eval.num_prompts)
    args = builtin_model_args(cfg, tokenizer.vocab_size)

    torch.manual_seed(cfg.job.seed)
    policy = Transformer(args, dtype=torch.float32, device=device)
    policy.init_weights()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("trainer",))
    trainer = Trainer(
        policy,
        mesh,
        device,
        dtype,
        cfg.grpo,
        cfg.optimizer,
        total_steps=cfg.training.steps,
        micro_batch_size=cfg.training.micro_batch_size,
        temperature=cfg.generation.temperature,
        activation_checkpointing=cfg.model.activation_checkpointing,
        compile=cfg.model.compile,
    )
    gen = cfg.generation
    engine = NativeEngine(
        args,
        SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k),
        eos_ids=tokenizer.eos_ids,
        seed=cfg.job.seed,
        dtype=dtype,
        device=device,
        pad_id=tokenizer.pad_id,
        stop_strings=gen.stop,
        decode_text=tokenizer.decode,
    )
    engine.update_weights([trainer.full_weights(dtype)], version=0)
    logger = MetricsLogger(cfg.job.output_dir, rank == 0, cfg.metrics.console, cfg.training.steps)
    engine_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())

    eval_prompts = task.eval_prompts[rank::world]

    def run_eval() -> dict[str, float]:
        reward_sum, length_sum = evaluate(engine, scorer, eval_prompts, gen.max_new_tokens, tokenizer.decode)
        totals = all_reduce_sums({"reward": reward_sum, "length": length_sum}, device)
        n = len(task.eval_prompts)
        return {"eval/reward_mean": totals["reward"] / n, "eval/length_mean": totals["length"] / n}

    first_eval = run_eval()
    logger.log(0, first_eval)
    last_eval = first_eval
    per_rank = cfg.data.prompts_per_step // world
    for step in range(1, cfg.training.steps + 1):
        t0 = time.perf_counter()
        prompts = task.train_prompts(step, cfg.data.prompts_per_step)[rank * per_rank : (rank + 1) * per_rank]
        try:
            result = rollout(engine, scorer, prompts, cfg.grpo.group_size, step, tokenizer.decode, tokenizer.pad_id)
            failure = None
        except RewardError as error:
            result, failure = None, error
        # Every rank learns of a reward failure on any rank, so all stop at the same point.
        failed = all_reduce_sums({"failed": float(failure is not None)}, device)["failed"]
        if failed:
            raise failure if failure is not None else RewardError("a reward function failed on another rank")
        episodes = result.episodes
        t_train = time.perf_counter()
        train_metrics = trainer.train(episodes)
        t_sync = time.perf_counter()
        engine.update_weights([trainer.full_weights(dtype)], version=step)
        t_end = time.perf_counter()

        sums = all_reduce_sums(
            {
                "reward": float(episodes.rewards.sum()),
                "episodes": float(len(episodes)),
                "completion_tokens": float(episodes.completion_lens.sum()),
                "tokens": float(episodes.seq_lens.sum()),
                "truncated": float(episodes.truncated.sum()),
                **{f"reward/{name}": total for name, total in result.reward_sums.items()},
            },
            device,
        )
        n = sums["episodes"]
        metrics = {
            "reward/mean": sums["reward"] / n,
            **{key: sums[key] / n for key in sums if key.startswith("reward/")},
            "episode/length_mean": sums["completion_tokens"] / n,
            "episode/truncated_frac": sums["truncated"] / n,
            **train_metrics,
            "time/generate_s": result.generate_s,
            "time/score_s": result.score_s,
            "time/train_s": t_sync - t_train,
            "time/weight_sync_s": t_end - t_sync,
            "time/step_s": t_end - t0,
            "throughput/generate_tok_s": sums["completion_tokens"] / result.generate_s,
            "throughput/train_tok_s": sums["tokens"] * cfg.grpo.num_iterations / (t_sync - t_train),
            "weight_sync/GBps": engine_bytes / (t_end - t_sync) / 1e9,
        }
        if step == cfg.training.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            last_eval = run_eval()
            metrics.update(last_eval)
        logger.log(step, metrics)

    if rank == 0:
        print(
            f"done: {cfg.training.steps} steps in {time.perf_counter() - start:.0f} s; held-out reward "
            f"{first_eval['eval/reward_mean']:.3f} -> {last_eval['eval/reward_mean']:.3f} "
            f"(greedy, {len(task.eval_prompts)} prompts); metrics: {logger.path}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except RewardError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
