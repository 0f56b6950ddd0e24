"""scripts/slurm/train_grpo.sbatch against a real Slurm (Debian's slurm-wlm): controller and node
daemon on this host with a generated config, one node running 2 CPU ranks (a single host runs a
single slurmd, so multi-node under Slurm is not simulated here; the two-agent test below covers a
2-node rendezvous). CI installs Slurm and sets TANDEM_CI=1 (.ci/run); elsewhere the tests skip
when Slurm is not installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_e2e import REPO, launch_env, metrics

SBATCH = REPO / "scripts" / "slurm" / "train_grpo.sbatch"
DEMO = ["--metrics.progress_bar=false", "--rewards.num_workers=1"]


def _need(*programs: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None]
    if not missing:
        return
    if os.environ.get("TANDEM_CI"):
        pytest.fail(f"CI must provide {', '.join(missing)} (.ci/run installs them with apt-get)")
    pytest.skip(f"{', '.join(missing)} not installed (apt-get install slurm-wlm shellcheck)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld + slurmd on this host; yields the environment that points clients at them."""
    _need("slurmctld", "slurmd", "sbatch", "scontrol")
    root = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    (root / "state").mkdir()
    (root / "spool").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=tandem-ci", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
                # One host, no munge daemon: authentication is moot here.
                "AuthType=auth/none", "CredType=cred/none",
                f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
                f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
                f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
                f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
                # Tracks a step's processes by ancestry (torchrun starts its ranks in sessions of their own).
                "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
                "MpiDefault=none", "SchedulerType=sched/builtin", "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
                # torchrun gives its ranks 30 s after a SIGTERM; Slurm waits longer before SIGKILL.
                "KillWait=60", "UnkillableStepTimeout=120",
                f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
                f"PartitionName=ci Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            ]
        )
        + "\n"
    )
    env = {**launch_env(), "SLURM_CONF": str(conf), "TANDEM_NPROC_PER_NODE": "2"}
    # The job script calls `torchrun` as its users do, from the environment pytest runs in, whether
    # or not that venv was activated.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    subprocess.run(["slurmctld"], env=env, check=True)
    subprocess.run(["slurmd"], env=env, check=True)
    deadline = time.monotonic() + 60
    while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout:
        if time.monotonic() > deadline:
            pytest.fail(f"slurmd never became idle:\n{(root / 'slurmd.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield env, root
    for daemon in ("slurmd", "slurmctld"):
        pid_file = root / f"{daemon}.pid"
        if pid_file.exists():
            subprocess.run(["kill", pid_file.read_text().strip()], check=False)


def _job(env: dict, job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def _wait_for_state(env: dict, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(env, job_id)
        if job.get("JobState") in states:
            return job
        time.sleep(1)
    raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {_job(env, job_id)}")


def _submit(env: dict, log: Path, args: list[str], *sbatch: str) -> str:
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", *sbatch, str(SBATCH), *args],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )
    return result.stdout.strip().split(";")[0]


def test_sbatch_script_is_shellcheck_clean():
    _need("shellcheck")
    result = subprocess.run(["shellcheck", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_sbatch_trains_the_demo(slurm, tmp_path):
    env, _ = slurm
    log = tmp_path / "job.out"
    job_id = _submit(env, log, [*DEMO, "--training.steps=25", f"--job.output_dir={tmp_path / 'run'}"])
    job = _wait_for_state(env, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=300)
    text = log.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", text[-3000:]
    assert f"tandem: job {job_id} (restart 0) on 1 node(s) x 2 rank(s)" in text
    rows = metrics(tmp_path / "run")
    assert rows[-1]["step"] == 25
    assert rows[-1]["eval/reward_mean"] >= rows[0]["eval/reward_mean"] + 0.2, (rows[0], rows[-1])
    assert "held-out reward" in text


def test_requeued_job_resumes_from_its_checkpoint(slurm, tmp_path):
    """Requeue a running job (what preemption does): its ranks get SIGTERM, save at the step
    boundary and exit; the job runs again and resumes from that checkpoint to the end."""
    env, _ = slurm
    log, run = tmp_path / "job.out", tmp_path / "run"
    job_id = _submit(env, log, [*DEMO, "--training.steps=40", "--checkpoint.every=0", f"--job.output_dir={run}"],
                     "--requeue")
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() or len(metrics(run)) < 10:
        assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
        time.sleep(0.5)
    subprocess.run(["scontrol", "requeue", job_id], env=env, check=True)
    # A requeued job waits out a begin-time delay; release it now.
    _wait_for_state(env, job_id, ("PENDING",), timeout=180)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, check=True)
    job = _wait_for_state(env, job_id, ("COMPLETED", "FAILED", "CANCELLED"), timeout=400)
    text = log.read_text()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", text[-3000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", text)
    assert stopped, text[-3000:]
    assert f"resuming from {run / 'checkpoints' / f'step_{stopped.group(1)}'} at step {stopped.group(1)}" in text
    assert f"tandem: job {job_id} (restart 1)" in text
    steps = [r["step"] for r in metrics(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 40


def test_two_torchrun_agents_on_one_rendezvous_train_and_resume(tmp_path):
    """Two 'nodes' (torchrun agents with --nnodes=2, one rank each) meet through one c10d
    rendezvous: the split run trains; launched again with more steps, it resumes."""

    def two_nodes(steps: int) -> list[subprocess.CompletedProcess]:
        port = _free_port()
        common = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=two-nodes-{steps}",
            str(REPO / "train_grpo.py"), *DEMO, f"--training.steps={steps}", f"--job.output_dir={tmp_path}",
        ]
        agents = [subprocess.Popen(common, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = []
        for agent in agents:
            out, err = agent.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
        return results

    first = two_nodes(4)
    assert all(r.returncode == 0 for r in first), [r.stderr[-2000:] for r in first]
    assert metrics(tmp_path)[-1]["step"] == 4
    second = two_nodes(7)
    assert all(r.returncode == 0 for r in second), [r.stderr[-2000:] for r in second]
    output = "".join(r.stdout for r in second)
    assert f"resuming from {tmp_path / 'checkpoints' / 'step_4'} at step 4" in output
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows if "time/step_s" in r][-3:] == [5, 6, 7]
    assert json.loads((tmp_path / "checkpoints" / "step_7" / "run_state.json").read_text())["step"] == 7


def _output_dir_worker(rank: int, world_size: int, root: str, shared: bool) -> str:
    from grpo.distributed.preflight import StartupError, check_shared_output_dir

    # Without a shared file system each node sees a folder of its own under the same name.
    path = Path(root) / ("run" if shared or rank == 0 else f"node{rank}/run")
    path.mkdir(parents=True, exist_ok=True)
    try:
        check_shared_output_dir(path, rank, leader=0)
    except StartupError as error:
        return str(error)
    return "ok"


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-node"])
def test_ranks_that_do_not_share_the_output_dir_stop_at_start_up(tmp_path, shared):
    from functools import partial

    from tests.dist_utils import run_ranks

    (tmp_path / "ranks").mkdir()
    results = run_ranks(partial(_output_dir_worker, root=str(tmp_path), shared=shared), 2, tmp_path / "ranks")
    if shared:
        assert results == ["ok", "ok"]
        assert not (tmp_path / "run" / ".launch-check").exists()
    else:
        for message in results:  # every rank stops, with the same line (naming its own path)
            assert "is not one folder for every rank: rank 1 on" in message
            assert "needs job.output_dir on a file system every node mounts" in message
