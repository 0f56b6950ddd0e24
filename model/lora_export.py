"""LoRA adapters in PEFT's on-disk format (adapter_config.json + adapter_model.safetensors), so
that `peft.PeftModel.from_pretrained(hf_base_model, folder)` applies them to the HF model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.args import ModelArgs
from model.lora import TARGETS, LoRASpec

_NATIVE_TO_HF = {native: hf for native, hf in TARGETS.values()}
_ADAPTER_RE = re.compile(r"layers\.(\d+)\.(.+)\.lora_([AB])")


def peft_key(native_name: str) -> str:
    """PEFT's tensor name of a native adapter name:
    'layers.0.attention.wq.lora_A' -> 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'."""
    layer, module, which = _ADAPTER_RE.fullmatch(native_name).groups()
    return f"base_model.model.model.layers.{layer}.{_NATIVE_TO_HF[module]}.lora_{which}.weight"


def save_peft_adapter(args: ModelArgs, spec: LoRASpec, adapters: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write `adapters` (native name -> lora_A [r, in] or lora_B [out, r]) as a PEFT LoRA adapter
    folder. Only when spec.trainable is empty: PEFT's format has no place for single extra
    trainable parameters (the merged HF export holds them)."""
    if spec.trainable:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {peft_key(name): tensor.detach().to("cpu").contiguous() for name, tensor in adapters.items()}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS[t][1].rpartition(".")[2] for t in spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "layers_to_transform": list(range(args.n_layers)),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
