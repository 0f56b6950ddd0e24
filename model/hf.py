"""HF safetensors checkpoints <-> the native model, streamed tensor by tensor."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from grpo.errors import TandemError
from model.args import ModelArgs
from model.model import Transformer

# HF name -> native name; `{}` is the layer index.
_LAYER_KEYS = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP_KEYS = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Where a checkpoint folder keeps its weights: one file, or the index of its shards.
WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


class CheckpointError(TandemError, ValueError):
    """A checkpoint's tensors do not match the model its config describes."""


def hf_to_native_key(hf_key: str) -> str | None:
    """Native state-dict name of an HF tensor name (None if the native model has no such tensor)."""
    if hf_key in _TOP_KEYS:
        return _TOP_KEYS[hf_key]
    match = _LAYER_RE.fullmatch(hf_key)
    if match and match.group(2) in _LAYER_KEYS:
        return f"layers.{match.group(1)}.{_LAYER_KEYS[match.group(2)]}"
    return None


def native_to_hf_key(native_key: str) -> str:
    for hf, native in _TOP_KEYS.items():
        if native == native_key:
            return hf
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", native_key).groups()
    hf_rest = next(hf for hf, native in _LAYER_KEYS.items() if native == rest)
    return f"model.layers.{layer}.{hf_rest}"


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / WEIGHTS_FILE).is_file():
        files = [path / WEIGHTS_FILE]
    else:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX} in {str(path)!r}")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint shard {str(file)!r} listed in the index is missing")
    return files


def from_hf(
    path: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> Transformer:
    """Load an HF checkpoint folder (config.json + safetensors, single file or sharded).

    The model is built on `meta`, materialised once in `dtype` on `device`, and filled one tensor at a
    time, so host memory peaks near one copy of the weights in `dtype` plus the largest tensor.
    """
    path = Path(path)
    args = ModelArgs.from_hf_dir(path)
    files = _checkpoint_files(path)
    with torch.device("meta"):
        model = Transformer(args, dtype=dtype)
    model.to_empty(device=device)
    expected = model.state_dict()
    loaded: set[str] = set()
    for file in files:
        try:
            _load_file(file, args, expected, loaded, device)
        except SafetensorError as error:
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({error}); it may be truncated: copy it again"
            ) from None
    missing = sorted(set(expected) - loaded)
    if missing:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is missing {native_to_hf_key(missing[0])!r}"
            + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else "")
        )
    return model


def _load_file(file: Path, args: ModelArgs, expected: dict[str, torch.Tensor], loaded: set[str], device) -> None:
    """Copy one safetensors file's tensors into `expected` (the model's state dict), recording their names."""
    with safe_open(str(file), framework="pt", device=str(device)) as shard:
        for hf_key in shard.keys():
            native_key = hf_to_native_key(hf_key)
            if native_key == "output.weight" and args.tie_embeddings:
                continue  # some tied checkpoints also store the head; the embedding is authoritative
            if native_key is None or native_key not in expected:
                raise CheckpointError(f"unexpected tensor {hf_key!r} in {file.name} for a {args.arch} model")
            target = expected[native_key]
            tensor = shard.get_slice(hf_key)
            if list(tensor.get_shape()) != list(target.shape):
                raise CheckpointError(
                    f"tensor {hf_key!r} in {file.name} has shape {list(tensor.get_shape())}, "
                    f"the model expects {list(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(shard.get_tensor(hf_key))
            loaded.add(native_key)


def to_hf(model: Transformer, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` as an HF checkpoint folder (config.json + safetensors) that transformers loads."""
    save_hf(model.args, model.state_dict().items(), path, max_shard_bytes)


def save_hf(
    args: ModelArgs,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    path: str | Path,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write native-named tensors as an HF checkpoint folder; the dtype of the first tensor is recorded."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for native_key, tensor in named_tensors:
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][native_to_hf_key(native_key)] = tensor
        shard_bytes += size
    config = args.to_hf_config()
    config["torch_dtype"] = str(next(iter(shards[0].values())).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if len(shards) == 1:
        save_file(shards[0], str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
