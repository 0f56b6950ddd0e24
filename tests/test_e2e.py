"""End-to-end runs of train_grpo.py in real processes (CPU, gloo): layouts, equivalence, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
SHORT = [
    "--training.steps=3",
    "--data.prompts_per_step=4",
    "--grpo.group_size=4",
    "--eval.num_prompts=8",
    "--rewards.num_workers=0",
]


def launch_env() -> dict[str, str]:
    """The environment of a launched job: one thread per rank, the checkout importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def command(args: list[str], nproc: int | None, max_restarts: int = 0) -> list[str]:
    """train_grpo.py with plain python (nproc None) or under torchrun with nproc ranks."""
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
    ]
    return [*launcher, str(REPO / "train_grpo.py"), *args]


def launch(args: list[str], nproc: int | None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run train_grpo.py to the end (see `command`)."""
    return subprocess.run(
        command(args, nproc), cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=timeout
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_split_run_equals_colocated_run(tmp_path):
    """1 generator + 1 trainer and a single colocated rank: same per-step rewards, same final weights (fp32)."""
    split = launch([*SHORT, "--parallelism.mode=split", f"--job.output_dir={tmp_path / 'split'}"], nproc=2)
    assert split.returncode == 0, split.stderr[-3000:]
    colocated = launch([*SHORT, "--parallelism.mode=colocated", f"--job.output_dir={tmp_path / 'colo'}"], nproc=None)
    assert colocated.returncode == 0, colocated.stderr[-3000:]

    split_rows, colo_rows = metrics(tmp_path / "split"), metrics(tmp_path / "colo")
    assert [r.get("reward/mean") for r in split_rows] == [r.get("reward/mean") for r in colo_rows]
    assert [r.get("loss/policy") for r in split_rows] == [r.get("loss/policy") for r in colo_rows]
    assert len(split_rows) == 4 and all("reward/mean" in r for r in split_rows[1:])

    split_weights = load_file(tmp_path / "split" / "hf" / "step_3" / "model.safetensors")
    colo_weights = load_file(tmp_path / "colo" / "hf" / "step_3" / "model.safetensors")
    assert split_weights.keys() == colo_weights.keys()
    for name in split_weights:
        assert split_weights[name].dtype == colo_weights[name].dtype
        assert split_weights[name].equal(colo_weights[name]), name


def test_split_with_one_rank_is_refused(tmp_path):
    result = launch(["--parallelism.mode=split", f"--job.output_dir={tmp_path}"], nproc=None)
    assert result.returncode == 2
    assert 'parallelism.mode = "split" needs at least 2 ranks' in result.stderr
    assert "Traceback" not in result.stderr


def test_split_without_trainer_rank_is_refused(tmp_path):
    result = launch(
        ["--parallelism.mode=split", "--parallelism.generator_ranks=2", f"--job.output_dir={tmp_path}"], nproc=2
    )
    assert result.returncode != 0
    assert "parallelism.generator_ranks = 2 leaves no trainer rank with world size 2; set it between 1 and 1" in result.stderr


def test_reward_error_stops_every_rank_with_one_line(tmp_path):
    """A raising reward function on the trainer stops the generator too, naming the function."""
    result = launch(
        [*SHORT, "--parallelism.mode=split", "--rewards.functions=[\"tests.fixtures.slow_rewards:boom_always\"]",
         f"--job.output_dir={tmp_path}"],
        nproc=2,
    )
    assert result.returncode != 0
    assert "error: reward function 'boom_always' raised ValueError('boom') on episode 0" in result.stderr
    # torchrun reports the failed launch itself; no rank prints a traceback from the project's code.
    assert f'File "{REPO}' not in result.stderr


@pytest.mark.parametrize(
    "nproc, options",
    [
        (2, ["--parallelism.mode=split"]),
        (None, ["--parallelism.mode=colocated", "--grpo.loss_type=dapo"]),
        (None, ["--parallelism.mode=colocated", "--grpo.kl_coef=0.04"]),
        (None, ["--parallelism.mode=colocated", "--grpo.num_iterations=2", "--grpo.minibatches=2"]),
    ],
    ids=["split", "colocated-dapo", "colocated-kl", "colocated-iterations"],
)
def test_demo_reward_rises(tmp_path, nproc, options):
    """A shortened embedded demo: held-out greedy reward starts near zero and clearly rises."""
    result = launch(["--training.steps=25", *options, f"--job.output_dir={tmp_path}"], nproc=nproc, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    first, last = rows[0]["eval/reward_mean"], rows[-1]["eval/reward_mean"]
    assert first <= 0.15
    assert last >= first + 0.2, (first, last)
    assert "held-out reward" in result.stdout


FILTERED = [
    "--training.steps=2", "--data.prompts_per_step=8", "--grpo.group_size=4", "--eval.num_prompts=4",
    "--rewards.functions=[\"tests.fixtures.slow_rewards:flat_for_low_digits\"]", "--rewards.num_workers=0",
    "--grpo.filter_zero_variance=true",
]


def test_zero_variance_filter_and_dynamic_sampling(tmp_path):
    """Half the prompts give all-equal rewards: the filter drops them; dynamic sampling refills the
    batch to exactly data.prompts_per_step groups, identically in split (2 trainers) and colocated runs."""
    plain = launch([*FILTERED, "--parallelism.mode=colocated", f"--job.output_dir={tmp_path / 'plain'}"], nproc=None)
    assert plain.returncode == 0, plain.stderr[-3000:]
    # 8 prompts x 4 samples, 4 new tokens each (the built-in default generation.max_new_tokens)
    assert "each step: 8 prompts x 4 = 32 episodes of up to 4 tokens after the prompt (128 in all)\n" in plain.stdout
    for row in metrics(tmp_path / "plain")[1:]:
        assert row["grpo/groups_filtered"] > 0
        assert row["grpo/groups_trained"] == 8 - row["grpo/groups_filtered"]
        assert row["grpo/generation_rounds"] == 1

    dynamic = [*FILTERED, "--grpo.dynamic_sampling=true", "--grpo.dynamic_sampling_max_rounds=8"]
    split = launch([*dynamic, "--parallelism.mode=split", f"--job.output_dir={tmp_path / 'split'}"], nproc=3)
    assert split.returncode == 0, split.stderr[-3000:]
    colocated = launch([*dynamic, "--parallelism.mode=colocated", f"--job.output_dir={tmp_path / 'colo'}"], nproc=None)
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    assert "(128 in all), up to 8 rounds of it\n" in colocated.stdout
    split_rows, colo_rows = metrics(tmp_path / "split")[1:], metrics(tmp_path / "colo")[1:]
    for row in split_rows:
        assert row["grpo/groups_trained"] == 8
        assert row["grpo/generation_rounds"] >= 2 and row["grpo/groups_filtered"] > 0
    keys = ("grpo/groups_trained", "grpo/groups_filtered", "grpo/generation_rounds", "reward/mean")
    assert [[r[k] for k in keys] for r in split_rows] == [[r[k] for k in keys] for r in colo_rows]
    # Two trainer ranks sum the loss in another order than one: equal up to fp32 rounding.
    for split_row, colo_row in zip(split_rows, colo_rows):
        assert split_row["loss/policy"] == pytest.approx(colo_row["loss/policy"], rel=1e-5)


@pytest.mark.parametrize("samples", [1, 4])
def test_eval_accuracy_and_pass_at_k(tmp_path, samples):
    """0/1 rewards: accuracy equals the mean reward; pass@k lies between accuracy and k x accuracy,
    and equals accuracy for one (greedy) sample."""
    result = launch(
        ["--training.steps=2", "--data.prompts_per_step=4", "--grpo.group_size=4", "--eval.num_prompts=16",
         f"--eval.samples={samples}", "--rewards.functions=[\"tests.fixtures.slow_rewards:starts_like_prompt\"]",
         "--rewards.num_workers=0", "--parallelism.mode=colocated", f"--job.output_dir={tmp_path}"],
        nproc=None,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [r for r in metrics(tmp_path) if "eval/accuracy" in r]
    assert len(evals) == 2
    for row in evals:
        assert row["eval/accuracy"] == pytest.approx(row["eval/reward_mean"])
        assert row["eval/accuracy"] <= row["eval/pass@k"] <= min(1.0, samples * row["eval/accuracy"]) + 1e-9
        if samples == 1:
            assert row["eval/pass@k"] == pytest.approx(row["eval/accuracy"])
    assert any(0 < row["eval/accuracy"] for row in evals)
    if samples > 1:
        assert any(row["eval/pass@k"] > row["eval/accuracy"] for row in evals)


def test_reward_errors_scored_zero_when_asked(tmp_path):
    """rewards.on_error = "zero": the raising function scores 0, the run goes on and warns."""
    result = launch(
        [*SHORT, "--parallelism.mode=split", "--rewards.on_error=zero",
         "--rewards.functions=[\"digit_match\", \"tests.fixtures.slow_rewards:boom_always\"]", "--rewards.weights=[1.0, 1.0]",
         f"--job.output_dir={tmp_path}"],
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: reward function 'boom_always' failed on" in result.stderr
    for row in metrics(tmp_path)[1:]:
        assert row["reward/boom_always"] == 0.0
        assert row["reward/mean"] == pytest.approx(row["reward/digit_match"])


def test_format_pattern_from_config(tmp_path):
    """rewards.format_pattern reaches format_reward: a pattern every digit string matches scores 1,
    the default think/answer layout scores 0 on the demo's digit completions."""
    base = [*SHORT, "--parallelism.mode=colocated", '--rewards.functions=["format_reward"]']
    matching = launch([*base, "--rewards.format_pattern=[0-9=]*", f"--job.output_dir={tmp_path / 'a'}"], nproc=None)
    default = launch([*base, f"--job.output_dir={tmp_path / 'b'}"], nproc=None)
    assert matching.returncode == 0 and default.returncode == 0, matching.stderr[-2000:] + default.stderr[-2000:]
    assert all(r["reward/format_reward"] == 1.0 for r in metrics(tmp_path / "a")[1:])
    assert all(r["reward/format_reward"] == 0.0 for r in metrics(tmp_path / "b")[1:])


OVERLAP = [*FILTERED[:-2], "--rewards.num_workers=1", "--grpo.filter_zero_variance=true", "--grpo.dynamic_sampling=true",
           "--parallelism.mode=colocated"]


@pytest.mark.parametrize("nproc", [None, 2], ids=["one-rank", "two-ranks"])
def test_scoring_during_generation_gives_the_same_run(tmp_path, nproc):
    """rewards.overlap (scoring each engine check's finished episodes while the rest decode) against
    scoring after generation: the same rewards, groups, rounds and losses at every step, dynamic
    sampling's extra rounds included."""
    keys = ("reward/mean", "reward/flat_for_low_digits", "grpo/groups_filtered", "grpo/generation_rounds", "loss/policy")
    rows = {}
    for overlap in ("true", "false"):
        out = tmp_path / overlap
        result = launch([*OVERLAP, f"--rewards.overlap={overlap}", f"--job.output_dir={out}"], nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[overlap] = [[row[k] for k in keys] for row in metrics(out)[1:]]
    assert rows["true"] == rows["false"] and len(rows["true"]) == 2
    assert any(row[3] >= 2 for row in rows["true"])  # dynamic sampling ran more than one round


def test_a_reward_error_during_generation_stops_the_run_with_one_line(tmp_path):
    """A reward call that fails while generation runs stops the run at that step with one line."""
    result = launch([*OVERLAP[:-3], "--parallelism.mode=colocated", "--rewards.overlap=true", f"--job.output_dir={tmp_path}",
                     "--rewards.functions=[\"tests.fixtures.slow_rewards:boom_after_first_call\"]"], nproc=None)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "reward function 'boom_after_first_call' raised ValueError('boom')" in errors[0]
    assert "scored together while generation ran" in errors[0]
    assert f'File "{REPO}' not in result.stderr


@pytest.mark.parametrize("nproc, mode", [(None, "colocated"), (3, "split")])
def test_shared_prompts_train_as_the_plain_layout(tmp_path, nproc, mode):
    """training.share_prompts = "on": each group's prompt computed once in training; the first update
    is the plain layout's (up to fp32 rounding), with fewer tokens computed. "auto" (the default)
    keeps the plain layout on the CPU, and says so."""
    rows = {}
    for share in ("auto", "on"):
        result = launch([*SHORT, f"--parallelism.mode={mode}", f"--training.share_prompts={share}",
                         f"--job.output_dir={tmp_path / share}"], nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ('training.share_prompts = "auto": off' in result.stdout) == (share == "auto")  # CPU: fp32
        rows[share] = metrics(tmp_path / share)[1:]
    plain, shared = rows["auto"][0], rows["on"][0]
    assert shared["reward/mean"] == plain["reward/mean"]
    assert shared["loss/policy"] == pytest.approx(plain["loss/policy"], rel=1e-4, abs=1e-7)
    assert shared["loss/grad_norm"] == pytest.approx(plain["loss/grad_norm"], rel=1e-4)
    assert "train/tokens_computed" not in plain and "train/tokens_computed" in shared  # counted: tests/test_trainer.py
    assert len(rows["on"]) == 3
