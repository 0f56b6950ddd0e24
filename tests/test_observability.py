"""What a real run shows: metrics reduced over ranks, sample completions, TensorBoard, the report."""

from __future__ import annotations

import gzip
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo.observe.report import build_figure, read_records
from tests.test_e2e import SHORT, launch, metrics

GROUP = 4  # SHORT's grpo.group_size
PER_EPISODE = ("reward/mean", "reward/digit_match", "episode/length_mean", "episode/truncated_frac")


def test_metrics_of_two_ranks_equal_those_of_one(tmp_path):
    """Step 1 samples the same episodes whatever the rank count (hash-keyed sampling, same initial
    weights): per-episode means reduced over 2 ranks equal the single rank's pooled means."""
    one = launch([*SHORT, "--training.steps=1", "--parallelism.mode=colocated", f"--job.output_dir={tmp_path / 'one'}"],
                 nproc=None)
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch([*SHORT, "--training.steps=1", "--parallelism.mode=colocated", f"--job.output_dir={tmp_path / 'two'}"],
                 nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    step_one, step_two = metrics(tmp_path / "one")[1], metrics(tmp_path / "two")[1]
    for key in PER_EPISODE:
        assert step_two[key] == pytest.approx(step_one[key], rel=1e-12), key
    for key in ("time/generate_s", "time/score_s", "time/train_s", "time/weight_sync_s", "time/step_s",
                "throughput/generate_tok_s", "throughput/train_tok_s"):
        assert step_two[key] > 0, key
    assert step_two["time/step_s"] >= step_two["time/train_s"]


def test_split_run_writes_samples_tensorboard_profile_and_report(tmp_path):
    """Split 1 + 1 with TensorBoard, samples every step and step 2 profiled: samples.jsonl holds
    whole groups with rewards and advantages, the event files hold the JSONL's scalars, each rank's
    profile covers its own phases, the report PNG has its panels."""
    result = launch(
        [*SHORT, "--parallelism.mode=split", "--metrics.tensorboard=true", "--metrics.samples_every=1",
         "--metrics.samples_prompts=1", "--metrics.profile_step=2", f"--job.output_dir={tmp_path}"],
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)

    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        samples = record["samples"]
        assert len(samples) == GROUP and len({s["prompt"] for s in samples}) == 1
        assert {s["finish"] for s in samples} <= {"length", "stop"}
        rewards = [s["reward"] for s in samples]
        # group-normalised advantages of one group sum to zero
        assert sum(s["advantage"] for s in samples) == pytest.approx(0.0, abs=1e-5)
        assert all(0.0 <= r <= 1.0 for r in rewards)

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("reward/mean", "loss/policy", "time/train_s", "eval/reward_mean"):
        logged = {r["step"]: r[key] for r in rows if key in r}
        scalars = {e.step: e.value for e in events.Scalars(key)}
        assert scalars.keys() == logged.keys(), key
        for step, value in logged.items():
            assert scalars[step] == pytest.approx(value, rel=1e-6), (key, step)
    assert "time/generator_idle_s" in rows[1] and "time/trainer_idle_s" in rows[1]

    check_profile(tmp_path / "profile", rows[2], result.stdout)

    report = tmp_path / "report.png"
    assert f"report: {report}" in result.stdout
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(build_figure(read_records(tmp_path / "metrics.jsonl")).axes) >= 4


def check_profile(folder, step_row: dict, stdout: str) -> None:
    """Rank 0 generates, rank 1 trains: only the trainer's train table holds backward ops, and its
    profiled wall time lies inside the step's measured training time."""
    assert f"step 2 profiled, phase by phase: {folder}" in stdout
    names = {p.name for p in folder.iterdir()}
    for rank in (0, 1):
        for phase in ("generate", "score", "weight_sync"):
            assert {f"step2_rank{rank}_{phase}.txt", f"step2_rank{rank}_{phase}.json.gz"} <= names, (rank, phase)
    assert "step2_rank0_train.txt" not in names
    train = (folder / "step2_rank1_train.txt").read_text()
    header = train.splitlines()[0]
    assert header.startswith("train: wall ") and header.endswith("(CPU: host ops only)")
    wall_ms = float(header.split()[2])
    assert 0 < wall_ms <= step_row["time/train_s"] * 1e3
    assert "Backward" in train and "aten::mm" in train
    assert "Backward" not in (folder / "step2_rank0_generate.txt").read_text()
    trace = json.loads(gzip.decompress((folder / "step2_rank1_train.json.gz").read_bytes()))
    assert any("Backward" in event.get("name", "") for event in trace["traceEvents"])
