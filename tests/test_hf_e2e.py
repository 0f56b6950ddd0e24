"""The loop on an HF checkpoint and a prompt file: a tiny random Qwen3 with a BPE tokenizer and a
chat template, GSM8K-format prompts from JSONL and from Parquet, math rewards, HF export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.hf import FIXTURE, SYSTEM, build_checkpoint
from tests.test_e2e import REPO, launch, metrics


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3-tiny"))


def run_args(checkpoint: Path, data: Path, out: Path) -> list[str]:
    return [
        f"--model.path={checkpoint}", f"--data.path={data}", f"--data.system_prompt={SYSTEM}",
        "--data.enable_thinking=off", "--training.steps=2", "--data.prompts_per_step=2", "--grpo.group_size=2",
        "--eval.num_prompts=2", "--generation.max_new_tokens=8",
        '--rewards.functions=["math_accuracy", "format_reward"]', "--rewards.weights=[1.0, 0.5]",
        "--rewards.num_workers=0", f"--job.output_dir={out}",
    ]


def check_run(result, out: Path, checkpoint: Path) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"reward/math_accuracy", "reward/format_reward", "logprob_diff/max"} <= rows[1].keys()
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = out / "hf" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(str(export))
    assert model.config.vocab_size == json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    assert AutoTokenizer.from_pretrained(str(export)).chat_template is not None


def test_jsonl_colocated(checkpoint, tmp_path):
    out = tmp_path / "run"
    check_run(launch([*run_args(checkpoint, FIXTURE, out), "--parallelism.mode=colocated"], nproc=None), out, checkpoint)


def test_parquet_split(checkpoint, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
    data = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "run"
    check_run(launch([*run_args(checkpoint, data, out), "--parallelism.mode=split"], nproc=2), out, checkpoint)


def test_malformed_line_stops_with_file_and_line(checkpoint, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(FIXTURE.read_text(encoding="utf-8").splitlines()[0] + "\n{not json\n", encoding="utf-8")
    result = launch([*run_args(checkpoint, data, tmp_path / "run"), "--parallelism.mode=colocated"], nproc=None)
    assert result.returncode == 1
    assert f"error: malformed JSON in {data} line 2" in result.stderr
    assert f'File "{REPO}' not in result.stderr
