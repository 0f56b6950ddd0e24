"""The run's schedule: weight sync, evaluation, the steps, checkpoints and exports, and how a run
ends (done, stopped by a signal, or diverged)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from pathlib import Path

import torch.distributed as dist

from grpo.config import Config
from grpo.distributed.collectives import all_reduce
from grpo.distributed.faults import GracefulStop, restart_count
from grpo.observe.metrics import MetricsLogger
from grpo.observe.report import render_report
from grpo.run.async_step import AsyncSteps
from grpo.run.rank import Run, TrainingDiverged
from grpo.run.sync_step import evaluate, sync_step
from grpo.train.checkpoint import (
    CheckpointMismatch,
    checkpoint_root,
    load_checkpoint,
    load_inflight,
    save_checkpoint,
)


def run_loop(cfg: Config, run: Run, resume: Path | None = None, stop: GracefulStop | None = None) -> None:
    """Sync weights, evaluate, then training steps with checkpoints, exports and a final evaluation.

    Every step ends at a boundary all ranks agree on: whether a stop signal arrived on any rank and
    whether the step skipped an update. A stop saves a checkpoint and returns; training.max_bad_steps
    bad steps in a row save one and raise TrainingDiverged.
    """
    start = time.perf_counter()
    is_leader = run.roles.rank == run.roles.leader
    async_steps = AsyncSteps(run) if cfg.training.schedule == "async" else None
    start_step, bad_steps, evals, inflight = _resume(cfg, run, resume, async_steps is not None)
    logger = MetricsLogger(
        cfg.job.output_dir, is_leader, cfg.metrics, cfg.training.steps, start_step, dataclasses.asdict(cfg)
    )
    if is_leader:
        _announce_mfu(run)
    with logger:
        run.sync_weights(version=start_step)
        if start_step == 0:
            first = evaluate(run)
            evals = {"first": first, "last": first}
            logger.log(0, first)
        elif start_step >= cfg.training.steps and is_leader:
            print(f"nothing to do: {resume} is at step {start_step} of training.steps = {cfg.training.steps}", flush=True)
        if async_steps is not None:
            async_steps.prime(start_step, inflight)
        take_step = functools.partial(sync_step, run) if async_steps is None else async_steps.step
        for step in range(start_step + 1, cfg.training.steps + 1):
            metrics, samples = take_step(step, with_samples=_every(cfg.metrics.samples_every, step))
            if samples:
                logger.log_samples(step, samples)
            last_step = step == cfg.training.steps
            if last_step or _every(cfg.eval.every, step):
                evals["last"] = evaluate(run)
                metrics.update(evals["last"])
            boundary = _step_boundary(run, stop, metrics)
            bad_steps = bad_steps + 1 if boundary["skipped"] else 0
            logger.log(step, metrics)
            if boundary["skipped"] and is_leader:
                logger.say(f"step {step}: update skipped: {run.trainer.last_skip_reason}", file=sys.stderr)
            if last_step or _every(cfg.checkpoint.export_hf_every, step):
                run.export_hf(Path(cfg.job.output_dir) / "hf" / f"step_{step}")
            diverged = bad_steps >= cfg.training.max_bad_steps
            signal_number = int(boundary["signal"])
            if last_step or _every(cfg.checkpoint.every, step) or diverged or signal_number:
                saved = _save(cfg, run, step, bad_steps, evals, async_steps)
            if diverged:
                raise _diverged(cfg, bad_steps, step, saved)
            if signal_number:
                if is_leader:
                    logger.say(
                        f"stopped by {GracefulStop.name(signal_number)} after step {step}: checkpoint {saved}; "
                        "run the same command to resume"
                    )
                return
    if is_leader and evals:
        _announce_done(cfg, run, logger.path, evals, time.perf_counter() - start)


def _resume(cfg: Config, run: Run, resume: Path | None, is_async: bool) -> tuple[int, int, dict, dict | None]:
    """Restore checkpoint `resume` (None: a fresh start) into this rank's trainer and RNG. Returns the
    run's (last step, consecutive bad steps, evaluations so far, this rank's batches in flight: async
    only, None when none were saved). Collective over the trainer ranks."""
    if resume is None:
        return 0, 0, {}, None
    state = load_checkpoint(resume, run.trainer, run.trainer_group)
    _check_same_schedule(cfg, resume, state, dist.get_world_size())
    inflight = load_inflight(resume) if is_async else None
    if run.roles.rank == run.roles.leader:
        _announce_resume(cfg, resume, state)
    return state["step"], state["bad_steps"], state["evals"], inflight


def _step_boundary(run: Run, stop: GracefulStop | None, metrics: dict[str, float]) -> dict[str, float]:
    """What every rank learns at the end of a step: the highest stop signal that arrived on any rank
    (0: none) and whether the step skipped an update. Collective over every rank."""
    with run.waiting("the step boundary on every rank"):
        return all_reduce(
            {"signal": float(stop.signal_number if stop else 0), "skipped": metrics.get("train/skipped_updates", 0.0)},
            None,
            dist.ReduceOp.MAX,
        )


def _save(cfg: Config, run: Run, step: int, bad_steps: int, evals: dict, async_steps: AsyncSteps | None) -> Path:
    """Checkpoint after `step`: the trainer, the run state and, in async mode, the generators'
    batches in flight. Collective over every rank; returns the checkpoint's folder."""
    run_state = {"step": step, "policy_version": step, "data_position": _data_position(cfg, step)}
    run_state.update(bad_steps=bad_steps, evals=evals, schedule=_schedule_of(cfg))
    roles = run.roles
    with run.waiting("the checkpoint save on every rank"):
        return save_checkpoint(
            checkpoint_root(cfg.job.output_dir), step, run.trainer, run.trainer_group, run_state,
            roles.rank == roles.leader, cfg.checkpoint.keep,
            inflight=async_steps.inflight if async_steps is not None and roles.is_generator else None,
        )


def _diverged(cfg: Config, bad_steps: int, step: int, saved: Path) -> TrainingDiverged:
    return TrainingDiverged(
        f"{bad_steps} steps in a row (up to step {step}) had a non-finite loss or gradient norm "
        f"(training.max_bad_steps = {cfg.training.max_bad_steps}); their updates were skipped, "
        f"so {saved} holds the last good weights"
    )


def _announce_done(cfg: Config, run: Run, metrics_path: Path, evals: dict, seconds: float) -> None:
    """The leader's last lines: how long the run took, the held-out reward before and after, and
    where its metrics and report are."""
    first, last = evals["first"], evals["last"]
    roles = run.roles
    print(
        f"done: {cfg.training.steps} steps in {seconds:.0f} s "
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


def _announce_mfu(run: Run) -> None:
    if run.peak is not None:
        print(f"MFU (throughput/mfu) is measured against the {run.peak[1]} of each trainer rank", flush=True)
    else:
        print(
            f"no MFU: no peak FLOP/s is known for {run.device.type} in {run.dtype} (set metrics.peak_tflops)",
            flush=True,
        )


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
