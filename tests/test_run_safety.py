"""Nothing lost, nothing cryptic: one run per output folder, clean failures for dead ranks and
corrupt files, and no process of a job outliving it.

Each case launches real jobs where it needs them (two concurrent launches, kill -9 of a rank with a
reward call in flight) and asserts the one line the user sees and that what the first run wrote is
left as it was.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from fixtures.hf import build_checkpoint
from grpo.config import ConfigError, load_config
from grpo.data.files import PromptDataset
from grpo.distributed.preflight import StartupError, check_output_dir
from grpo.observe.metrics import _Console
from tests.test_e2e import REPO, command, launch, launch_env
from tests.test_resume import finish, start, wait_for_step, worker_pids

FAST = [
    "--data.prompts_per_step=4",
    "--grpo.group_size=4",
    "--eval.num_prompts=8",
    "--rewards.num_workers=0",
    "--metrics.samples_every=0",
]


def our_traceback(stderr: str) -> bool:
    """Whether a traceback from this project's own files is in the output (torchrun prints its own
    ChildFailedError summary for a rank that died; that one is not ours)."""
    return f'File "{REPO}' in stderr


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under run_dir with its bytes, but for checkpoints still being written (a running
    run renames them away while we read; a walk that meets one mid-rename starts again)."""
    for _ in range(20):
        try:
            return {
                str(p.relative_to(run_dir)): p.read_bytes()
                for p in sorted(run_dir.rglob("*"))
                if p.is_file() and not any(part.startswith(".tmp-") for part in p.relative_to(run_dir).parts)
            }
        except FileNotFoundError:
            time.sleep(0.05)
    raise AssertionError(f"{run_dir} kept changing while it was read")


def launch_until_reward_call(args: list[str], env: dict[str, str], pid_file: Path) -> tuple[subprocess.Popen, int]:
    """Launch a 2-rank job and wait until its reward function writes its pid to pid_file (the
    fixtures in tests/fixtures/slow_rewards.py do); -> the job and that reward worker's pid."""
    proc = subprocess.Popen(command(args, 2), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not pid_file.exists() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    assert pid_file.exists(), "no reward call started"
    return proc, int(pid_file.read_text().split()[0])


# ------------------------------------------------------------------------------ 1. one run per folder


def test_a_second_run_in_the_same_folder_is_refused_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    # keep = 0 keeps step_20; the start-up check wants room for all 100 checkpoints (150 MB)
    args = [*FAST, "--training.steps=2000", "--checkpoint.every=20", "--checkpoint.keep=0", f"--job.output_dir={run_dir}"]
    first = start(args, nproc=2)
    try:
        wait_for_step(run_dir, 21, first)
        holder = worker_pids(first.pid)[1]  # the first trainer rank holds the lock
        before = {k: v for k, v in snapshot(run_dir).items() if k.startswith(("checkpoints/step_20/", "config.toml"))}
        assert "config.toml" in before and any(k.startswith("checkpoints/step_20/") for k in before)
        rows_before = (run_dir / "metrics.jsonl").read_text().splitlines()[:4]
        second = launch(args, nproc=2, timeout=120)
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"is in use by another run (pid {holder} on host" in second.stderr
        assert "stop that run or give this one another job.output_dir" in second.stderr
        assert not our_traceback(second.stderr), second.stderr[-3000:]
        wait_for_step(run_dir, 23, first)  # the first run goes on, undisturbed
        after = snapshot(run_dir)
        assert {k: after[k] for k in before} == before
        assert (run_dir / "metrics.jsonl").read_text().splitlines()[:4] == rows_before
    finally:
        for pid in worker_pids(first.pid).values():
            os.kill(pid, signal.SIGTERM)
        finish(first)
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), "steps logged twice: the two runs mixed their records"


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST, "--training.steps=100000", "--checkpoint.every=0", f"--job.output_dir={run_dir}"]
    first = start(args, nproc=2)
    wait_for_step(run_dir, 1, first)
    # torchrun starts each rank in a session of its own: kill the ranks, then torchrun
    for pid in worker_pids(first.pid).values():
        os.kill(pid, signal.SIGKILL)
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    second = launch([*FAST, "--training.steps=2", f"--job.output_dir={run_dir}"], nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "was left by a run that is gone (pid" in second.stderr + second.stdout
    assert (run_dir / ".tandem.lock").read_text() == ""  # a clean exit leaves no record


def test_a_sigterm_to_every_process_during_a_reward_call_loses_nothing(tmp_path):
    """What Slurm does on preemption: SIGTERM to every process of the job step, the reward worker
    in the middle of a call included. The call finishes, the step it belongs to completes and is
    saved, and the job exits 0 with its stop line."""
    run_dir, pid_file = tmp_path / "run", tmp_path / "busy"
    args = [*FAST, "--rewards.num_workers=1", '--rewards.functions=["tests.fixtures.slow_rewards:slow_first_call"]',
            "--rewards.timeout_s=60", "--training.steps=100", f"--job.output_dir={run_dir}"]
    proc, reward_pid = launch_until_reward_call(args, {**launch_env(), "BUSY_PID_FILE": str(pid_file)}, pid_file)
    ranks = list(worker_pids(proc.pid).values())
    try:
        for pid in [*ranks, reward_pid]:
            os.kill(pid, signal.SIGTERM)
        returncode, out, err = finish(proc)
    finally:
        for pid in ranks:  # each rank has a session of its own: torchrun's process group misses it
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert returncode == 0, err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("stopped by SIGTERM after step "))
    stopped = int(line.split("after step ")[1].split(":")[0])
    assert f"checkpoint {run_dir / 'checkpoints' / f'step_{stopped}'}" in line
    assert (run_dir / "checkpoints" / f"step_{stopped}").is_dir()
    assert "reward" not in err.lower(), err[-3000:]
    assert not our_traceback(err), err[-3000:]


# ------------------------------------------------------------------------------ 2. truncated safetensors


def test_a_truncated_safetensors_file_is_named_in_one_line(tmp_path):
    ckpt = build_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    data = REPO / "fixtures" / "gsm8k_sample.jsonl"
    result = launch(
        [*FAST, "--eval.num_prompts=2", f"--model.path={ckpt}", f"--data.path={data}",
         '--rewards.functions=["math_accuracy"]', f"--job.output_dir={tmp_path / 'run'}"],
        nproc=2,
    )
    assert result.returncode != 0
    assert f"error: {weights} is not a readable safetensors file" in result.stderr, result.stderr[-3000:]
    assert not our_traceback(result.stderr), result.stderr[-3000:]
    assert "Connection closed by peer" not in result.stderr


# ------------------------------------------------------------------------------ 3. failed resume


def test_a_refused_resume_leaves_the_runs_files_as_they_were(tmp_path):
    run_dir = tmp_path / "run"
    done = launch([*FAST, "--parallelism.mode=colocated", "--training.steps=2", f"--job.output_dir={run_dir}"], nproc=None)
    assert done.returncode == 0, done.stderr[-3000:]
    before = snapshot(run_dir)
    wider = launch([*FAST, "--parallelism.mode=colocated", "--training.steps=4", "--model.dim=128", "--model.n_heads=4",
                    f"--job.output_dir={run_dir}"], nproc=None)
    assert wider.returncode == 1
    assert "was saved from another model: tok_embeddings.weight is [12, 64] there and [12, 128]" in wider.stderr
    assert not our_traceback(wider.stderr)
    assert snapshot(run_dir) == before
    # the resolved config still describes the run in the folder: rerunning from it works
    again = launch(["--config", str(run_dir / "config.toml"), "--training.steps=3"], nproc=None)
    assert again.returncode == 0, again.stderr[-3000:]


# ------------------------------------------------------------------------------ 4. a non-UTF-8 JSONL file


def test_a_non_utf8_jsonl_line_is_named(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"question": "1+1", "answer": "2"}\n\x9e\x80 not text\n')
    with pytest.raises(ValueError, match=rf"{path} line 2 is not UTF-8 text \(byte 0x9e at column 1\)"):
        PromptDataset.from_path(str(path), tokenizer=None, max_prompt_tokens=16)


# ------------------------------------------------------------------------------ 5 and 6. a rank killed mid-run


@pytest.fixture(scope="module")
def killed_trainer(tmp_path_factory):
    """A split 1 + 1 job whose trainer rank is SIGKILLed while a reward call hangs in its pool."""
    tmp = tmp_path_factory.mktemp("killed")
    marker = uuid.uuid4().hex
    pid_file = tmp / "reward_pids"
    env = {**launch_env(), "TANDEM_TEST_MARKER": marker, "HANG_PID_FILE": str(pid_file)}
    args = [*FAST, "--rewards.num_workers=1", '--rewards.functions=["tests.fixtures.slow_rewards:hang_and_record"]',
            "--rewards.timeout_s=200", "--training.steps=5", f"--job.output_dir={tmp / 'run'}"]
    proc, reward_pid = launch_until_reward_call(args, env, pid_file)
    trainer = worker_pids(proc.pid)[1]
    os.kill(trainer, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    return {"stderr": stderr, "reward_pid": reward_pid, "marker": marker, "returncode": proc.returncode}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _job_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"TANDEM_TEST_MARKER={marker}".encode() in (entry / "environ").read_bytes() and _alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_no_process_of_the_job_outlives_a_killed_trainer(killed_trainer):
    deadline = time.monotonic() + 10
    while _job_processes(killed_trainer["marker"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(killed_trainer["reward_pid"]), "the reward worker is still running"
    assert _job_processes(killed_trainer["marker"]) == []


def test_a_dead_peer_is_named_in_one_line(killed_trainer):
    stderr = killed_trainer["stderr"]
    assert killed_trainer["returncode"] != 0
    lines = [line for line in stderr.splitlines() if line.startswith("error: generator rank 0")]
    assert len(lines) == 1, stderr[-3000:]
    assert "trainer ranks [1]" in lines[0] and "stopped answering" in lines[0]
    assert "run the same command to resume" in lines[0]
    assert not our_traceback(stderr), stderr[-3000:]


# ------------------------------------------------------------------------------ 7. smaller ones


def test_a_stop_line_starts_on_its_own_line_after_the_progress_bar(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    console = _Console(total_steps=10, bar=True)
    console.show(3, {"reward/mean": 0.5, "throughput/generate_tok_s": 19200.0})
    console.say("stopped by SIGINT after step 3")
    text = out.getvalue()
    assert "tok/s" in text and text.endswith("\nstopped by SIGINT after step 3\n")


def test_a_missing_model_path_is_reported_as_missing(tmp_path):
    data = REPO / "fixtures" / "gsm8k_sample.jsonl"
    with pytest.raises(ConfigError, match=r"model.path = '.*nowhere' does not exist"):
        load_config(["--config", str(REPO / "config.toml"), f"--model.path={tmp_path / 'nowhere'}", f"--data.path={data}"])


def test_an_output_dir_that_is_a_file_is_reported_as_a_file(tmp_path):
    path = tmp_path / "out"
    path.write_text("x")
    with pytest.raises(StartupError, match=r"job.output_dir = '.*out' is a file, not a folder"):
        check_output_dir(path, rank=0)
