"""One rank of the launch: `Run` builds what the rank's role needs and holds the pieces of a step
that the schedules put in order (sync_step.py: the sync step and evaluation; async_step.py: the
async step; loop.py: the run).

What `Run` builds: the tokenizer and prompt source on every rank, the trainer (policy, optimizer,
the KL reference) on trainer ranks, the engine on generator ranks, and the weight sync between them
when the roles are split; before any of it, the start-up checks that need the model's shapes
(grpo/distributed/preflight.py). The pieces of a step: generate, deliver, score (every rank learns
of a reward error), advantages, the weight sync, the step's metrics and samples.

Every rank runs the same sequence of collectives; what a rank does inside a step depends on its
role (generator, trainer, or both when colocated). A rank stops with RunAborted when another rank
failed, and every rank with TrainingDiverged after training.max_bad_steps bad steps in a row.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.config import Config
from grpo.data.prompt import Prompt
from grpo.data.sources import open_prompts
from grpo.data.tokenizer import HFTokenizer
from grpo.distributed.collectives import all_reduce
from grpo.distributed.faults import waiting_for
from grpo.distributed.preflight import check_checkpoints
from grpo.distributed.roles import Roles
from grpo.engine import Engine, NativeEngine, SamplingParams
from grpo.engine.vmm import mapped_bytes
from grpo.envs import make_environment
from grpo.envs.calls import EnvCalls
from grpo.errors import TandemError
from grpo.observe.episodes import episode_metrics, episode_samples
from grpo.observe.flops import batch_mfu, peak_flops
from grpo.observe.metrics import reduce_across
from grpo.rollout.advantages import training_advantages
from grpo.rollout.conversation import generate_conversations
from grpo.rollout.episode import EpisodeBatch
from grpo.rollout.generate import generate_episodes
from grpo.rollout.transport import exchange_episodes
from grpo.run.weights import WeightPush
from grpo.scoring.scorer import Scorer, score_episodes
from grpo.scoring.stream import ScoringStream
from grpo.train.export import export_bytes, export_hf
from grpo.train.memory import explain_out_of_memory
from grpo.train.trainer import Trainer
from model import ModelArgs, Transformer, from_hf
from model.flash import fast_kernels_serve
from model.lora import LoRASpec, trained_shapes
from rewards import RewardError


class RunAborted(RuntimeError):
    """Another rank hit an error; this rank stops at the same step without a message of its own."""


class TrainingDiverged(TandemError, RuntimeError):
    """training.max_bad_steps consecutive steps had a non-finite loss or gradient norm."""


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.model.dtype)


def shares_prompts(cfg: Config, dtype: torch.dtype, device: torch.device) -> bool:
    """training.share_prompts resolved: "auto" is on where the shared layout trains faster, aten's
    flash kernel (CUDA, bf16) outside batch-invariant mode (bench/RESULTS.md, "Shared prompts")."""
    if cfg.training.share_prompts != "auto":
        return cfg.training.share_prompts == "on"
    return fast_kernels_serve(device, dtype) and cfg.model.train_attention == "flash" and not cfg.job.bitwise_logprobs


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


class Run:
    """The components of one run on this rank, built according to its role."""

    def __init__(
        self, cfg: Config, device: torch.device, roles: Roles, scorer: Scorer | None, resume: Path | None = None
    ):
        """`resume`: the checkpoint this run continues from; it is checked against the model's
        shapes here, before any model is built."""
        self.cfg, self.device, self.roles, self.scorer = cfg, device, roles, scorer
        self.dtype = compute_dtype(cfg, device)
        self.share_prompts = shares_prompts(cfg, self.dtype, device)
        self.tokenizer, self.source = open_prompts(cfg)
        if cfg.model.path:
            self.args = ModelArgs.from_hf_dir(cfg.model.path)
        else:
            self.args = builtin_model_args(cfg, self.tokenizer.vocab_size)
        with torch.device("meta"):
            shapes = {name: tuple(p.shape) for name, p in Transformer(self.args).named_parameters()}
        self.lora = None
        if cfg.lora.rank > 0:
            lora = cfg.lora
            self.lora = LoRASpec(lora.rank, lora.alpha, tuple(lora.targets), tuple(lora.trainable))
        trained = trained_shapes(shapes, self.lora, self.args.n_layers) if self.lora else shapes
        check_checkpoints(cfg, shapes, resume, trained)
        self.shapes, self.trained_shapes = shapes, trained
        # (trained, all) parameter counts: what the optimizer steps, and the plain model's
        self.parameter_counts = tuple(sum(math.prod(s) for s in d.values()) for d in (trained, shapes))
        role = "colocated" if not roles.split else "generator" if roles.is_generator else "trainer"
        self.who = f"{role} rank {roles.rank}"
        self.trainer_group = roles.trainer_mesh.get_group() if roles.trainer_mesh is not None else None
        self.trainer = self._build_trainer() if roles.is_trainer else None
        self.engine = self._build_engine() if roles.is_generator else None
        self.env = None
        if roles.is_generator and cfg.env.name:
            self.env = make_environment(cfg.env.name, cfg.job.seed, self.tokenizer, cfg.env.max_turns, cfg.env.args)
            self.env_calls = EnvCalls(cfg.env.timeout_s, cfg.env.workers)
        self.weights = WeightPush(shapes, trained, self.args, self.lora, roles, self.dtype, device,
                                  cfg.parallelism.weight_bucket_mb * 2**20)
        self.greedy = SamplingParams(cfg.generation.max_new_tokens, temperature=0.0)
        # (peak FLOP/s of one trainer device, what that figure is), or None: no MFU is reported
        self.peak = peak_flops(device, self.dtype, cfg.metrics.peak_tflops)

    def _build_trainer(self) -> Trainer:
        """The fp32 policy (from model.path, or freshly initialised from job.seed), its optimizer
        and, when grpo.kl_coef > 0, the frozen reference, sharded over the trainer mesh."""
        cfg, device, args = self.cfg, self.device, self.args
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
        return Trainer(
            policy,
            self.roles.trainer_mesh,
            device,
            self.dtype,
            cfg.grpo,
            cfg.optimizer,
            total_steps=cfg.training.steps,
            micro_batch_tokens=cfg.training.micro_batch_tokens,
            frozen_pass_tokens=cfg.training.frozen_pass_tokens,
            share_prompts=self.share_prompts,
            temperature=cfg.generation.temperature,
            max_new_tokens=cfg.max_episode_tokens,
            activation_checkpointing=cfg.model.activation_checkpointing,
            compile=cfg.model.compile and device.type == "cuda",
            reference=reference,
            lora=self.lora,
        )

    def _build_engine(self) -> Engine:
        """This generator rank's engine (generation.engine), with its weights still to come from
        the first weight sync; a tensor-parallel group of generator ranks runs one engine."""
        cfg, gen, roles = self.cfg, self.cfg.generation, self.roles
        engine_options = dict(
            sampling=SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k),
            eos_ids=self.tokenizer.eos_ids,
            seed=cfg.job.seed,
            dtype=self.dtype,
            device=self.device,
            stop_strings=gen.stop,
            decode_text=self.tokenizer.decode,
            max_batch_size=gen.max_batch_size,
            max_seq_len=gen.max_seq_len or self.source.max_prompt_tokens + cfg.max_episode_tokens,
            kv_cache_gb=gen.kv_cache_gb,
        )
        if gen.engine == "vllm":
            from grpo.engine.vllm_engine import VLLMEngine

            return VLLMEngine(self.args, **engine_options, kv_cache_fraction=gen.kv_cache_fraction,
                              staging_mb=cfg.parallelism.weight_bucket_mb, cuda_graphs=gen.cuda_graphs,
                              compile=gen.compile, lora=self.lora)
        return NativeEngine(
            self.args,
            **engine_options,
            kv_cache_fraction=gen.kv_cache_fraction,
            share_prefix=gen.share_prefix,
            cuda_graphs=gen.cuda_graphs,
            compile=gen.compile,
            sync_every=gen.sync_every,
            tensor_parallel=(roles.generator_tp, roles.tp_group) if roles.generator_tp > 1 else None,
            lora=self.lora,
        )

    def sync_weights(self, version: int, full: bool = False) -> float:
        """Push the trainer's weights into every engine: all of them (`full`: at the start), else
        what a step changes (weights.py). Returns the seconds it took."""
        start = time.perf_counter()
        generators, trainers = self.peers()
        if not self.roles.split:
            with self.waiting(f"the other ranks' weight shards ({trainers})"):
                self.engine.update_weights([self.trainer.full_weights(self.dtype, self.weights.names(full))], version)
        elif self.roles.is_trainer:
            with self.waiting(f"{generators} to take the weights"):
                self.weights.sync(full).send(dict(self.trainer.model.named_parameters()))
        else:
            with self.waiting(f"the weights from {trainers} (they train first)"):
                self.weights.sync(full).receive(self.engine, version)
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
        is_writer = self.roles.rank == self.roles.leader
        export_hf(self.trainer, self.args, save_tokenizer, path, is_writer, export_bytes(self.shapes))

    def train(self, batch: EpisodeBatch, memory: dict[str, float]) -> dict[str, float]:
        """One update on this trainer rank -> its metrics, memory's included. Names the trainer ranks
        it waits on if a collective times out, records the peak in memory["memory/train_peak_gb"],
        and turns running out of device memory into one line (grpo/train/memory.py)."""
        with self.waiting(f"the other {self.peers()[1]} (FSDP collectives)"), \
                self.peak_memory("memory/train_peak_gb", memory), \
                explain_out_of_memory(self.cfg, self.device, self.outside_bytes):
            metrics = self.trainer.train(batch)
        metrics.update(memory)
        return metrics

    @contextmanager
    def peak_memory(self, key: str, into: dict[str, float]):
        """Record in into[key] the most device memory allocated inside the block (CUDA only): the
        peak of PyTorch's allocator plus what the engine holds outside it (the native engine's
        mapped KV cache, grpo/engine/vmm.py; vLLM's process)."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        outside = self.outside_bytes()
        yield
        peak = torch.cuda.max_memory_allocated(self.device) + max(outside, self.outside_bytes())
        into[key] = max(into.get(key, 0.0), peak / 1e9)

    def outside_bytes(self) -> int:
        """Device memory this rank holds outside PyTorch's allocator: the native engine's mapped KV
        cache (grpo/engine/vmm.py), vLLM's process."""
        return self.engine.outside_bytes() if self.engine is not None else mapped_bytes()

    def waiting(self, what: str):
        """Name this rank and `what` it waits for if a collective inside the block times out."""
        return waiting_for(self.who, what, self.cfg.parallelism.collective_timeout_s)

    def peers(self) -> tuple[str, str]:
        """How this rank names the ranks it waits on: (generator ranks, trainer ranks)."""
        return f"generator ranks {self.roles.generator_ranks}", f"trainer ranks {self.roles.trainer_ranks}"

    def collect_episodes(
        self, prompts: list[Prompt], group_size: int, step: int, sampling: SamplingParams | None = None,
        stream: ScoringStream | None = None,
    ) -> tuple[EpisodeBatch | None, float]:
        """Generate on generator ranks, deliver whole groups to trainer ranks; `stream` scores
        completions as they finish. Returns (this trainer's episodes or None, generation seconds of
        the slowest generator)."""
        batch, generate_s = self.generate(prompts, group_size, step, sampling, stream)
        return self.deliver(batch, len(prompts), generate_s)

    def generate(
        self, prompts: list[Prompt], group_size: int, step: int, sampling: SamplingParams | None = None,
        stream: ScoringStream | None = None,
    ) -> tuple[EpisodeBatch | None, float]:
        """This generator rank's share of `prompts`, generated (None, 0 on trainer-only ranks).
        Returns (episodes, seconds). Local: no collective."""
        roles = self.roles
        if not roles.is_generator:
            return None, 0.0
        # The ranks of a TP group run one engine: each generates the engine's share, the first hands it on.
        mine = prompts[roles.engine_index :: roles.engines]
        start = time.perf_counter()
        if self.env is None:
            batch = generate_episodes(self.engine, mine, group_size, step, self.tokenizer.pad_id, sampling,
                                      stream.add if stream is not None else None)
        else:
            batch, _ = generate_conversations(
                self.engine, self.env, mine, group_size, step, self.tokenizer, self.tokenizer.pad_id,
                sampling or self.engine.sampling, self.cfg.env.max_tokens, self.env_calls, self.cfg.rewards.on_error,
                self.cfg.env.keep_kv,
            )
        return (batch if roles.reports_episodes else None), time.perf_counter() - start

    def deliver(self, batch: EpisodeBatch | None, num_prompts: int, generate_s: float) -> tuple[EpisodeBatch | None, float]:
        """Hand generated episodes (whole groups) to trainer ranks. Collective over all ranks.
        Returns (this trainer's episodes or None, generation seconds of the slowest generator)."""
        roles = self.roles
        generator_names, trainer_names = self.peers()
        if roles.split:
            what = f"episodes from {generator_names}" if roles.is_trainer else f"the episode exchange with {trainer_names}"
            with self.waiting(what):
                return exchange_episodes(batch, roles, math.ceil(num_prompts / roles.engines), generate_s)
        with self.waiting("the other ranks' generation"):
            return batch, all_reduce({"t": generate_s}, None, dist.ReduceOp.MAX)["t"]

    def agree(self, value: float, op=dist.ReduceOp.MAX) -> float:
        """Reduce a trainer-side value over the trainer ranks and hand the result to every rank."""
        if not self.roles.split:
            return all_reduce({"v": value}, None, op)["v"]
        if self.roles.is_trainer:
            value = all_reduce({"v": value}, self.trainer_group, op)["v"]
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(tensor, src=self.roles.leader, group=self.roles.control_group)
        return float(tensor)

    def score(self, episodes: EpisodeBatch, prompts: list[Prompt], stream: ScoringStream | None = None) -> dict[str, float]:
        """Rewards on trainer ranks (from `stream` when it scored them during generation); every
        rank (generators too) learns whether any trainer failed."""
        with self.waiting(f"the rewards of {self.peers()[1]}"):
            sums, failure = stream.finish(episodes) if stream is not None else self.score_locally(episodes, prompts)
            self.stop_if_failed(failure, self.agree(float(failure is not None)))
        return sums

    def score_defaults(self) -> dict:
        """Metadata every reward call sees unless the prompt's own overrides it (score_inputs)."""
        return {"format_pattern": self.cfg.rewards.format_pattern} if self.cfg.rewards.format_pattern else {}

    def score_locally(self, episodes: EpisodeBatch, prompts: list[Prompt]) -> tuple[dict[str, float], RewardError | None]:
        """Rewards of this trainer rank's episodes (written into them): (reward sums by function,
        or the error that stopped scoring). No collective: the caller decides who learns of an error."""
        if not self.roles.is_trainer:
            return {}, None
        try:
            prompts_by_index = {p.index: p for p in prompts}
            decode = self.tokenizer.decode_batch
            return score_episodes(self.scorer, episodes, prompts_by_index, decode, self.score_defaults()), None
        except RewardError as error:
            return {}, error

    @staticmethod
    def stop_if_failed(failure: RewardError | None, failed_anywhere: float) -> None:
        """Raise this rank's own error, or RunAborted when only another rank failed."""
        if failure is not None:
            raise failure
        if failed_anywhere:
            raise RunAborted()

    def advantages(self, episodes: EpisodeBatch) -> tuple[EpisodeBatch, int]:
        """The episodes to train on, with advantages, and the groups dropped here (advantages.py)."""
        return training_advantages(episodes, self.cfg.grpo, self.cfg.generation.max_new_tokens, self.trainer_group)

    def step_metrics(
        self, step: int, episodes: EpisodeBatch, reward_sums: dict[str, float], train_metrics: dict[str, float],
        times: dict[str, float],
    ) -> tuple[dict[str, float], dict[str, float]]:
        """The step's metrics from this trainer rank's episodes and timings, reduced over the
        trainer ranks: (all metrics, the reduced timings). Collective over trainer ranks."""
        local = episode_metrics(episodes, step, reward_sums, multi_turn=bool(self.cfg.env.name))
        per_episode = reduce_across(local, self.trainer_group, weights=float(len(episodes)))
        times = reduce_across(times, self.trainer_group)
        return {**per_episode, **train_metrics, **times, **self._rates(episodes, times, train_metrics)}, times

    def _rates(self, episodes: EpisodeBatch, times: dict[str, float], train: dict[str, float]) -> dict[str, float]:
        """Throughput of this rank's share, summed over trainer ranks; MFU against the stated peak,
        of the tokens the trainer computed (with shared prompts, each prompt once), the output head
        on its loss tokens only."""
        iterations = self.cfg.grpo.num_iterations
        trainers = len(self.roles.trainer_ranks)
        tokens = float(episodes.seq_lens.sum())
        # train/tokens_computed is summed over the trainer ranks: this rank's share of it.
        computed = train["train/tokens_computed"] / trainers if "train/tokens_computed" in train else tokens * iterations
        rates = {
            "throughput/generate_tok_s": float(episodes.completion_lens.sum()) / max(times["time/generate_s"], 1e-9),
            "throughput/train_tok_s": tokens * iterations / max(times["time/train_s"], 1e-9),
            "weight_sync/GBps": self.weights.step_bytes / trainers / max(times["time/weight_sync_s"], 1e-9) / 1e9,
            "weight_sync/bytes": self.weights.step_bytes / trainers,
        }
        if self.peak is not None:
            head_tokens = train["train/loss_tokens"] / trainers
            rates["throughput/mfu"] = batch_mfu(episodes.seq_lens, computed, head_tokens, times["time/train_s"],
                                                self.args, self.peak[0])
        return reduce_across(rates, self.trainer_group, weights=1.0)

    def samples(self, episodes: EpisodeBatch, prompts: dict[int, Prompt]) -> list[dict]:
        """The first metrics.samples_prompts groups of this rank's episodes, as readable records."""
        count = self.cfg.metrics.samples_prompts * self.cfg.grpo.group_size
        return episode_samples(episodes.select(slice(0, count)), prompts, self.tokenizer.decode, bool(self.cfg.env.name))
