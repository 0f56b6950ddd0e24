"""LoRA applied to the native model from outside, as parallelize.py applies FSDP2: chosen linear
layers get low-rank adapters A [r, in] and B [out, r]; every other weight is frozen in the compute
dtype, so neither fp32 masters nor optimizer state exist for it.

The forward uses the merged weight W + s·B·A (s = alpha / r), computed per forward in fp32 and
rounded once to W's dtype (`merged_weight`). The generator merges the same way into its own copy of
the base weights, so trainer and generator compute with the same weights, to the bit when the
numerics are batch-invariant. The price against the unmerged form x·Wᵀ + s·(x·Aᵀ)·Bᵀ: backward
computes the full weight gradient (as full fine-tuning does) before projecting it onto A and B;
LoRA here saves memory (optimizer state, masters, gradients), not compute.

Names stay those of the plain model (`layers.0.attention.wq.weight` is the frozen base), the
adapters sit beside it (`layers.0.attention.wq.lora_A`, `.lora_B`), so weight sync, checkpoints
and HF export match tensors by name as before.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.model import Transformer

# Short target names (as the config spells them) -> the module path inside a block, and HF's name.
TARGETS = {
    "q": ("attention.wq", "self_attn.q_proj"),
    "k": ("attention.wk", "self_attn.k_proj"),
    "v": ("attention.wv", "self_attn.v_proj"),
    "o": ("attention.wo", "self_attn.o_proj"),
    "gate": ("feed_forward.w1", "mlp.gate_proj"),
    "up": ("feed_forward.w3", "mlp.up_proj"),
    "down": ("feed_forward.w2", "mlp.down_proj"),
}
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


@dataclass(frozen=True)
class LoRASpec:
    """rank r (> 0), alpha (scale = alpha / r), targets (keys of TARGETS), trainable: fnmatch
    patterns of further parameter names that stay trainable (fp32 masters, as in full fine-tuning)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    trainable: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def module_names(self, n_layers: int) -> list[str]:
        """Names of the adapted linear layers, e.g. 'layers.0.attention.wq'."""
        return [f"layers.{i}.{TARGETS[t][0]}" for i in range(n_layers) for t in self.targets]

    def stays_trainable(self, name: str) -> bool:
        """Whether base parameter `name` is one of the extra trainable ones."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.trainable)


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """base [out, in] + scale · b [out, r] @ a [r, in], accumulated in fp32 and rounded once to
    base's dtype. The one merge rule of trainer forward, generator and export alike."""
    return torch.addmm(base.float(), b.float(), a.float(), alpha=scale).to(base.dtype)


class LoRALinear(nn.Linear):
    """A linear layer whose weight is the frozen base plus its merged adapters. Takes over the
    base layer's parameters (same names); A and B are fp32 parameters of their own."""

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=torch.float32, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=torch.float32, device=device))
        self.scale = scale
        # A as nn.Linear initialises its weight, B zero: the adapted model starts as the base.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def merged_weight(self) -> torch.Tensor:
        """[out, in]: what this layer multiplies by (see model.lora.merged_weight)."""
        return merged_weight(self.weight, self.lora_A, self.lora_B, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.merged_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale}"


def apply_lora(model: Transformer, spec: LoRASpec, base_dtype: torch.dtype) -> None:
    """Adapt `model` in place: the target layers become LoRALinear, every parameter not matched by
    spec.trainable is frozen and cast to base_dtype; trainable ones are left as they are (the
    caller's fp32 masters). Apply before FSDP2, compile and activation checkpointing."""
    for name, param in model.named_parameters():
        if not spec.stays_trainable(name):
            param.requires_grad_(False)
            param.data = param.data.to(base_dtype)
    for name in spec.module_names(model.args.n_layers):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), spec.rank, spec.scale))


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_shapes(shapes: dict[str, tuple[int, ...]], spec: LoRASpec, n_layers: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the adapters of a model whose parameter shapes are `shapes`:
    lora_A [r, in], lora_B [out, r] per adapted layer."""
    adapters = {}
    for module in spec.module_names(n_layers):
        out_features, in_features = shapes[f"{module}.weight"]
        adapters[f"{module}.lora_A"] = (spec.rank, in_features)
        adapters[f"{module}.lora_B"] = (out_features, spec.rank)
    return adapters


def trained_shapes(shapes: dict[str, tuple[int, ...]], spec: LoRASpec, n_layers: int) -> dict[str, tuple[int, ...]]:
    """Shapes of what trains (and what a checkpoint holds): the adapters and the extra trainable parameters."""
    extra = {name: shape for name, shape in shapes.items() if spec.stays_trainable(name)}
    return {**extra, **adapter_shapes(shapes, spec, n_layers)}


def merge_adapters(
    named: Iterable[tuple[str, torch.Tensor]], spec: LoRASpec, n_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's tensors from an adapted model's: each adapted weight replaced by its merge
    (in the dtype the weight comes in), the adapters dropped. Streams: a weight waits only until its
    layer's A and B have come by."""
    adapted = set(spec.module_names(n_layers))
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        module, _, leaf = name.rpartition(".")
        if module not in adapted or leaf not in ("weight", "lora_A", "lora_B"):
            yield name, tensor
            continue
        parts = waiting.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            del waiting[module]
            yield f"{module}.weight", merged_weight(parts["weight"], parts["lora_A"], parts["lora_B"], spec.scale)
    if waiting:
        raise ValueError(f"adapted layer {next(iter(waiting))} lacks its weight or adapters")
