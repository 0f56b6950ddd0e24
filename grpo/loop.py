"""The training loop of one launch: the components each rank builds for its role, and the steps.

Every rank runs the same sequence of collectives; what a rank does inside a step depends on its
role (generator, trainer, or both when colocated).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.config import Config
from grpo.data import CharTokenizer, DigitTask, Prompt
from grpo.engine import NativeEngine, SamplingParams
from grpo.episode import EpisodeBatch
from grpo.metrics import MetricsLogger
from grpo.roles import Roles
from grpo.rollout import generate_episodes, score_episodes
from grpo.scorer import Scorer
from grpo.trainer import Trainer
from grpo.transport import exchange_episodes
from grpo.weight_sync import WeightSync
from model import ModelArgs, Transformer
from model.hf import save_hf
from rewards import RewardError


class RunAborted(RuntimeError):
    """Another rank hit an error; this rank stops at the same step without a message of its own."""


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


def reduce(values: dict[str, float], group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> dict[str, float]:
    """All-reduce a dict of floats over `group` (CPU tensors: gloo)."""
    tensor = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=group)
    return dict(zip(values, tensor.tolist()))


class Run:
    """The components of one job on this rank, built according to its role."""

    def __init__(self, cfg: Config, device: torch.device, roles: Roles, scorer: Scorer | None):
        self.cfg, self.device, self.roles, self.scorer = cfg, device, roles, scorer
        self.dtype = compute_dtype(cfg, device)
        self.tokenizer = CharTokenizer()
        self.task = DigitTask(
            cfg.data.task, self.tokenizer, cfg.data.digits_min, cfg.data.digits_max, cfg.job.seed, cfg.eval.num_prompts
        )
        self.args = args = builtin_model_args(cfg, self.tokenizer.vocab_size)
        self.trainer_group = roles.trainer_mesh.get_group() if roles.trainer_mesh is not None else None
        self.trainer = self.engine = None
        if roles.is_trainer:
            torch.manual_seed(cfg.job.seed)
            policy = Transformer(args, dtype=torch.float32, device=device)
            policy.init_weights()
            self.trainer = Trainer(
                policy,
                roles.trainer_mesh,
                device,
                self.dtype,
                cfg.grpo,
                cfg.optimizer,
                total_steps=cfg.training.steps,
                micro_batch_size=cfg.training.micro_batch_size,
                temperature=cfg.generation.temperature,
                activation_checkpointing=cfg.model.activation_checkpointing,
                compile=cfg.model.compile,
            )
        gen = cfg.generation
        if roles.is_generator:
            self.engine = NativeEngine(
                args,
                SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k),
                eos_ids=self.tokenizer.eos_ids,
                seed=cfg.job.seed,
                dtype=self.dtype,
                device=device,
                pad_id=self.tokenizer.pad_id,
                stop_strings=gen.stop,
                decode_text=self.tokenizer.decode,
            )
        with torch.device("meta"):
            shapes = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
        self.weight_bytes = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=self.dtype).element_size()
        self.weight_sync = None
        if roles.split:
            self.weight_sync = WeightSync(
                shapes, roles.trainer_ranks, roles.weight_groups, self.dtype, device, cfg.parallelism.weight_bucket_mb * 2**20
            )
        self.greedy = SamplingParams(gen.max_new_tokens, temperature=0.0)

    def sync_weights(self, version: int) -> float:
        """Push the trainer's weights into every engine; returns the seconds it took."""
        start = time.perf_counter()
        if not self.roles.split:
            self.engine.update_weights([self.trainer.full_weights(self.dtype)], version)
        elif self.roles.is_trainer:
            self.weight_sync.send(dict(self.trainer.model.named_parameters()))
        else:
            self.weight_sync.receive(self.engine, version)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def export_hf(self, path: Path) -> None:
        """Write the fp32 master weights as an HF folder from the first trainer rank. Collective over trainers."""
        if not self.roles.is_trainer:
            return
        weights = ((name, tensor) for name, _, tensor in self.trainer.full_weights(torch.float32))
        if self.roles.rank == self.roles.leader:
            save_hf(self.args, weights, path)
        else:
            for _ in weights:
                pass

    def collect_episodes(
        self, prompts: list[Prompt], group_size: int, step: int, sampling: SamplingParams | None = None
    ) -> tuple[EpisodeBatch | None, float]:
        """Generate on generator ranks, deliver whole groups to trainer ranks.
        Returns (this trainer's episodes or None, generation seconds of the slowest generator)."""
        roles = self.roles
        generators = len(roles.generator_ranks)
        batch, generate_s = None, 0.0
        if roles.is_generator:
            mine = prompts[roles.generator_ranks.index(roles.rank) :: generators]
            start = time.perf_counter()
            batch = generate_episodes(self.engine, mine, group_size, step, self.tokenizer.pad_id, sampling)
            generate_s = time.perf_counter() - start
        if roles.split:
            return exchange_episodes(batch, roles, math.ceil(len(prompts) / generators), generate_s)
        return batch, reduce({"t": generate_s}, None, dist.ReduceOp.MAX)["t"]

    def score(self, episodes: EpisodeBatch, prompts: list[Prompt], group_size: int) -> dict[str, float]:
        """Score on trainer ranks; every rank (generators too) learns whether any trainer failed."""
        failure = None
        sums: dict[str, float] = {}
        if self.roles.is_trainer:
            try:
                sums = score_episodes(
                    self.scorer, episodes, {p.index: p for p in prompts}, self.tokenizer.decode, group_size
                ).per_function
            except RewardError as error:
                failure = error
        flag = {"failed": float(failure is not None)}
        if self.roles.split:
            if self.roles.is_trainer:
                flag = reduce(flag, self.trainer_group, dist.ReduceOp.MAX)
            flag_tensor = torch.tensor([flag["failed"]])
            dist.broadcast(flag_tensor, src=self.roles.leader, group=self.roles.control_group)
            flag["failed"] = float(flag_tensor)
        else:
            flag = reduce(flag, None, dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if flag["failed"]:
            raise RunAborted()
        return sums

    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts, scored on trainer ranks."""
        prompts = self.task.eval_prompts
        episodes, _ = self.collect_episodes(prompts, 1, step=0, sampling=self.greedy)
        self.score(episodes, prompts, group_size=1)
        if not self.roles.is_trainer:
            return {}
        totals = reduce(
            {"reward": float(episodes.rewards.sum()), "length": float(episodes.completion_lens.sum())},
            self.trainer_group,
        )
        return {"eval/reward_mean": totals["reward"] / len(prompts), "eval/length_mean": totals["length"] / len(prompts)}

    def step(self, step: int) -> dict[str, float]:
        """One RL step; returns the step's metrics on trainer ranks ({} on generator-only ranks)."""
        cfg = self.cfg
        start = time.perf_counter()
        prompts = self.task.train_prompts(step, cfg.data.prompts_per_step)
        episodes, generate_s = self.collect_episodes(prompts, cfg.grpo.group_size, step)
        score_start = time.perf_counter()
        reward_sums = self.score(episodes, prompts, cfg.grpo.group_size)
        train_start = time.perf_counter()
        train_metrics = self.trainer.train(episodes) if self.roles.is_trainer else {}
        train_end = time.perf_counter()
        sync_s = self.sync_weights(step)
        if not self.roles.is_trainer:
            return {}
        sums = reduce(
            {
                "reward": float(episodes.rewards.sum()),
                "episodes": float(len(episodes)),
                "completion_tokens": float(episodes.completion_lens.sum()),
                "tokens": float(episodes.seq_lens.sum()),
                "truncated": float(episodes.truncated.sum()),
                **{f"reward/{name}": total for name, total in reward_sums.items()},
            },
            self.trainer_group,
        )
        slowest = reduce(
            {"score": train_start - score_start, "train": train_end - train_start, "sync": sync_s},
            self.trainer_group,
            dist.ReduceOp.MAX,
        )
        n = sums["episodes"]
        return {
            "reward/mean": sums["reward"] / n,
            **{key: sums[key] / n for key in sums if key.startswith("reward/")},
            "episode/length_mean": sums["completion_tokens"] / n,
            "episode/truncated_frac": sums["truncated"] / n,
            **train_metrics,
            "time/generate_s": generate_s,
            "time/score_s": slowest["score"],
            "time/train_s": slowest["train"],
            "time/weight_sync_s": slowest["sync"],
            "time/step_s": time.perf_counter() - start,
            "throughput/generate_tok_s": sums["completion_tokens"] / max(generate_s, 1e-9),
            "throughput/train_tok_s": sums["tokens"] * cfg.grpo.num_iterations / max(slowest["train"], 1e-9),
            "weight_sync/GBps": self.weight_bytes / max(slowest["sync"], 1e-9) / 1e9,
        }


def run_loop(cfg: Config, job: Run) -> None:
    """Sync weights, evaluate, then training steps with exports and a final evaluation and summary."""
    start = time.perf_counter()
    roles = job.roles
    is_leader = roles.rank == roles.leader
    logger = MetricsLogger(cfg.job.output_dir, is_leader, cfg.metrics.console, cfg.training.steps)
    job.sync_weights(version=0)
    first_eval = last_eval = job.evaluate()
    logger.log(0, first_eval)
    for step in range(1, cfg.training.steps + 1):
        metrics = job.step(step)
        if step == cfg.training.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            last_eval = job.evaluate()
            metrics.update(last_eval)
        logger.log(step, metrics)
        every = cfg.checkpoint.export_hf_every
        if step == cfg.training.steps or (every and step % every == 0):
            job.export_hf(Path(cfg.job.output_dir) / "hf" / f"step_{step}")
    if is_leader:
        print(
            f"done: {cfg.training.steps} steps in {time.perf_counter() - start:.0f} s "
            f"({cfg.parallelism.mode}, {len(roles.generator_ranks)} generator / {len(roles.trainer_ranks)} trainer ranks); "
            f"held-out reward {first_eval['eval/reward_mean']:.3f} -> {last_eval['eval/reward_mean']:.3f} "
            f"(greedy, {len(job.task.eval_prompts)} prompts); metrics: {logger.path}",
            flush=True,
        )
