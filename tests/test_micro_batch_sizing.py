"""training.micro_batch_tokens = 0: micro-batches sized from the trainer's device memory
(grpo/train/budget.py). The sizing arithmetic against hand-derived sizes, when a run refuses to
size, and a whole run on the CPU with the device's memory readings given by the test: the size
changes after step 2, is announced, saved with the checkpoint and kept on resume.
The same on a real GPU: tests/test_trainer_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import train_grpo
from grpo.config import load_config
from grpo.train.budget import FIRST_TOKENS, MEMORY_SHARE, ROUND_TO, sized_tokens, sizing_problem
from tests.test_error_lines import ONE_RANK, own_environment  # noqa: F401  (fixture)


def test_the_size_is_what_the_memory_left_holds_at_the_measured_rate():
    # 0.85 * 80 GB - 10 GB = 58 GB at 1.25 MB a token: 46,400 tokens, down to a multiple of 8192.
    assert MEMORY_SHARE == 0.85 and ROUND_TO == 8192
    assert sized_tokens(80 * 10**9, 10 * 10**9, 1.25e6, 16384) == 40960
    # 0.85 * 141 GB - 12 GB = 107.85 GB at 1.25 MB: 86,280 tokens -> 81,920.
    assert sized_tokens(141 * 10**9, 12 * 10**9, 1.25e6, 16384) == 81920
    # Less room than the size already run (which fitted): that size stays.
    assert sized_tokens(24 * 10**9, 18 * 10**9, 1.25e6, 16384) == 16384


def test_runs_that_cannot_be_sized_say_why():
    cuda, colocated = torch.device("cuda"), "--parallelism.mode=colocated"
    assert sizing_problem(load_config([colocated], 1), torch.device("cpu")) == "no device memory to size them from on cpu"
    assert sizing_problem(load_config([colocated], 1), cuda) is None
    background = sizing_problem(load_config([colocated, "--training.schedule=async"], 1), cuda)
    assert background.startswith("colocated ranks generate the next batch while they train")
    assert sizing_problem(load_config(["--training.schedule=async"], 2), cuda) is None


class ReadMemory:
    """A device's memory as the test sets it: 1 GB held between steps, 50 kB a token above it at
    the first size, 4 GB usable; the size expected from that, by hand: 0.85 * 4 GB - 1 GB = 2.4 GB
    at 50 kB a token is 48,000 tokens, 40,960 in multiples of 8192."""

    HELD, PER_TOKEN, USABLE, EXPECTED = 10**9, 50_000, 4 * 10**9, 40960
    readings: list[str] = []

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        self.readings.append("reset")

    def allocated(self) -> int:
        return self.HELD

    def peak(self) -> int:
        self.readings.append("peak")
        return self.HELD + self.PER_TOKEN * FIRST_TOKENS

    def usable(self) -> int:
        return self.USABLE


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/micro_batch_tokens" in r}


def test_a_run_packs_the_size_found_after_step_2_and_keeps_it_on_resume(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("grpo.run.rank.sizing_problem", lambda cfg, device: None)
    monkeypatch.setattr("grpo.train.budget.CudaMemory", ReadMemory)
    ReadMemory.readings.clear()
    options = [*ONE_RANK, "--training.steps=3", "--checkpoint.every=3", f"--job.output_dir={tmp_path}"]
    assert train_grpo.main(options) == 0
    sizes = {step: row["train/micro_batch_tokens"] for step, row in metrics(tmp_path).items()}
    assert sizes == {1: FIRST_TOKENS, 2: FIRST_TOKENS, 3: ReadMemory.EXPECTED}
    # Steps 1 and 2 measured, step 3 did not.
    assert ReadMemory.readings == ["reset", "reset", "peak"]
    out = capsys.readouterr().out
    assert f"training.micro_batch_tokens = 0: micro-batches of {ReadMemory.EXPECTED} tokens from the next step" in out
    state = json.loads((tmp_path / "checkpoints" / "step_3" / "run_state.json").read_text())
    assert state["micro_batch_tokens"] == ReadMemory.EXPECTED

    ReadMemory.readings.clear()
    assert train_grpo.main([*options, "--training.steps=4"]) == 0
    assert metrics(tmp_path)[4]["train/micro_batch_tokens"] == ReadMemory.EXPECTED
    assert ReadMemory.readings == []


def test_on_the_cpu_micro_batches_keep_the_first_size_silently(tmp_path, capsys):
    assert train_grpo.main([*ONE_RANK, f"--job.output_dir={tmp_path}"]) == 0
    assert {row["train/micro_batch_tokens"] for row in metrics(tmp_path).values()} == {FIRST_TOKENS}
    assert "micro_batch_tokens" not in capsys.readouterr().out


def test_a_set_size_is_packed_as_set(tmp_path):
    assert train_grpo.main([*ONE_RANK, "--training.micro_batch_tokens=4096", f"--job.output_dir={tmp_path}"]) == 0
    assert {row["train/micro_batch_tokens"] for row in metrics(tmp_path).values()} == {4096}


@pytest.mark.parametrize("configured, advice", [
    (4096, "lower training.micro_batch_tokens (now 4096)"),
    (0, f"set training.micro_batch_tokens below the {FIRST_TOKENS} tokens it was sized to from memory (0)"),
])
def test_out_of_memory_advice_names_the_size_packed(configured, advice):
    from grpo.train.memory import out_of_memory_advice

    cfg = load_config(["--parallelism.mode=colocated", f"--training.micro_batch_tokens={configured}"], 1)
    assert out_of_memory_advice(cfg, torch.device("cpu"), 0, configured or FIRST_TOKENS).startswith(
        f"the trainer ran out of device memory on cpu: {advice}")
