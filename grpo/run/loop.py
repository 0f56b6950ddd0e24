"""The run's schedule: weight sync, evaluation, the steps, checkpoints and exports, and how a run
ends (done, stopped by a signal, or diverged)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from grpo.config import Config
from grpo.distributed.collectives import all_reduce
from grpo.distributed.faults import GracefulStop, restart_count
from grpo.distributed.preflight import StartupError, check_checkpoints
from grpo.errors import TandemError
from grpo.observe.collector import CollectorPauses
from grpo.observe.metrics import MetricsLogger
from grpo.observe.profile import StepProfiler
from grpo.observe.report import render_report
from grpo.run.async_step import AsyncSteps
from grpo.run.rank import Run, RunAborted, TrainingDiverged
from grpo.run.sync_step import evaluate, sync_step
from grpo.train.checkpoint import checkpoint_bytes, load_checkpoint, load_inflight, on_every_rank, save_checkpoint
from grpo.train.checkpoint_folders import (
    CheckpointDamaged,
    CheckpointMismatch,
    checkpoint_root,
    follows_latest,
    next_resume,
    set_aside_newer,
)
from grpo.train.save_errors import CheckpointSaveError


def run_loop(cfg: Config, run: Run, resume: Path | None = None, stop: GracefulStop | None = None) -> None:
    """Sync weights, evaluate, then training steps with checkpoints, exports and a final evaluation.

    Every step ends at a boundary all ranks agree on: whether a stop signal arrived on any rank and
    whether the step skipped an update. A stop saves a checkpoint and returns; training.max_bad_steps
    bad steps in a row save one and raise TrainingDiverged.
    """
    start = time.perf_counter()
    is_leader = run.roles.rank == run.roles.leader
    async_steps = AsyncSteps(run) if cfg.training.schedule == "async" else None
    start_step, bad_steps, evals, inflight, earlier_s = _resume(cfg, run, resume, async_steps is not None)
    logger = MetricsLogger(
        cfg.job.output_dir, is_leader, cfg.metrics, cfg.training.steps, start_step, dataclasses.asdict(cfg)
    )
    if is_leader:
        _announce_start(cfg, run)
    with logger, CollectorPauses() as collector:
        evals = _first_sync(cfg, run, logger, start_step, resume) or evals
        if async_steps is not None:
            async_steps.prime(start_step, inflight)
        profiler = StepProfiler(cfg.job.output_dir, cfg.metrics.profile_step, run.roles.rank, run.device)
        take_step = functools.partial(sync_step, run, profiler=profiler) if async_steps is None else async_steps.step
        for step in range(start_step + 1, cfg.training.steps + 1):
            collector.lap()
            metrics, samples = take_step(step, with_samples=_every(cfg.metrics.samples_every, step))
            if step == start_step + 1:
                # The first step built what lives as long as the run (compiled graphs, caches):
                # later full passes need not walk it again.
                collector.freeze_long_lived()
            if samples:
                logger.log_samples(step, samples)
            last_step = step == cfg.training.steps
            if last_step or _every(cfg.eval.every, step):
                evals["last"] = evaluate(run)
                metrics.update(evals["last"])
            boundary = _step_boundary(run, stop, metrics, collector.lap())
            if metrics:
                metrics["time/gc_s"] = boundary["gc_s"]
            bad_steps = bad_steps + 1 if boundary["skipped"] else 0
            logger.log(step, metrics)
            if is_leader:
                _say_step_notes(logger, run, step, profiler, profiled=step == cfg.metrics.profile_step,
                                skipped=bool(boundary["skipped"]))
            if last_step or _every(cfg.checkpoint.export_hf_every, step):
                run.export_hf(Path(cfg.job.output_dir) / "hf" / f"step_{step}")
            diverged = bad_steps >= cfg.training.max_bad_steps
            signal_number = int(boundary["signal"])
            if last_step or _every(cfg.checkpoint.every, step) or diverged or signal_number:
                seconds = earlier_s + time.perf_counter() - start
                saved = _save(cfg, run, step, bad_steps, evals, async_steps, seconds)
            if diverged:
                raise _diverged(cfg, bad_steps, step, saved)
            if signal_number:
                if is_leader:
                    logger.say(f"stopped by {GracefulStop.name(signal_number)} after step {step}: checkpoint {saved}; "
                               "run the same command to resume")
                return
    if is_leader and evals:
        _announce_done(cfg, run, logger.path, evals, time.perf_counter() - start, earlier_s, start_step)


def _say_step_notes(
    logger: MetricsLogger, run: Run, step: int, profiler: StepProfiler, profiled: bool, skipped: bool
) -> None:
    """The leader's lines after a step's metrics: where its profile went, why its update was skipped."""
    if profiled:
        logger.say(f"step {step} profiled, phase by phase: {profiler.folder}")
    if skipped:
        logger.say(f"step {step}: update skipped: {run.trainer.last_skip_reason}", file=sys.stderr)


def _first_sync(cfg: Config, run: Run, logger: MetricsLogger, start_step: int, resume: Path | None) -> dict | None:
    """The whole policy to the generators; on a fresh start the first evaluation, logged as step 0
    with the model's sizes, and returned as the run's evaluations so far (None when resuming)."""
    is_leader = run.roles.rank == run.roles.leader
    full_sync_s = run.sync_weights(version=start_step, full=True)
    if is_leader:
        logger.say(f"weights to the generators: {run.weights.full_bytes / 1e9:.3g} GB in {full_sync_s:.2f} s; "
                   f"then {run.weights.step_bytes / 1e9:.3g} GB after each step")
    if start_step:
        if start_step >= cfg.training.steps and is_leader:
            print(f"nothing to do: {resume} is at step {start_step} of training.steps = {cfg.training.steps}", flush=True)
        return None
    first = evaluate(run)
    trained, total = run.parameter_counts
    logger.log(0, {**first, "model/trainable_params": float(trained), "model/params": float(total),
                   "weight_sync/full_s": full_sync_s, "weight_sync/full_bytes": float(run.weights.full_bytes)})
    return {"first": first, "last": first}


def _resume(
    cfg: Config, run: Run, resume: Path | None, is_async: bool
) -> tuple[int, int, dict, dict | None, float]:
    """Restore checkpoint `resume` (None: a fresh start) into this rank's trainer and RNG. Returns the
    run's (last step, consecutive bad steps, evaluations so far, this rank's batches in flight: async
    only, None when none were saved, seconds the earlier launches ran), from `resume` or the
    checkpoint it falls back to. Collective over every rank."""
    if resume is None:
        return 0, 0, {}, None, 0.0
    resume, state, inflight = _load_newest_whole(cfg, run, resume, is_async)
    _check_same_schedule(cfg, resume, state, dist.get_world_size())
    if run.roles.rank == run.roles.leader:
        _announce_resume(cfg, resume, state)
    # Checkpoints written before the run's time was saved count from their step on.
    return state["step"], state["bad_steps"], state["evals"], inflight, float(state.get("seconds", 0.0))


def _load_newest_whole(cfg: Config, run: Run, path: Path, is_async: bool) -> tuple[Path, dict, dict | None]:
    """Load checkpoint `path` or, when it fails to load on any rank, the newest older one that
    loads, each checked against the model and the disk first as at start-up; then the leader sets
    aside the newer ones (`set_aside_newer`). Returns (the checkpoint loaded, its run state, this
    rank's batches in flight: async only). Collective over every rank; when no checkpoint loads, the
    leader raises CheckpointDamaged listing them and the other ranks stop silently."""
    failed: dict[Path, str] = {}
    while True:
        with run.waiting("the checkpoint load on every rank"):
            loaded, _, failures = on_every_rank(functools.partial(_load, run, path, is_async))
        if not failures:
            break
        rank, failure = next(iter(failures.items()))
        failed[path] = f"it does not load on rank {rank}: {failure.why}"
        with _leader_speaks(run, CheckpointDamaged, CheckpointMismatch, StartupError):
            path = next_resume(cfg.job.output_dir, cfg.checkpoint.resume, failed)
            check_checkpoints(cfg, run.shapes, path, run.trained_shapes)
    if follows_latest(cfg.checkpoint.resume) and run.roles.rank == run.roles.leader:
        set_aside_newer(path, failed)
    return path, *loaded


def _load(run: Run, path: Path, is_async: bool) -> tuple[dict, dict | None]:
    """This rank's part of loading checkpoint `path`: (its run state, this rank's batches in flight)."""
    state = load_checkpoint(path, run.trainer, run.trainer_group)
    return state, load_inflight(path) if is_async else None


@contextmanager
def _leader_speaks(run: Run, *alike: type[TandemError]) -> Iterator[None]:
    """For errors of the `alike` kinds, which every rank raises alike inside the block: the leader
    raises its own, to be printed; the other ranks stop silently (RunAborted)."""
    try:
        yield
    except alike:
        if run.roles.rank == run.roles.leader:
            raise
        raise RunAborted() from None


def _step_boundary(run: Run, stop: GracefulStop | None, metrics: dict[str, float], gc_s: float) -> dict[str, float]:
    """What every rank learns at the end of a step: the highest stop signal that arrived on any rank
    (0: none), whether the step skipped an update, and the longest time the garbage collector held
    a rank during the step (`gc_s`: this rank's). Collective over every rank."""
    with run.waiting("the step boundary on every rank"):
        return all_reduce(
            {"signal": float(stop.signal_number if stop else 0), "skipped": metrics.get("train/skipped_updates", 0.0),
             "gc_s": gc_s},
            None,
            dist.ReduceOp.MAX,
        )


def _save(
    cfg: Config, run: Run, step: int, bad_steps: int, evals: dict, async_steps: AsyncSteps | None, seconds: float
) -> Path:
    """Checkpoint after `step`: the trainer, the run state (with `seconds`, the run's time so far over
    all its launches) and, in async mode, the generators' batches in flight. Collective over every
    rank; returns the checkpoint's folder."""
    run_state = {"step": step, "policy_version": step, "data_position": _data_position(cfg, step)}
    run_state.update(bad_steps=bad_steps, evals=evals, schedule=_schedule_of(cfg), seconds=seconds)
    roles = run.roles
    with run.waiting("the checkpoint save on every rank"), _leader_speaks(run, CheckpointSaveError):
        return save_checkpoint(
            checkpoint_root(cfg.job.output_dir), step, run.trainer, run.trainer_group, run_state,
            roles.rank == roles.leader, cfg.checkpoint.keep,
            inflight=async_steps.inflight if async_steps is not None and roles.is_generator else None,
            needed_bytes=checkpoint_bytes(run.trained_shapes),
        )


def _diverged(cfg: Config, bad_steps: int, step: int, saved: Path) -> TrainingDiverged:
    return TrainingDiverged(
        f"{bad_steps} steps in a row (up to step {step}) had a non-finite loss or gradient norm "
        f"(training.max_bad_steps = {cfg.training.max_bad_steps}); their updates were skipped, "
        f"so {saved} holds the weights of step {step - bad_steps}, the last update applied (if that update is what "
        f"broke the run, resume from an earlier checkpoint with a lower optimizer.lr)"
    )


def _announce_done(
    cfg: Config, run: Run, metrics_path: Path, evals: dict, seconds: float, earlier_s: float, start_step: int
) -> None:
    """The leader's last lines: how long the run took over all its launches (this launch's share
    when it resumed at `start_step`), the held-out reward before and after, and where its metrics
    and report are."""
    first, last = evals["first"], evals["last"]
    roles = run.roles
    resumed = f" (resumed at step {start_step}; {seconds:.0f} s in this launch)" if start_step else ""
    print(
        f"done: {cfg.training.steps} steps in {earlier_s + seconds:.0f} s{resumed} "
        f"({cfg.parallelism.mode}, {len(roles.generator_ranks)} generator / {len(roles.trainer_ranks)} trainer ranks); "
        f"held-out reward {first['eval/reward_mean']:.3f} -> {last['eval/reward_mean']:.3f} "
        f"({'greedy' if cfg.eval.samples == 1 else f'{cfg.eval.samples} samples each'}, "
        f"{len(run.source.eval_prompts)} prompts); metrics: {metrics_path}",
        flush=True,
    )
    print(f"report: {render_report(cfg.job.output_dir)} (python -m grpo.observe.report {cfg.job.output_dir})", flush=True)


def _every(period: int, step: int) -> bool:
    """Whether a `period`-step cadence (0 = off) falls on `step`."""
    return bool(period) and step % period == 0


def _announce_resume(cfg: Config, resume: Path, state: dict) -> None:
    restarted = f" (torchrun restart {restart_count()})" if restart_count() else ""
    print(f"resuming from {resume} at step {state['step']}{restarted}", flush=True)
    if state["data_position"] != _data_position(cfg, state["step"]):
        print(
            f"warning: the prompt stream differs from the checkpoint's ({state['data_position']}); "
            "the remaining steps see other prompts than the original run would have",
            file=sys.stderr,
            flush=True,
        )


def _announce_start(cfg: Config, run: Run) -> None:
    """What the run will measure, train and how much a step holds, before its first sync."""
    _announce_mfu(run)
    _announce_trainable(run)
    _announce_shared_prompts(cfg, run)
    _announce_step_size(cfg)


def _announce_mfu(run: Run) -> None:
    if run.peak is not None:
        print(f"MFU (throughput/mfu) is measured against the {run.peak[1]} of each trainer rank", flush=True)
    else:
        print(
            f"no MFU: no peak FLOP/s is known for {run.device.type} in {run.dtype} (set metrics.peak_tflops)",
            flush=True,
        )


def _announce_trainable(run: Run) -> None:
    trained, total = run.parameter_counts
    how = "full fine-tuning" if run.lora is None else (
        f"LoRA rank {run.lora.rank} on {', '.join(run.lora.targets)}, base frozen in {str(run.dtype).removeprefix('torch.')}")
    print(f"trainable parameters: {trained:,} of {total:,} ({how})", flush=True)


def _announce_shared_prompts(cfg: Config, run: Run) -> None:
    if cfg.training.share_prompts != "auto":
        return
    if run.share_prompts:
        print('training.share_prompts = "auto": on (CUDA, bf16, flash attention)', flush=True)
    else:
        print('training.share_prompts = "auto": off (it trains faster only with the flash kernel on CUDA in bf16, '
              "without bitwise log-probs)", flush=True)


def _announce_step_size(cfg: Config) -> None:
    """How much one step generates, so a size far beyond the machine shows before its first step runs long."""
    prompts, group = cfg.data.prompts_per_step, cfg.grpo.group_size
    episodes, budget = prompts * group, cfg.max_episode_tokens
    rounds = f", up to {cfg.grpo.dynamic_sampling_max_rounds} rounds of it" if cfg.grpo.dynamic_sampling else ""
    print(f"each step: {prompts} prompts x {group} = {episodes:,} episodes of up to {budget:,} tokens after the prompt "
          f"({episodes * budget:,} in all){rounds}", flush=True)


def _schedule_of(cfg: Config) -> dict:
    """What a checkpoint's in-flight state depends on: the schedule, its lag and the rank layout."""
    async_ = cfg.training.schedule == "async"
    return {"schedule": cfg.training.schedule, "max_staleness": cfg.training.max_staleness if async_ else 0,
            "generator_ranks": cfg.parallelism.generator_ranks if async_ else 0}


def _check_same_schedule(cfg: Config, resume: Path, state: dict, world_size: int) -> None:
    """An async checkpoint holds batches generated ahead by particular ranks with a particular lag:
    refuse (on every rank alike) to continue it under another schedule, lag or layout."""
    saved = state.get("schedule", {"schedule": "sync", "max_staleness": 0, "generator_ranks": 0})
    now = _schedule_of(cfg)
    if saved["schedule"] == now["schedule"] == "sync":
        return
    if saved != now or state["world_size"] != world_size:
        raise CheckpointMismatch(
            f"checkpoint {resume} was written by training.schedule = {saved['schedule']!r} "
            f"(max_staleness {saved['max_staleness']}, {saved['generator_ranks']} generator ranks, "
            f"{state['world_size']} ranks); this run has {now['schedule']!r} (max_staleness {now['max_staleness']}, "
            f"{now['generator_ranks']} generator ranks, {world_size} ranks): resume with the same settings"
        )


def _data_position(cfg: Config, step: int) -> dict:
    """Where the prompt stream stands after `step`: prompts are drawn as a function of (seed, step)."""
    return {"step": step, "seed": cfg.job.seed, "prompts_per_step": cfg.data.prompts_per_step, "path": cfg.data.path}
