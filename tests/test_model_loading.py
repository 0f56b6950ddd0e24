"""The native decoder's loading of HF checkpoints: the configurations it refuses before loading
anything, and sharded, incomplete, extra, misshaped or missing checkpoint files (model/hf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import CheckpointError, ModelArgs, UnsupportedModelError, from_hf
from model.args import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES

# pytest finds a test's fixtures among its module's names
from tests.hf_models import VOCAB, hf_config, hf_dirs, hf_logits, hf_models, our_logits, tokens  # noqa: F401

transformers = pytest.importorskip("transformers")

# --------------------------------------------------------------------------------------------- refusals


def _refusal(config) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        ModelArgs.from_hf_config(config)
    return str(info.value)


def test_refuses_other_architecture():
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        architectures=["MistralForCausalLM"],
    ).to_dict()
    message = _refusal(config)
    assert "MistralForCausalLM" in message
    for supported in SUPPORTED_ARCHITECTURES:
        assert supported in message


def test_refuses_sliding_window():
    config = hf_config("qwen2")
    config.use_sliding_window = True
    config.sliding_window = 8
    config.architectures = ["Qwen2ForCausalLM"]
    message = _refusal(config.to_dict())
    assert "use_sliding_window" in message and "full attention" in message


@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
def test_refuses_unknown_rope_type(form):
    config = hf_config("qwen3").to_dict()
    config["architectures"] = ["Qwen3ForCausalLM"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    if form == "rope_parameters":
        config["rope_parameters"] = {**yarn, "rope_theta": 10000.0}
    else:
        config.pop("rope_parameters", None)
        config["rope_theta"] = 10000.0
        config["rope_scaling"] = yarn
    message = _refusal(config)
    assert "yarn" in message
    for supported in SUPPORTED_ROPE_TYPES:
        assert supported in message


def test_refusal_happens_before_loading(hf_dirs, tmp_path):
    config = json.loads((hf_dirs["qwen3"] / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights at all
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        from_hf(tmp_path)


# --------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_sharded_checkpoint(arch, hf_models, tokens, tmp_path):
    hf = hf_models[arch]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    ours = from_hf(tmp_path, dtype=torch.float32)
    assert (our_logits(ours, tokens) - hf_logits(hf, tokens)).abs().max().item() <= 1e-4


def _copy_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    (dst / "config.json").write_text((src / "config.json").read_text())
    return load_file(str(src / "model.safetensors"))


def test_missing_tensor(hf_dirs, tmp_path):
    tensors = _copy_checkpoint(hf_dirs["qwen3"], tmp_path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        from_hf(tmp_path, dtype=torch.float32)


def test_missing_untied_head(hf_dirs, tmp_path):
    tensors = _copy_checkpoint(hf_dirs["llama"], tmp_path)
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        from_hf(tmp_path, dtype=torch.float32)


@pytest.mark.parametrize(
    "bogus",
    ["model.layers.0.self_attn.bogus.weight", "model.layers.9.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.bias"],
)
def test_unexpected_tensor(bogus, hf_dirs, tmp_path):
    # qwen3 has no q_proj bias and two layers: all three names are foreign to it
    tensors = _copy_checkpoint(hf_dirs["qwen3"], tmp_path)
    tensors[bogus] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=bogus.replace(".", r"\.")):
        from_hf(tmp_path, dtype=torch.float32)


def test_misshaped_tensor(hf_dirs, tmp_path):
    tensors = _copy_checkpoint(hf_dirs["qwen2"], tmp_path)
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = tensors[key].t().contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        from_hf(tmp_path, dtype=torch.float32)


def test_missing_folder_or_files(hf_dirs, tmp_path):
    nowhere = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        from_hf(nowhere)

    no_config = tmp_path / "no-config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((hf_dirs["qwen3"] / "model.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match="no-config"):
        from_hf(no_config)

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((hf_dirs["qwen3"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no-weights"):
        from_hf(no_weights)


def test_missing_shard(hf_models, tmp_path):
    hf_models["qwen3"].save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        from_hf(tmp_path)


