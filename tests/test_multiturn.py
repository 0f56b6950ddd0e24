"""Multi-turn runs end to end: the built-in digit_relay task learned from scratch, split and
colocated, and the trainer's episodes equal, token for token, what was sampled and what the
environment said."""

from __future__ import annotations

import collections
import json
import os

import pytest

from fixtures.hf import FIXTURE, build_checkpoint
from grpo.data.digits import CharTokenizer
from tests.test_e2e import REPO, command, launch_env, metrics

RELAY = ["--config", str(REPO / "configs" / "digit_relay.toml"), "--metrics.progress_bar=false"]


def _launch(args: list[str], nproc: int | None, env: dict[str, str] | None = None):
    import subprocess

    return subprocess.run(command(args, nproc), cwd=REPO, env={**launch_env(), **(env or {})},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("mode", ["split", "colocated", "colocated-async"])
def test_digit_relay_is_learned_and_trained_on_the_tokens_sampled_and_heard(tmp_path, mode):
    """Every training episode of every step, as the trainer holds it (samples.jsonl with all
    groups), equals the prompt, the sampled turns and the environment's replies as the environment
    logged them, bitwise. Split, the recipe as it ships (50 steps): held-out reward from <= 0.15 to
    >= 0.8, more than a policy deaf to the environment can score (0.55); colocated, 4 steps (on the
    async schedule the conversations run in the background thread while the rank trains)."""
    args = [*RELAY, f"--parallelism.mode={mode.split('-')[0]}", f"--job.output_dir={tmp_path}",
            "--env.name=tests.fixtures.relay_log:logging_relay", "--metrics.samples_every=1", "--metrics.samples_prompts=32"]
    if mode.startswith("colocated"):
        args += ["--training.steps=4", "--eval.every=0"]
    if mode == "colocated-async":
        args += ["--training.schedule=async"]
    log = tmp_path / "relay.jsonl"
    result = _launch(args, nproc=2 if mode == "split" else None, env={"RELAY_LOG": str(log)})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    assert all(r["episode/turns_mean"] == 2.0 for r in rows if "episode/turns_mean" in r)
    if mode == "split":
        first, last = rows[0]["eval/reward_mean"], rows[-1]["eval/reward_mean"]
        assert first <= 0.15 and last >= 0.8, (first, last)
    heard = collections.Counter()
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record["prompt_index"] >= 0:
            heard[tuple(record["tokens"])] += 1
    trained = collections.Counter()
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == len(rows) - 1  # every step's
    for line in lines:
        for sample in json.loads(line)["samples"]:
            turns = sample["turns"]
            assert [t["role"] for t in turns] == ["model", "env", "model"]
            prompt = CharTokenizer().encode(sample["prompt"] + "=")
            trained[tuple(prompt + [tok for t in turns for tok in t["tokens"]])] += 1
    # every training episode the environment finished, as the trainer held it
    assert trained == heard


def test_the_readmes_example_environment_runs_as_written(tmp_path):
    """The environment the README shows, copied from it into a module of its own, drives a short
    colocated run on a tiny HF checkpoint (`--env.name=guess:make`)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("An environment of your own"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    (tmp_path / "guess.py").write_text(code[: code.index("```")], encoding="utf-8")
    checkpoint = build_checkpoint(tmp_path / "qwen3-tiny")
    out = tmp_path / "run"
    args = [f"--model.path={checkpoint}", f"--data.path={FIXTURE}", "--training.steps=2", "--data.prompts_per_step=2",
            "--grpo.group_size=2", "--eval.num_prompts=2", "--generation.max_new_tokens=4", "--env.name=guess:make",
            '--rewards.functions=["env_reward"]', "--rewards.num_workers=0", "--parallelism.mode=colocated",
            "--metrics.samples_every=1", f"--job.output_dir={out}"]
    pythonpath = f"{tmp_path}{os.pathsep}{launch_env()['PYTHONPATH']}"
    result = _launch(args, nproc=None, env={"PYTHONPATH": pythonpath})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(1 <= r["episode/turns_mean"] <= 4 for r in rows[1:])
    for line in (out / "samples.jsonl").read_text().splitlines():
        for sample in json.loads(line)["samples"]:
            roles = [t["role"] for t in sample["turns"]]
            assert roles[0] == "model" and all(a != b for a, b in zip(roles, roles[1:]))


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_conversations_with_bitwise_logprobs_in_both_schedules(tmp_path, schedule):
    """digit_relay with batch-invariant numerics, split: every model token's generator log-prob,
    later turns included, equals the trainer's recomputation bitwise wherever the generator had the
    trainer's weights (every step in sync; async batches come from the policy one update older,
    so only its first step's), and every episode has its two model turns."""
    args = [*RELAY, "--parallelism.mode=split", f"--training.schedule={schedule}", "--job.bitwise_logprobs=true",
            "--training.steps=4", "--data.prompts_per_step=8", "--grpo.group_size=4", "--eval.num_prompts=8",
            f"--job.output_dir={tmp_path}"]
    result = _launch(args, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [r for r in metrics(tmp_path) if "logprob_diff/max" in r]
    assert len(rows) == 4 and all(r["episode/turns_mean"] == 2.0 for r in rows)
    on_policy = rows if schedule == "sync" else rows[:1]
    assert all(r["logprob_diff/max"] == 0.0 and r["logprob_diff/exact_frac"] == 1.0 for r in on_policy)
    if schedule == "async":
        assert all(r["staleness/mean"] == 1.0 and r["logprob_diff/max"] > 0 for r in rows[1:])
