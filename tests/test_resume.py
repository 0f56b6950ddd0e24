"""Exact resume: a run stopped by SIGTERM (or killed and restarted by torchrun) and resumed from
its checkpoint equals an uninterrupted run, step for step and bit for bit."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.test_e2e import REPO, command, launch, launch_env, metrics

# Deterministic CPU settings; 12 short steps; checkpoints only where a test asks for them.
RESUME = [
    "--training.steps=12",
    "--data.prompts_per_step=4",
    "--grpo.group_size=4",
    "--eval.num_prompts=8",
    "--rewards.num_workers=0",
    "--job.deterministic=true",
    "--checkpoint.every=0",
    "--metrics.samples_every=0",
]
MODES = {
    "split": ["--parallelism.mode=split"],
    "colocated": ["--parallelism.mode=colocated"],
    # k = 2: the checkpoint holds two batches generated ahead, by two different policy versions
    "async": ["--parallelism.mode=split", "--training.schedule=async", "--training.max_staleness=2"],
    # two colocated ranks, each generating in its background thread while they train together
    "colocated-async": ["--parallelism.mode=colocated", "--training.schedule=async", "--training.max_staleness=2"],
}


def start(args: list[str], nproc: int | None, max_restarts: int = 0) -> subprocess.Popen:
    """train_grpo.py in the background, in its own process group."""
    return subprocess.Popen(
        command(args, nproc, max_restarts), cwd=REPO, env=launch_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Block until metrics.jsonl holds a record of `step` (the step is fully logged)."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        if path.exists() and any(f'"step": {step},' in line for line in path.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} never appeared in {path}")


def worker_pids(torchrun_pid: int) -> dict[int, int]:
    """Global rank -> pid of the train_grpo.py processes torchrun started."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != torchrun_pid:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = int(entry.name)
    return ranks


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise
    return proc.returncode, out, err


def series(run_dir: Path) -> dict[int, dict]:
    """Per step: the reward and loss figures, which depend only on the computation, never on timing."""
    rows = metrics(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(("reward/", "loss/", "eval/"))} for r in rows}


def weights(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / "hf" / f"step_{step}" / "model.safetensors")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), f"{name} differs"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each mode's 12-step run without interruption (split 1 + 1 and colocated on 2 ranks)."""
    runs = {}
    for mode, options in MODES.items():
        run_dir = tmp_path_factory.mktemp(f"full-{mode}")
        result = launch([*RESUME, *options, f"--job.output_dir={run_dir}"], nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[mode] = run_dir
    return runs


@pytest.mark.parametrize("mode", list(MODES))
def test_sigterm_then_resume_equals_uninterrupted_run(tmp_path, uninterrupted, mode):
    """SIGTERM to rank 0 alone after step 6: every rank stops at the same boundary, saves and exits 0;
    `checkpoint.resume = "auto"` then finishes with the same series and bitwise-equal weights, and
    its closing line counts the time of both launches and says where this one resumed."""
    args = [*RESUME, *MODES[mode], f"--job.output_dir={tmp_path}"]
    proc = start(args, nproc=2)
    wait_for_step(tmp_path, 6, proc)
    os.kill(worker_pids(proc.pid)[0], signal.SIGTERM)
    returncode, out, err = finish(proc)
    assert returncode == 0, err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("stopped by SIGTERM after step "))
    stopped = int(line.split("after step ")[1].split(":")[0])
    assert 6 <= stopped < 12, line
    assert f"checkpoint {tmp_path / 'checkpoints' / f'step_{stopped}'}" in line
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [f"step_{stopped}"]
    assert max(series(tmp_path)) == stopped

    saved = json.loads((tmp_path / "checkpoints" / f"step_{stopped}" / "run_state.json").read_text())["seconds"]

    resumed = launch(args, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path / 'checkpoints' / f'step_{stopped}'} at step {stopped}" in resumed.stdout
    assert series(tmp_path) == series(uninterrupted[mode])
    assert_same_weights(weights(tmp_path, 12), weights(uninterrupted[mode], 12))
    done = re.search(rf"done: 12 steps in (\d+) s \(resumed at step {stopped}; (\d+) s in this launch\)", resumed.stdout)
    assert done, resumed.stdout[-2000:]
    assert saved > 0 and abs(int(done.group(1)) - (saved + int(done.group(2)))) <= 1


def test_torchrun_restart_resumes_after_a_rank_is_killed(tmp_path, uninterrupted):
    """torchrun --max-restarts=1: SIGKILL the trainer rank after step 5; the job restarts, resumes from
    step_4 (checkpoint.every = 2) and completes equal to the uninterrupted run."""
    args = [*RESUME, *MODES["split"], "--checkpoint.every=2", "--checkpoint.keep=0", f"--job.output_dir={tmp_path}"]
    proc = start(args, nproc=2, max_restarts=1)
    wait_for_step(tmp_path, 5, proc)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    returncode, out, err = finish(proc)
    assert returncode == 0, err[-3000:]
    resumed = [line for line in out.splitlines() if line.startswith("resuming from ")]
    assert len(resumed) == 1 and resumed[0].endswith("(torchrun restart 1)"), out[-2000:]
    assert int(resumed[0].split(" at step ")[1].split()[0]) in (4, 6)
    assert series(tmp_path) == series(uninterrupted["split"])
    assert_same_weights(weights(tmp_path, 12), weights(uninterrupted["split"], 12))


def test_resume_from_two_trainer_ranks_onto_one(tmp_path):
    """Colocated on 2 ranks to step 4 (checkpoint at 2 and 4); resumed from step_2 on 1 rank, the run
    continues from the same weights: steps 3-4 match the 2-rank run to float rounding."""
    two = tmp_path / "two"
    options = ["--training.steps=4", "--checkpoint.every=2", "--checkpoint.keep=0", "--checkpoint.export_hf_every=2"]
    result = launch([*RESUME, *options, "--parallelism.mode=colocated", f"--job.output_dir={two}"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    one = tmp_path / "one"
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "step_2", one / "checkpoints" / "step_2")
    result = launch([*RESUME, *options, "--parallelism.mode=colocated", f"--job.output_dir={one}"], nproc=None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout and "at step 2" in result.stdout
    two_rows, one_rows = metrics(two), metrics(one)
    assert [r["step"] for r in one_rows] == [3, 4]
    for a, b in zip(two_rows[-2:], one_rows):
        assert a["reward/mean"] == b["reward/mean"]
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], rel=1e-4, abs=1e-6)
    final_two, final_one = weights(two, 4), weights(one, 4)
    for name in final_two:
        assert (final_two[name] - final_one[name]).abs().max() < 1e-5, name


def test_run_state_records_where_the_run_is(tmp_path):
    """run_state.json holds the step, policy version, data position, LR schedule and evaluations."""
    result = launch(
        [*RESUME, "--training.steps=2", "--parallelism.mode=colocated", f"--job.output_dir={tmp_path}"], nproc=None
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((tmp_path / "checkpoints" / "step_2" / "run_state.json").read_text())
    assert state["step"] == state["policy_version"] == 2
    assert state["data_position"] == {"step": 2, "seed": 0, "prompts_per_step": 4, "path": ""}
    assert state["lr_scheduler"]["last_epoch"] == 2
    assert state["evals"]["first"]["eval/reward_mean"] == metrics(tmp_path)[0]["eval/reward_mean"]
    assert (tmp_path / "checkpoints" / "step_2" / "rng" / "rank_0.pt").is_file()


def test_an_async_run_that_finished_resumes_with_more_steps(tmp_path):
    """A finished async run holds no batches past its last step; extended, it generates them at
    resume (and says so), and every later step trains on a whole batch. The earlier launch's
    config.toml is kept, and the changed setting named."""
    options = [*RESUME, *MODES["async"], f"--job.output_dir={tmp_path}"]
    first = launch([*options, "--training.steps=3"], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    more = launch([*options, "--training.steps=5"], nproc=2)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "the batch of step 4 is generated now, by the weights of step 3" in more.stdout
    kept = tmp_path / "config.until_step_3.toml"
    assert (f"warning: resuming with changed settings (training.steps 3 -> 5); the earlier config.toml is kept as "
            f"{kept}") in more.stderr
    assert tomllib.loads(kept.read_text(encoding="utf-8"))["training"]["steps"] == 3
    rows = {r["step"]: r for r in metrics(tmp_path)}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5]  # step 0: the first evaluation
    assert all(rows[step]["throughput/train_tok_s"] > 0 for step in (4, 5))
