"""Errors reach the user as one line, once per launch, with the right advice, and last on screen.

Each case is a mistake a user makes (a backend that is not installed, a device that is not there,
a KV cache too small, a held-out split too large, a second Ctrl-C, a reward module that does not
exist) and asserts the line the user sees and that no traceback from the project comes with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import train_grpo
from fixtures.hf import build_checkpoint, chat_prompt_lengths
from grpo.config import ConfigError, load_config
from tests.test_e2e import REPO, command, launch, launch_env

ONE_RANK = ["--parallelism.mode=colocated", "--job.device=cpu", "--eval.num_prompts=4", "--training.steps=2"]


@pytest.fixture(autouse=True)
def own_environment(monkeypatch):
    """main run in this process sets RANK, MASTER_PORT, ...; they must not leak into later launches."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def our_traceback(output: str) -> bool:
    """A traceback through the project's own files (torchrun's own summary is not ours)."""
    return f'File "{REPO}' in output


def test_a_metrics_backend_that_is_not_installed_is_a_config_error(tmp_path, capsys):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ConfigError, match=r"metrics.wandb = true needs the wandb package: pip install wandb"):
        load_config(["--metrics.wandb=true"], world_size=2)
    run_dir = tmp_path / "run"
    assert train_grpo.main([*ONE_RANK, "--metrics.wandb=true", f"--job.output_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "config error: metrics.wandb = true needs the wandb package" in err and "Traceback" not in err
    assert not run_dir.exists(), "nothing is written before the config is valid"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_shows_how_to_launch_and_where_the_keys_are(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train_grpo.main(["--parallelism.mode=colocated", flag]) == 0
    out = capsys.readouterr().out
    assert "torchrun --nproc_per_node=2 train_grpo.py" in out
    assert out.rstrip().endswith(f"Every key, its default and a one-line comment: {REPO / 'config.toml'}")
    assert not any(tmp_path.iterdir()), "help starts no run"


def test_a_cuda_device_on_a_machine_without_one_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r'job.device = "cuda" but this machine has no CUDA device'):
        load_config(["--job.device=cuda"], world_size=2)


def test_a_kv_cache_too_small_for_one_sequence_is_one_line(tmp_path, capsys):
    code = train_grpo.main([*ONE_RANK, "--generation.kv_cache_gb=0.0000001", f"--job.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(lines) == 1, err
    assert "holds no sequence" in lines[0] and "raise generation.kv_cache_gb" in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("options", "advice"),
    [
        (["--generation.release_kv_cache=false"], "set generation.release_kv_cache = true"),
        (["--training.schedule=async"], "the async schedule keeps the KV cache while the rank trains"),
    ],
    ids=["sync-kv-kept", "async"],
)
def test_the_trainer_out_of_memory_is_one_line_with_what_to_lower(tmp_path, capsys, monkeypatch, options, advice):
    """A training step that runs out of device memory (raised here as CUDA raises it) stops the run
    with one line naming the micro-batch budget and the settings of this run that would lower it."""
    from grpo.train.trainer import Trainer

    def out_of_memory(self, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Trainer, "train", out_of_memory)
    code = train_grpo.main([*ONE_RANK, *options, "--training.micro_batch_tokens=4096", f"--job.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("error: the trainer ran out of device memory on cpu: lower training.micro_batch_tokens (now 4096)")
    assert "set model.activation_checkpointing = true" in lines[0] and advice in lines[0]
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("hf") / "tiny")


@pytest.mark.parametrize("records, held_out, per_step, left", [(12, 10, 4, 2), (1, 2, 1, 0)],
                         ids=["too-few-left", "too-small-to-hold-out"])
def test_a_held_out_split_that_leaves_too_few_training_prompts_stops_at_start(
    records, held_out, per_step, left, checkpoint, tmp_path, capsys
):
    """Also a file smaller than eval.num_prompts: the same line, naming the file and both keys."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(records)))
    run_dir = tmp_path / "run"
    code = train_grpo.main([
        *ONE_RANK, f"--model.path={checkpoint}", f"--data.path={data}", f"--eval.num_prompts={held_out}",
        f"--data.prompts_per_step={per_step}", '--rewards.functions=["math_accuracy"]', f"--job.output_dir={run_dir}",
    ])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert (
        f"error: {str(data)!r} leaves {left} training prompts (eval.num_prompts = {held_out} held out, 0 skipped as "
        f"too long), fewer than data.prompts_per_step = {per_step}; lower eval.num_prompts or data.prompts_per_step, "
        "or add prompts" in err
    )
    assert not (run_dir / "metrics.jsonl").exists(), "found at start-up, before the step-0 evaluation"


def test_an_empty_output_dir_is_a_config_error_that_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train_grpo.main([*ONE_RANK, "--job.output_dir="]) == 2
    err = capsys.readouterr().err
    assert 'config error: job.output_dir = "" must name a folder' in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == [], "no lock or metrics in the folder the job started from"


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
    args = [*ONE_RANK[:2], "--training.steps=100000", "--eval.num_prompts=4", "--model.dim=256", "--model.n_layers=4",
            "--model.ffn_dim=1024", "--data.prompts_per_step=64", "--rewards.num_workers=0", f"--job.output_dir={tmp_path}"]
    proc = subprocess.Popen(command(args, None), cwd=REPO, env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # Kills a run that never acknowledges the first Ctrl-C, so that reading its stderr cannot hang.
    watchdog = threading.Timer(180, proc.kill)
    watchdog.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    # The second Ctrl-C as soon as the first is acknowledged: a fixed pause can outlast the rest
    # of a short step on a fast machine, and the run then stops after its checkpoint (exit 0).
    acknowledged = []
    for line in proc.stderr:
        acknowledged.append(line)
        if "stopping when this step ends" in line:
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=60)
    watchdog.cancel()
    err = "".join(acknowledged) + err
    assert proc.returncode == 130, (out[-1500:], err[-3000:])
    assert "stopped at once by a second Ctrl-C" in err
    assert "Traceback" not in out + err, err[-3000:]


def test_a_reward_error_in_a_two_rank_launch_is_said_once_and_is_torchruns_root_cause(tmp_path):
    result = launch(
        ["--eval.num_prompts=4", "--training.steps=2", '--rewards.functions=["nosuchmodule:f"]',
         f"--job.output_dir={tmp_path}"],
        nproc=2,
    )
    line = "error: reward function 'nosuchmodule:f': cannot import module 'nosuchmodule' (No module named 'nosuchmodule')"
    lines = result.stderr.splitlines()
    assert result.returncode != 0
    assert lines.count(line) == 1, result.stderr[-3000:]
    assert "rank 1 stopped: see its error above" in lines
    assert "run the same command to resume" not in result.stderr
    assert not our_traceback(result.stderr)
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
    assert line.removeprefix("error: ") in tail, tail


def test_without_a_store_every_rank_says_its_line(monkeypatch, capsys):
    """The fallback when the launch's store does not answer: the line is never lost."""
    from grpo.distributed import error_report

    class DeadStore:
        def set_timeout(self, timeout):
            raise RuntimeError("store is gone")

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", os.devnull)
    error_report.attach(DeadStore())
    error_report.own_error("error: first")
    error_report.lost_peers("error: lost")
    assert capsys.readouterr().err.splitlines() == ["error: first", "error: lost"]
    error_report.attach(None)


def test_a_config_error_reaches_torchruns_summary_from_any_rank(monkeypatch, capsys, tmp_path):
    """Every rank finds a bad config; rank 0 prints it, and the others write it where torchrun's
    summary reads its root cause: torchrun's SIGTERM, sent when the first rank exits, may stop rank 0
    before it printed."""
    from grpo.distributed import error_report

    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error{rank}.json"))
        error_report.config_error(f"config error: from rank {rank}")
        assert json.loads((tmp_path / f"error{rank}.json").read_text())["message"] == f"config error: from rank {rank}"
    assert capsys.readouterr().err.splitlines() == ["config error: from rank 0"]


def test_a_kv_slot_too_small_for_the_longest_prompt_stops_before_any_model_loads(checkpoint, tmp_path, capsys,
                                                                                 monkeypatch):
    """generation.max_seq_len set below the longest prompt plus max_new_tokens: one line at start-up
    naming both keys and the size needed, not an error at the first generation after the model loaded."""
    import grpo.run.rank

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the check")

    monkeypatch.setattr(grpo.run.rank, "from_hf", load)
    questions = [f"What is {i} + 1?" for i in range(8)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions))
    longest = max(chat_prompt_lengths(checkpoint, questions))
    code = train_grpo.main([
        *ONE_RANK, f"--model.path={checkpoint}", f"--data.path={data}", "--eval.num_prompts=2",
        "--data.prompts_per_step=2", "--generation.max_new_tokens=4", f"--generation.max_seq_len={longest}",
        f"--job.output_dir={tmp_path / 'run'}",
    ])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert (
        f"error: generation.max_seq_len = {longest} cannot hold the longest prompt in {str(data)!r} ({longest} "
        f"tokens) and generation.max_new_tokens = 4: raise it to at least {longest + 4}, or set it to 0 (sized "
        "from the data)" in err
    ), err
