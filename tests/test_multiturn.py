"""Multi-turn runs end to end: the built-in digit_relay task learned from scratch, split and
colocated, and the trainer's episodes equal, token for token, what was sampled and what the
environment said."""

from __future__ import annotations

import collections
import json

import pytest

from grpo.data.digits import CharTokenizer
from tests.test_e2e import REPO, command, launch_env, metrics

RELAY = ["--config", str(REPO / "configs" / "digit_relay.toml"), "--metrics.progress_bar=false"]


def _launch(args: list[str], nproc: int | None, env: dict[str, str] | None = None):
    import subprocess

    return subprocess.run(command(args, nproc), cwd=REPO, env={**launch_env(), **(env or {})},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("mode", ["split", "colocated"])
def test_digit_relay_is_learned_and_trained_on_the_tokens_sampled_and_heard(tmp_path, mode):
    """Held-out reward from <= 0.15 to >= 0.8: more than a policy deaf to the environment can score
    (0.55). Split: every training episode of every step, as the trainer holds it (samples.jsonl with
    all groups), equals the prompt, the sampled turns and the environment's replies as the
    environment logged them, bitwise."""
    args = [*RELAY, f"--parallelism.mode={mode}", f"--job.output_dir={tmp_path}"]
    log = tmp_path / "relay.jsonl"
    if mode == "split":
        args += ["--env.name=tests.fixtures.relay_log:logging_relay", "--metrics.samples_every=1",
                 "--metrics.samples_prompts=32"]
    result = _launch(args, nproc=2 if mode == "split" else None, env={"RELAY_LOG": str(log)})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    first, last = rows[0]["eval/reward_mean"], rows[-1]["eval/reward_mean"]
    assert first <= 0.15 and last >= 0.8, (first, last)
    assert all(r["episode/turns_mean"] == 2.0 for r in rows if "episode/turns_mean" in r)
    if mode == "colocated":
        return
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
