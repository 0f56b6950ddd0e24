"""ModelArgs: the native decoder's shape, read from (and written back to) an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo.errors import TandemError

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class UnsupportedModelError(TandemError, ValueError):
    """An HF config asks for something the native model does not implement."""


class HFConfigError(TandemError, ValueError):
    """An HF config.json that does not describe a model: not a JSON object, or a shape key missing or not a
    positive integer."""


# The shape keys the native model reads, required and optional (each a positive integer where present).
_REQUIRED_INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_INT_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass
class ModelArgs:
    """Shape and numerics of a decoder-only transformer (Qwen3 / Llama 3 / Qwen2)."""

    # "qwen3" | "llama" | "qwen2": decides q/k-norm, biases and the HF export names
    arch: str = "qwen3"
    # tokens in the embedding table
    vocab_size: int = 32
    # hidden size
    dim: int = 64
    # decoder layers
    n_layers: int = 2
    # query heads
    n_heads: int = 4
    # key/value heads (GQA when fewer than n_heads)
    n_kv_heads: int = 2
    # per-head size; may differ from dim // n_heads (Qwen3-0.6B: 16 x 128 != 1024)
    head_dim: int = 16
    # SwiGLU hidden size
    ffn_dim: int = 256
    # RMSNorm epsilon
    norm_eps: float = 1e-6
    # RoPE base frequency
    rope_theta: float = 10000.0
    # "default" or "llama3" (frequency-dependent scaling with the LLAMA3_ROPE_KEYS below)
    rope_type: str = "default"
    # llama3 scaling parameters, empty for "default"
    rope_scaling: dict[str, float] = field(default_factory=dict)
    # bias on q/k/v projections (Qwen2 always, others when attention_bias is set)
    qkv_bias: bool = False
    # RMSNorm on each query/key head before RoPE (Qwen3)
    qk_norm: bool = True
    # output projection shares the embedding matrix
    tie_embeddings: bool = True
    # longest position the checkpoint was trained for (exported back to HF)
    max_position_embeddings: int = 4096
    # token ids copied through to the exported config
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelArgs:
        """Build from the dict of an HF config.json (named `source` in errors); refuses what the
        native model cannot run (UnsupportedModelError) and a malformed shape (HFConfigError)."""
        if not isinstance(config, dict):
            raise HFConfigError(f"{source} holds a JSON {type(config).__name__}, not an object of model settings")
        architectures = config.get("architectures") or []
        arch_name = architectures[0] if architectures else None
        if arch_name not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch_name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = SUPPORTED_ARCHITECTURES[arch_name]
        if config.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{arch_name} with use_sliding_window: true is not supported; only full attention is"
            )
        if config.get("mlp_bias"):
            raise UnsupportedModelError(f"{arch_name} with mlp_bias: true is not supported")
        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported; only 'silu' (SwiGLU)")
        _check_shape_keys(config, source)
        rope_theta, rope_type, rope_scaling = _read_rope(config)
        n_heads = config["num_attention_heads"]
        args = cls(
            arch=arch,
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            ffn_dim=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            tie_embeddings=bool(config.get("tie_word_embeddings", arch != "llama")),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
        )
        if args.n_heads % args.n_kv_heads:
            raise HFConfigError(
                f"{source}: num_attention_heads = {args.n_heads} is not a multiple of num_key_value_heads = {args.n_kv_heads}"
            )
        return args

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelArgs:
        """Read `<path>/config.json`."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint folder {str(path)!r}")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise HFConfigError(f"{str(config_path)!r} is not valid JSON: {error}") from None
        return cls.from_hf_config(config, source=repr(str(config_path)))

    def to_hf_config(self) -> dict[str, Any]:
        """An HF config.json dict (older top-level rope_theta / rope_scaling form, read by transformers 4.x and 5.x)."""
        arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.arch]
        config: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": {"rope_type": "llama3", **self.rope_scaling} if self.rope_type == "llama3" else None,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }
        if self.arch != "qwen2":
            config["attention_bias"] = self.qkv_bias
        if self.arch in ("qwen2", "qwen3"):
            config["use_sliding_window"] = False
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            config["eos_token_id"] = self.eos_token_id
        return config

    @property
    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        attn = self.dim * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.qkv_bias:
            attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + embeddings + self.dim


def _check_shape_keys(config: dict[str, Any], source: str) -> None:
    """Raise HFConfigError unless the shape keys of `config` are positive integers, its norm epsilon
    a small positive number."""
    missing = [key for key in _REQUIRED_INT_KEYS if key not in config]
    if missing:
        raise HFConfigError(f"{source} lacks {', '.join(map(repr, missing))}, which the model's shape is read from")
    for key in (*_REQUIRED_INT_KEYS, *_OPTIONAL_INT_KEYS):
        value = config.get(key)
        if key in _OPTIONAL_INT_KEYS and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HFConfigError(f"{source}: {key} = {value!r} must be a positive integer")
    eps = config.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise HFConfigError(f"{source}: rms_norm_eps = {eps!r} must be a number between 0 and 1")


def _read_rope(config: dict[str, Any]) -> tuple[float, str, dict[str, float]]:
    """RoPE theta, type and scaling from either config form.

    Released checkpoints carry top-level `rope_theta` and `rope_scaling`; transformers 5.x writes a
    single `rope_parameters` dict holding `rope_theta` and `rope_type` (plus the scaling keys).
    """
    params = config.get("rope_parameters")
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    scaling: dict[str, float] = {}
    if rope_type == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
        if missing:
            raise UnsupportedModelError(f"llama3 rope scaling is missing {', '.join(missing)}")
        scaling = {k: params[k] for k in LLAMA3_ROPE_KEYS}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0))), rope_type, scaling
