"""Tiny random HF transformers models of each supported architecture, the reference the native
decoder's tests compare against, and module fixtures that build them once per test module."""

from __future__ import annotations

import pytest
import torch

from model import Transformer
from tests.native_models import random_tokens, randomize_

transformers = pytest.importorskip("transformers")

VOCAB = 256
SEQ_LEN = 40  # longer than the llama3 original_max_position_embeddings below, so the scaling matters

LLAMA3_ROPE = {
    "rope_type": "llama3",
    # theta, factor and the frequency factors are chosen so that, with head_dim 16 and an original
    # context of 16, the RoPE frequencies fall in all three llama3 bands (kept / interpolated / scaled)
    "rope_theta": 500.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 16,
}


def hf_config(arch: str):
    """A tiny transformers config of each supported architecture."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, rms_norm_eps=1e-6)
    if arch == "qwen3":
        # head_dim != hidden / heads, a single KV head, tied head, non-default theta
        return transformers.Qwen3Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            tie_word_embeddings=True,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if arch == "llama":
        # llama3 rope scaling, untied head, odd number of layers
        return transformers.LlamaConfig(
            **common,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=128,
            rope_parameters=dict(LLAMA3_ROPE),
        )
    if arch == "qwen2":
        # q/k/v biases
        return transformers.Qwen2Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=128,
            use_sliding_window=False,
        )
    raise AssertionError(arch)


def make_hf(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    randomize_(hf, seed)
    return hf.eval()


@torch.no_grad()
def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=tokens).logits.float()


@torch.no_grad()
def our_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).float()


ARCHS = ["qwen3", "llama", "qwen2"]


@pytest.fixture(scope="module")
def hf_models():
    """One random HF fp32 model per architecture (built once; tests must not modify them)."""
    return {arch: make_hf(arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def hf_dirs(hf_models, tmp_path_factory):
    """Each HF model saved with save_pretrained (single model.safetensors, rope_parameters config form)."""
    dirs = {}
    for arch, hf in hf_models.items():
        path = tmp_path_factory.mktemp(f"hf_{arch}")
        hf.save_pretrained(path)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, SEQ_LEN, VOCAB)
