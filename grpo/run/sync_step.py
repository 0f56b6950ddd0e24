"""The sync schedule's step and the held-out evaluation, each top-down: what generator and trainer
ranks do, in the order they meet (the async step is in async_step.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpo.config import Config
from grpo.data.prompt import Prompt
from grpo.distributed.collectives import all_reduce
from grpo.observe.profile import StepProfiler
from grpo.rollout.episode import EpisodeBatch, concat_episodes
from grpo.run.rank import Run
from grpo.scoring.stream import ScoringStream


def evaluate(run: Run) -> dict[str, float]:
    """eval.samples completions of each held-out prompt (greedy when 1), scored on trainer ranks.

    eval/accuracy: the fraction of completions whose reward reaches eval.correct_reward;
    eval/pass@k: the fraction of prompts with at least one such completion among k = eval.samples.
    Sampling keys use step 0, which no training step uses: every evaluation draws the same noise.
    """
    prompts, n = run.source.eval_prompts, run.cfg.eval.samples
    episodes, _ = run.collect_episodes(prompts, n, step=0, sampling=run.greedy if n == 1 else None)
    run.score(episodes, prompts)
    if not run.roles.is_trainer:
        return {}
    correct = (episodes.rewards >= run.cfg.eval.correct_reward).float()
    solved = correct.view(-1, n).amax(dim=1) if len(correct) else correct
    totals = all_reduce(
        {
            "reward": float(episodes.rewards.sum()),
            "length": float(episodes.completion_lens.sum()),
            "correct": float(correct.sum()),
            "solved": float(solved.sum()),
        },
        run.trainer_group,
    )
    completions = len(prompts) * n
    return {
        "eval/reward_mean": totals["reward"] / completions,
        "eval/length_mean": totals["length"] / completions,
        "eval/accuracy": totals["correct"] / completions,
        "eval/pass@k": totals["solved"] / len(prompts),
    }


@dataclass
class _Rounds:
    """What a step's generation rounds produced, on this rank."""

    generated: list[EpisodeBatch] = field(default_factory=list)  # every scored episode (trainer ranks)
    kept: list[EpisodeBatch] = field(default_factory=list)  # the groups to train on, with advantages
    reward_sums: dict[str, float] = field(default_factory=dict)  # reward function -> sum over episodes
    prompts: dict[int, Prompt] = field(default_factory=dict)  # every prompt drawn, by index
    generate_s: float = 0.0
    score_s: float = 0.0
    filtered: int = 0  # groups this rank dropped for zero reward variance
    kept_groups: int = 0  # groups kept over all trainer ranks
    count: int = 0  # rounds run
    memory: dict[str, float] = field(default_factory=dict)  # peak device memory (GB) per phase


def _generate_rounds(run: Run, step: int, profiler: StepProfiler) -> _Rounds:
    """Generate, score and compute advantages for the step's prompts: one round, or with dynamic
    sampling rounds of fresh prompts until data.prompts_per_step groups survive the zero-variance
    filter (or the rounds run out). Surplus groups of the last round are dropped in prompt order."""
    cfg, G, target = run.cfg, run.cfg.grpo.group_size, run.cfg.data.prompts_per_step
    out = _Rounds()
    for round_index in range(cfg.grpo.dynamic_sampling_max_rounds if cfg.grpo.dynamic_sampling else 1):
        out.count = round_index + 1
        prompts = run.source.train_prompts(step, target, round_index)
        out.prompts.update((p.index, p) for p in prompts)
        stream = _scoring_stream(run, prompts)
        try:
            with run.peak_memory("memory/generate_peak_gb", out.memory), profiler.phase(step, "generate"):
                episodes, seconds = run.collect_episodes(prompts, G, step, stream=stream)
            out.generate_s += seconds
            score_start = time.perf_counter()
            with profiler.phase(step, "score"):
                for name, total in run.score(episodes, prompts, stream).items():
                    out.reward_sums[name] = out.reward_sums.get(name, 0.0) + total
                if run.roles.is_trainer:
                    out.generated.append(episodes)
                    episodes, dropped = run.advantages(episodes)
                    out.filtered += dropped
                    out.kept.append(episodes)
            out.score_s += time.perf_counter() - score_start
        finally:
            if stream is not None:
                stream.close()
        local_groups = len(out.kept[-1]) // G if run.roles.is_trainer else 0
        round_groups = int(run.agree(float(local_groups), dist.ReduceOp.SUM))
        if cfg.grpo.dynamic_sampling and out.kept_groups + round_groups > target:
            if run.roles.is_trainer:
                out.kept[-1] = _first_groups(run, out.kept[-1], target - out.kept_groups)
            round_groups = target - out.kept_groups
        out.kept_groups += round_groups
        if out.kept_groups >= target:
            break
    return out


def scores_during_generation(cfg: Config, split: bool) -> bool:
    """Whether rewards.overlap takes effect: not on split roles (trainers score what they receive)
    nor with multi-turn episodes, which are scored once the batch is whole."""
    return cfg.rewards.overlap and not split and not cfg.env.name


def _scoring_stream(run: Run, prompts: list[Prompt]) -> ScoringStream | None:
    """A stream that scores completions while the engine decodes the rest (rewards.overlap), or
    None where scoring waits for the batch (scores_during_generation, and reward calls inside this
    process: num_workers = 0)."""
    if not scores_during_generation(run.cfg, run.roles.split) or not run.scorer.num_workers:
        return None
    return ScoringStream(run.scorer, {p.index: p for p in prompts}, run.tokenizer.decode_batch, run.score_defaults(),
                         run.tokenizer.pad_id)


def _first_groups(run: Run, episodes: EpisodeBatch, count: int) -> EpisodeBatch:
    """Keep, over all trainer ranks together, the `count` groups with the lowest prompt indices."""
    local = torch.unique(episodes.prompt_index).tolist()
    gathered: list[list[int]] = [[] for _ in run.roles.trainer_ranks]
    dist.all_gather_object(gathered, local, group=run.trainer_group)
    chosen = torch.tensor(sorted(i for ranks in gathered for i in ranks)[:count], dtype=torch.long)
    return episodes.select(torch.isin(episodes.prompt_index, chosen).nonzero().flatten())


def sync_step(
    run: Run, step: int, *, profiler: StepProfiler, with_samples: bool = False
) -> tuple[dict[str, float], list[dict]]:
    """One RL step; returns the step's metrics on trainer ranks ({} on generator-only ranks) and,
    when asked, a few of this rank's episodes as readable samples. Every step trains on the same
    number of groups (see `_generate_rounds`). `profiler` profiles the step's phases if it is the
    profiled step."""
    start = time.perf_counter()
    rounds = _generate_rounds(run, step, profiler)
    if not run.roles.split and run.cfg.generation.release_kv_cache:
        run.engine.release_cache()
    train_start = time.perf_counter()
    train_metrics = {}
    if run.roles.is_trainer:
        with profiler.phase(step, "train"):
            train_metrics = run.train(concat_episodes(rounds.kept, run.tokenizer.pad_id), rounds.memory)
    train_end = time.perf_counter()
    with profiler.phase(step, "weight_sync"):
        sync_s = run.sync_weights(step)
    if not run.roles.is_trainer:
        return {}, []
    episodes = concat_episodes(rounds.generated, run.tokenizer.pad_id)
    if run.cfg.grpo.filter_zero_variance:
        groups = all_reduce({"filtered": float(rounds.filtered)}, run.trainer_group)
        train_metrics["grpo/groups_filtered"] = groups["filtered"]
        train_metrics["grpo/groups_trained"] = float(rounds.kept_groups)
        train_metrics["grpo/generation_rounds"] = float(rounds.count)
    times = {
        "time/generate_s": rounds.generate_s,
        "time/score_s": rounds.score_s,
        "time/train_s": train_end - train_start,
        "time/weight_sync_s": sync_s,
        "time/step_s": time.perf_counter() - start,
    }
    metrics, times = run.step_metrics(step, episodes, rounds.reward_sums, train_metrics, times)
    if run.roles.split:
        # Split roles wait on each other: generators while trainers score and train, trainers
        # while generators generate.
        metrics["time/generator_idle_s"] = times["time/step_s"] - times["time/generate_s"] - times["time/weight_sync_s"]
        metrics["time/trainer_idle_s"] = (
            times["time/step_s"] - times["time/score_s"] - times["time/train_s"] - times["time/weight_sync_s"]
        )
    samples = run.samples(episodes, rounds.prompts) if with_samples else []
    return metrics, samples
