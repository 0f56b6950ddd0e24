"""One launch's components and one RL step: what each rank builds for its role, and what it does
in a step (the schedule of steps is in schedule.py).

Every rank runs the same sequence of collectives; what a rank does inside a step depends on its
role (generator, trainer, or both when colocated).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.checkpoint import check_matches, checkpoint_bytes, export_hf
from grpo.config import Config
from grpo.data import CharTokenizer, DigitTask, Prompt
from grpo.datasets import HFTokenizer, load_hf_tokenizer
from grpo.engine import NativeEngine, SamplingParams
from grpo.episode import EpisodeBatch, compute_advantages, concat_episodes, overlong_penalty, zero_variance_groups
from grpo.faults import check_free_disk, waiting_for
from grpo.flops import mfu, peak_flops
from grpo.metrics import reduce_across
from grpo.roles import Roles
from grpo.rollout import generate_episodes, score_episodes
from grpo.scorer import Scorer
from grpo.tasks import DataError, prompt_source
from grpo.trainer import Trainer
from grpo.transport import exchange_episodes
from grpo.weight_sync import WeightSync
from model import ModelArgs, Transformer, from_hf
from rewards import RewardError


class RunAborted(RuntimeError):
    """Another rank hit an error; this rank stops at the same step without a message of its own."""


class TrainingDiverged(RuntimeError):
    """training.max_bad_steps consecutive steps had a non-finite loss or gradient norm."""


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

    def __init__(
        self, cfg: Config, device: torch.device, roles: Roles, scorer: Scorer | None, resume: Path | None = None
    ):
        """`resume`: the checkpoint this run continues from; it is checked against the model's
        shapes here, before any model is built."""
        self.cfg, self.device, self.roles, self.scorer = cfg, device, roles, scorer
        self.dtype = compute_dtype(cfg, device)
        if cfg.model.path:
            try:
                self.tokenizer = load_hf_tokenizer(cfg.model.path)
                self.task = prompt_source(cfg, self.tokenizer)
            except (ValueError, FileNotFoundError) as error:
                raise DataError(str(error)) from None
            self.args = args = ModelArgs.from_hf_dir(cfg.model.path)
        else:
            self.tokenizer = CharTokenizer()
            self.task = DigitTask(
                cfg.data.task, self.tokenizer, cfg.data.digits_min, cfg.data.digits_max, cfg.job.seed, cfg.eval.num_prompts
            )
            self.args = args = builtin_model_args(cfg, self.tokenizer.vocab_size)
        with torch.device("meta"):
            shapes = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
        if resume is not None:
            check_matches(resume, shapes)
        check_free_disk(cfg.job.output_dir, checkpoint_bytes(shapes))
        role = "colocated" if not roles.split else "generator" if roles.is_generator else "trainer"
        self.who = f"{role} rank {roles.rank}"
        self.trainer_group = roles.trainer_mesh.get_group() if roles.trainer_mesh is not None else None
        self.trainer = self.engine = None
        if roles.is_trainer:
            torch.manual_seed(cfg.job.seed)
            if cfg.model.path:
                policy = from_hf(cfg.model.path, dtype=torch.float32, device=device)
            else:
                policy = Transformer(args, dtype=torch.float32, device=device)
                policy.init_weights()
            reference = None
            if cfg.grpo.kl_coef > 0:
                # The KL anchor is the policy as it starts: a frozen copy of the initial weights.
                reference = Transformer(args, dtype=torch.float32, device=device)
                reference.load_state_dict(policy.state_dict())
            self.trainer = Trainer(
                policy,
                roles.trainer_mesh,
                device,
                self.dtype,
                cfg.grpo,
                cfg.optimizer,
                total_steps=cfg.training.steps,
                micro_batch_tokens=cfg.training.micro_batch_tokens,
                temperature=cfg.generation.temperature,
                max_new_tokens=cfg.generation.max_new_tokens,
                activation_checkpointing=cfg.model.activation_checkpointing,
                compile=cfg.model.compile and device.type == "cuda",
                reference=reference,
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
                stop_strings=gen.stop,
                decode_text=self.tokenizer.decode,
                max_batch_size=gen.max_batch_size,
                max_seq_len=gen.max_seq_len or self.task.max_prompt_tokens + gen.max_new_tokens,
                kv_cache_gb=gen.kv_cache_gb,
                kv_cache_fraction=gen.kv_cache_fraction,
                share_prefix=gen.share_prefix,
                cuda_graphs=gen.cuda_graphs,
                compile=gen.compile,
                sync_every=gen.sync_every,
            )
        self.weight_bytes = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=self.dtype).element_size()
        self.weight_sync = None
        if roles.split:
            self.weight_sync = WeightSync(
                shapes, roles.trainer_ranks, roles.weight_groups, self.dtype, device, cfg.parallelism.weight_bucket_mb * 2**20
            )
        self.greedy = SamplingParams(gen.max_new_tokens, temperature=0.0)
        # (peak FLOP/s of one trainer device, what that figure is), or None: no MFU is reported
        self.peak = peak_flops(device, self.dtype, cfg.metrics.peak_tflops)

    def sync_weights(self, version: int) -> float:
        """Push the trainer's weights into every engine; returns the seconds it took."""
        start = time.perf_counter()
        generators, trainers = self.peers()
        if not self.roles.split:
            with self.waiting(f"the other ranks' weight shards ({trainers})"):
                self.engine.update_weights([self.trainer.full_weights(self.dtype)], version)
        elif self.roles.is_trainer:
            with self.waiting(f"{generators} to take the weights"):
                self.weight_sync.send(dict(self.trainer.model.named_parameters()))
        else:
            with self.waiting(f"the weights from {trainers} (they train first)"):
                self.weight_sync.receive(self.engine, version)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def export_hf(self, path: Path) -> None:
        """Write the fp32 policy as an HF folder from the first trainer rank. Collective over trainers."""
        if not self.roles.is_trainer:
            return
        save_tokenizer = None
        if isinstance(self.tokenizer, HFTokenizer):
            save_tokenizer = lambda folder: self.tokenizer.hf.save_pretrained(str(folder))  # noqa: E731
        export_hf(self.trainer, self.args, save_tokenizer, path, self.roles.rank == self.roles.leader)

    def waiting(self, what: str):
        """Name this rank and `what` it waits for if a collective inside the block times out."""
        return waiting_for(self.who, what, self.cfg.parallelism.collective_timeout_s)

    def peers(self) -> tuple[str, str]:
        """How this rank names the ranks it waits on: (generator ranks, trainer ranks)."""
        return f"generator ranks {self.roles.generator_ranks}", f"trainer ranks {self.roles.trainer_ranks}"

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
        generator_names, trainer_names = self.peers()
        if roles.split:
            what = f"episodes from {generator_names}" if roles.is_trainer else f"the episode exchange with {trainer_names}"
            with self.waiting(what):
                return exchange_episodes(batch, roles, math.ceil(len(prompts) / generators), generate_s)
        with self.waiting("the other ranks' generation"):
            return batch, reduce({"t": generate_s}, None, dist.ReduceOp.MAX)["t"]

    def agree(self, value: float, op=dist.ReduceOp.MAX) -> float:
        """Reduce a trainer-side value over the trainer ranks and hand the result to every rank."""
        if not self.roles.split:
            return reduce({"v": value}, None, op)["v"]
        if self.roles.is_trainer:
            value = reduce({"v": value}, self.trainer_group, op)["v"]
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(tensor, src=self.roles.leader, group=self.roles.control_group)
        return float(tensor)

    def score(self, episodes: EpisodeBatch, prompts: list[Prompt]) -> dict[str, float]:
        """Rewards on trainer ranks; every rank (generators too) learns whether any trainer failed."""
        with self.waiting(f"the rewards of {self.peers()[1]}"):
            return self._score(episodes, prompts)

    def _score(self, episodes: EpisodeBatch, prompts: list[Prompt]) -> dict[str, float]:
        failure = None
        sums: dict[str, float] = {}
        if self.roles.is_trainer:
            try:
                defaults = {"format_pattern": self.cfg.rewards.format_pattern} if self.cfg.rewards.format_pattern else {}
                sums = score_episodes(
                    self.scorer, episodes, {p.index: p for p in prompts}, self.tokenizer.decode, defaults
                )
            except RewardError as error:
                failure = error
        failed = self.agree(float(failure is not None))
        if failure is not None:
            raise failure
        if failed:
            raise RunAborted()
        return sums

    def advantages(self, episodes: EpisodeBatch) -> tuple[EpisodeBatch, int]:
        """Overlong penalty, advantages and the zero-variance filter on a trainer's episodes.
        Returns the episodes to train on and the number of groups dropped here."""
        g, G = self.cfg.grpo, self.cfg.grpo.group_size
        if g.overlong_buffer:
            penalty = overlong_penalty(
                episodes.completion_lens, self.cfg.generation.max_new_tokens, g.overlong_buffer, g.overlong_penalty
            )
            episodes.rewards = episodes.rewards + penalty
        batch_std = None
        if g.scale_rewards == "batch":
            r = episodes.rewards.double()
            s = reduce({"n": float(len(r)), "sum": float(r.sum()), "sq": float((r * r).sum())}, self.trainer_group)
            mean = s["sum"] / max(s["n"], 1.0)
            batch_std = math.sqrt(max(s["sq"] - s["n"] * mean * mean, 0.0) / max(s["n"] - 1, 1.0))
        episodes.advantages = compute_advantages(episodes.rewards, G, g.baseline, g.scale_rewards, batch_std)
        if not g.filter_zero_variance:
            return episodes, 0
        flat = zero_variance_groups(episodes.rewards, G)
        keep = (~flat).repeat_interleave(G).nonzero().flatten()
        return episodes.select(keep), int(flat.sum())

    def _first_groups(self, episodes: EpisodeBatch, count: int) -> EpisodeBatch:
        """Keep, over all trainer ranks together, the `count` groups with the lowest prompt indices."""
        local = torch.unique(episodes.prompt_index).tolist()
        gathered: list[list[int]] = [[] for _ in self.roles.trainer_ranks]
        dist.all_gather_object(gathered, local, group=self.trainer_group)
        chosen = torch.tensor(sorted(i for ranks in gathered for i in ranks)[:count], dtype=torch.long)
        return episodes.select(torch.isin(episodes.prompt_index, chosen).nonzero().flatten())

    def evaluate(self) -> dict[str, float]:
        """eval.samples completions of each held-out prompt (greedy when 1), scored on trainer ranks.

        eval/accuracy: the fraction of completions whose reward reaches eval.correct_reward;
        eval/pass@k: the fraction of prompts with at least one such completion among k = eval.samples.
        Sampling keys use step 0, which no training step uses: every evaluation draws the same noise.
        """
        prompts, n = self.task.eval_prompts, self.cfg.eval.samples
        episodes, _ = self.collect_episodes(prompts, n, step=0, sampling=self.greedy if n == 1 else None)
        self.score(episodes, prompts)
        if not self.roles.is_trainer:
            return {}
        correct = (episodes.rewards >= self.cfg.eval.correct_reward).float()
        solved = correct.view(-1, n).amax(dim=1) if len(correct) else correct
        totals = reduce(
            {
                "reward": float(episodes.rewards.sum()),
                "length": float(episodes.completion_lens.sum()),
                "correct": float(correct.sum()),
                "solved": float(solved.sum()),
            },
            self.trainer_group,
        )
        completions = len(prompts) * n
        return {
            "eval/reward_mean": totals["reward"] / completions,
            "eval/length_mean": totals["length"] / completions,
            "eval/accuracy": totals["correct"] / completions,
            "eval/pass@k": totals["solved"] / len(prompts),
        }

    def step(self, step: int, with_samples: bool = False) -> tuple[dict[str, float], list[dict]]:
        """One RL step; returns the step's metrics on trainer ranks ({} on generator-only ranks) and,
        when asked, a few of this rank's episodes as readable samples.

        With dynamic sampling, generation rounds of fresh prompts repeat until data.prompts_per_step
        groups survive the zero-variance filter (or the rounds run out); surplus groups of the last
        round are dropped in prompt order so every step trains on the same number of groups.
        """
        cfg, G, target = self.cfg, self.cfg.grpo.group_size, self.cfg.data.prompts_per_step
        start = time.perf_counter()
        rounds = cfg.grpo.dynamic_sampling_max_rounds if cfg.grpo.dynamic_sampling else 1
        generated, kept, reward_sums, prompts_seen = [], [], {}, {}
        generate_s = score_s = 0.0
        filtered = kept_groups = 0
        for round_index in range(rounds):
            prompts = self.task.train_prompts(step, target, round_index)
            prompts_seen.update((p.index, p) for p in prompts)
            episodes, seconds = self.collect_episodes(prompts, G, step)
            generate_s += seconds
            score_start = time.perf_counter()
            for name, total in self.score(episodes, prompts).items():
                reward_sums[name] = reward_sums.get(name, 0.0) + total
            if self.roles.is_trainer:
                generated.append(episodes)
                episodes, dropped = self.advantages(episodes)
                filtered += dropped
                kept.append(episodes)
            score_s += time.perf_counter() - score_start
            local_groups = len(kept[-1]) // G if self.roles.is_trainer else 0
            round_groups = int(self.agree(float(local_groups), dist.ReduceOp.SUM))
            if cfg.grpo.dynamic_sampling and kept_groups + round_groups > target:
                if self.roles.is_trainer:
                    kept[-1] = self._first_groups(kept[-1], target - kept_groups)
                round_groups = target - kept_groups
            kept_groups += round_groups
            if kept_groups >= target:
                break
        train_start = time.perf_counter()
        train_metrics = {}
        if self.roles.is_trainer:
            with self.waiting(f"the other {self.peers()[1]} (FSDP collectives)"):
                train_metrics = self.trainer.train(concat_episodes(kept, self.tokenizer.pad_id))
        train_end = time.perf_counter()
        sync_s = self.sync_weights(step)
        if not self.roles.is_trainer:
            return {}, []
        episodes = concat_episodes(generated, self.tokenizer.pad_id)
        if cfg.grpo.filter_zero_variance:
            groups = reduce({"filtered": float(filtered)}, self.trainer_group)
            train_metrics["grpo/groups_filtered"] = groups["filtered"]
            train_metrics["grpo/groups_trained"] = float(kept_groups)
            train_metrics["grpo/generation_rounds"] = float(round_index + 1)
        n = len(episodes)
        per_episode = reduce_across(
            {
                "reward/mean": float(episodes.rewards.sum()) / max(n, 1),
                **{f"reward/{name}": total / max(n, 1) for name, total in reward_sums.items()},
                "episode/length_mean": float(episodes.completion_lens.sum()) / max(n, 1),
                "episode/truncated_frac": float(episodes.truncated.sum()) / max(n, 1),
            },
            self.trainer_group,
            weights=float(n),
        )
        times = reduce_across(
            {
                "time/generate_s": generate_s,
                "time/score_s": score_s,
                "time/train_s": train_end - train_start,
                "time/weight_sync_s": sync_s,
                "time/step_s": time.perf_counter() - start,
            },
            self.trainer_group,
        )
        metrics = {**per_episode, **train_metrics, **times, **self._rates(episodes, times)}
        if self.roles.split:
            # Split roles wait on each other: generators while trainers score and train, trainers
            # while generators generate.
            metrics["time/generator_idle_s"] = times["time/step_s"] - times["time/generate_s"] - times["time/weight_sync_s"]
            metrics["time/trainer_idle_s"] = (
                times["time/step_s"] - times["time/score_s"] - times["time/train_s"] - times["time/weight_sync_s"]
            )
        samples = self._samples(episodes, prompts_seen) if with_samples else []
        return metrics, samples

    def _rates(self, episodes: EpisodeBatch, times: dict[str, float]) -> dict[str, float]:
        """Throughput of this rank's share, summed over trainer ranks; MFU against the stated peak."""
        iterations = self.cfg.grpo.num_iterations
        trainers = len(self.roles.trainer_ranks)
        tokens = float(episodes.seq_lens.sum())
        rates = {
            "throughput/generate_tok_s": float(episodes.completion_lens.sum()) / max(times["time/generate_s"], 1e-9),
            "throughput/train_tok_s": tokens * iterations / max(times["time/train_s"], 1e-9),
            "weight_sync/GBps": self.weight_bytes / trainers / max(times["time/weight_sync_s"], 1e-9) / 1e9,
        }
        if self.peak is not None:
            lengths = episodes.seq_lens.double()
            seq_len = float((lengths * lengths).sum() / lengths.sum()) if tokens else 0.0
            rates["throughput/mfu"] = mfu(tokens * iterations, times["time/train_s"], self.args, seq_len, self.peak[0], 1)
        return reduce_across(rates, self.trainer_group, weights=1.0)

    def _samples(self, episodes: EpisodeBatch, prompts: dict[int, Prompt]) -> list[dict]:
        """The first metrics.samples_prompts groups of this rank's episodes, as readable records."""
        count = self.cfg.metrics.samples_prompts * self.cfg.grpo.group_size
        return [
            {
                "prompt": prompts[int(episodes.prompt_index[i])].text,
                "completion": self.tokenizer.decode(episodes.completion(i)),
                "reward": float(episodes.rewards[i]),
                "advantage": float(episodes.advantages[i]),
                "finish": "length" if bool(episodes.truncated[i]) else "stop",
            }
            for i in range(min(count, len(episodes)))
        ]
