"""Guard rails of a whole launch: non-finite updates, a NaN reward, a stalled rank, a rank that
crashes in native code, a rank's end after its work, Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from grpo.distributed.faults import GracefulStop
from tests.test_e2e import REPO, SHORT, launch, launch_env, metrics
from tests.test_resume import start, wait_for_step

FIXTURES = "tests.fixtures.slow_rewards"


def test_non_finite_updates_are_skipped_then_the_run_stops_with_the_last_applied_update(tmp_path):
    """From the third step on every update is NaN: steps 3 and 4 skip theirs (logged), and with
    training.max_bad_steps = 2 the run stops after step 4, saving weights equal to those after step 2."""
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "fixtures" / "poisoned_gradients.py"), *SHORT, "--training.steps=8",
         "--training.max_bad_steps=2", "--parallelism.mode=colocated", "--checkpoint.export_hf_every=1",
         f"--job.output_dir={tmp_path}"],
        cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "step 3: update skipped: non-finite loss (nan) in update 1 of 1" in lines
    assert "step 4: update skipped: non-finite loss (nan) in update 1 of 1" in lines
    checkpoint = tmp_path / "checkpoints" / "step_4"
    assert lines[-1] == (
        "error: 2 steps in a row (up to step 4) had a non-finite loss or gradient norm (training.max_bad_steps = 2); "
        f"their updates were skipped, so {checkpoint} holds the weights of step 2, the last update applied (if that "
        "update is what broke the run, resume from an earlier checkpoint with a lower optimizer.lr)"
    )
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["train/skipped_updates"] for r in rows[1:]] == [0.0, 0.0, 1.0, 1.0]
    after_step_2 = load_file(tmp_path / "hf" / "step_2" / "model.safetensors")
    assert load_file(tmp_path / "hf" / "step_4" / "model.safetensors").keys() == after_step_2.keys()
    for name, tensor in load_file(tmp_path / "hf" / "step_4" / "model.safetensors").items():
        assert tensor.equal(after_step_2[name]), name
    saved = {"trainer": {"model": {"tok_embeddings.weight": torch.empty_like(after_step_2["model.embed_tokens.weight"])}}}
    dcp.load(saved, checkpoint_id=str(checkpoint / "trainer"), no_dist=True)
    assert saved["trainer"]["model"]["tok_embeddings.weight"].equal(after_step_2["model.embed_tokens.weight"])
    assert json.loads((checkpoint / "run_state.json").read_text())["bad_steps"] == 2


def test_nan_reward_stops_the_launch_naming_the_function(tmp_path):
    result = launch(
        [*SHORT, "--parallelism.mode=colocated", f'--rewards.functions=["{FIXTURES}:nan_reward"]',
         f"--job.output_dir={tmp_path}"],
        nproc=None,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: reward function 'nan_reward' returned nan (float) on episode 0")
    assert last.endswith("expected a finite number")


def test_a_stalled_rank_is_named_by_the_rank_waiting_for_it(tmp_path):
    """The trainer spends 18 s in a reward call; the generator, waiting for the step's rewards with a
    10 s collective timeout (long enough for the ranks' start-up to differ on a busy host), stops and
    says whom it waited on."""
    result = launch(
        [*SHORT, "--parallelism.mode=split", f'--rewards.functions=["{FIXTURES}:slow"]', "--rewards.timeout_s=120",
         "--parallelism.collective_timeout_s=10", f"--job.output_dir={tmp_path}"],
        nproc=2,
    )
    assert result.returncode != 0
    assert (
        "error: generator rank 0 waited more than 10 s for the rewards of trainer ranks [1] "
        "(parallelism.collective_timeout_s); that rank is stalled or gone"
    ) in result.stderr


def test_a_rank_that_crashes_in_native_code_leaves_its_python_stack(tmp_path):
    """Rank 1 dies of SIGABRT inside a reward call, as a crash in a native library does: its stderr
    shows where it was, down to the reward function, and rank 0 says it lost its peer."""
    result = launch(
        [*SHORT, "--parallelism.mode=colocated", "--rewards.num_workers=0",
         f'--rewards.functions=["{FIXTURES}:abort_on_rank_1"]', f"--job.output_dir={tmp_path}"],
        nproc=2,
    )
    assert result.returncode != 0
    assert "Fatal Python error: Aborted" in result.stderr, result.stderr[-3000:]
    crash = result.stderr.split("Fatal Python error: Aborted", 1)[1]
    assert "in abort_on_rank_1" in crash and "in score" in crash, crash[:3000]
    assert "error: colocated rank 0 lost its connection while waiting for" in result.stderr, result.stderr[-3000:]


def test_a_rank_ends_without_the_teardown_in_which_a_process_groups_thread_aborts_it(tmp_path):
    """A gloo worker thread frees a Python-made tensor while its process ends: through
    `end_process`, as train_grpo.py ends a rank, both ranks exit 0 and their exit handlers run
    (through the interpreter's teardown the C++ runtime aborts such a rank, "terminate called
    without an active exception": tests/fixtures/late_release.py)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "tests" / "fixtures" / "late_release.py"), str(tmp_path), "end_process"],
        cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "terminate called" not in result.stderr
    assert [(tmp_path / f"exit_handler_{rank}").read_text() for rank in (0, 1)] == ["ran", "ran"]


def test_ctrl_c_in_a_single_process_run_saves_and_exits_0(tmp_path):
    """SIGINT (Ctrl-C) to `python train_grpo.py`: it says it will stop, finishes the step, saves, says
    where, exits 0."""
    proc = start([*SHORT, "--training.steps=40", "--parallelism.mode=colocated", f"--job.output_dir={tmp_path}"],
                 nproc=None)
    wait_for_step(tmp_path, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped = next(line for line in out.splitlines() if line.startswith("stopped by SIGINT after step "))
    step = int(stopped.split("after step ")[1].split(":")[0])
    assert (tmp_path / "checkpoints" / f"step_{step}" / "run_state.json").is_file()
    assert stopped.endswith("; run the same command to resume")
    assert "SIGINT: stopping when this step ends, after a checkpoint (Ctrl-C again stops at once)" in err


def test_a_second_ctrl_c_inside_the_first_ones_message_stops_at_once(monkeypatch):
    """Python may run a signal's handler again inside the handler of the one before (here: while
    its message is printed); the second Ctrl-C must still find the first and stop at once."""
    stop = GracefulStop()
    printed = []

    def print_then_second_ctrl_c(*args, **kwargs):
        printed.append(args[0])
        if len(printed) == 1:
            stop._handle(signal.SIGINT, None)

    monkeypatch.setattr("builtins.print", print_then_second_ctrl_c)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    assert stop.forced and stop.signal_number == signal.SIGINT
    assert len(printed) == 1 and "stopping when this step ends" in printed[0]
