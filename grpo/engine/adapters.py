"""The generator's side of LoRA: adapters arrive each step and are merged into the engine's own
weights, W = W_base + s·B·A (model/lora.py `merged_weight`, the trainer's rule).

The engine's parameters keep their storage (views into fused matrices, addresses captured in
CUDA graphs): a merge writes into them in place. Each merge starts from a separate copy of the
unmerged base, never from the previous merge, so rounding does not accumulate over steps. That
copy costs the adapted matrices' size once more in the engine's dtype.
"""

from __future__ import annotations

import torch

from model.lora import LoRASpec, merged_weight


class AdapterMerge:
    """Receives base weights and adapters of the adapted layers, by parameter name, and merges them
    into the engine's parameters `params` (name -> tensor; a tensor-parallel engine's shards)."""

    def __init__(self, params: dict[str, torch.Tensor], spec: LoRASpec, n_layers: int):
        self.params, self.scale = params, spec.scale
        # module -> {"weight": base copy [out, in], "lora_A": [r, in], "lora_B": [out, r]}, all local shards
        self.parts: dict[str, dict[str, torch.Tensor]] = {}
        for module in spec.module_names(n_layers):
            weight = params[f"{module}.weight"]
            out_features, in_features = weight.shape
            self.parts[module] = {
                "weight": weight.detach().clone(),
                "lora_A": weight.new_zeros(spec.rank, in_features),
                "lora_B": weight.new_zeros(out_features, spec.rank),
            }
        self._stale: set[str] = set()

    def owns(self, name: str) -> bool:
        """Whether `name` is an adapted layer's base weight or adapter (what `write` takes)."""
        module, _, leaf = name.rpartition(".")
        return module in self.parts and leaf in ("weight", "lora_A", "lora_B")

    def storage(self, name: str) -> torch.Tensor:
        """The base copy or adapter that update pieces for `name` are written into (the vLLM
        worker copies into its views); `touch` its module afterwards so that `merge` sees it."""
        module, _, leaf = name.rpartition(".")
        return self.parts[module][leaf]

    def touch(self, modules: set[str]) -> None:
        """Mark adapted layers (module names) as received since the last merge."""
        self._stale |= modules

    def write(self, name: str, index: tuple[slice, ...], tensor: torch.Tensor) -> None:
        """Store `tensor` at `index` of the base copy or adapter `name`; merged at the next `merge`."""
        target = self.storage(name)[index]
        if target.shape != tensor.shape:
            raise ValueError(
                f"weight update for {name!r}{list(index) if index else ''} has shape {list(tensor.shape)}, "
                f"the engine holds {list(target.shape)}"
            )
        target.copy_(tensor)
        self.touch({name.rpartition(".")[0]})

    @torch.no_grad()
    def merge(self) -> None:
        """Write W_base + s·B·A into every adapted layer that received something since the last merge."""
        for module in sorted(self._stale):
            part = self.parts[module]
            self.params[f"{module}.weight"].copy_(merged_weight(part["weight"], part["lora_A"], part["lora_B"], self.scale))
        self._stale.clear()
