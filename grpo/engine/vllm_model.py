"""Our native model inside vLLM: a thin wrapper that vLLM's model registry instantiates, and the
methods our engine calls in vLLM's worker.

The layers are `model.Transformer`'s own (same parameter names and layout, so weight updates from
the trainer need no renaming); only attention is vLLM's, one `Attention` layer per block over its
paged KV cache, called between the two halves of each block exactly where the native engine puts
its own cache-aware attention. Importing this module registers the wrapper with vLLM: the engine
imports it in the rank before it starts vLLM, and vLLM's worker imports it as the worker
extension, before it loads the model. (No plugin entry point: registration does not depend on how
the package was installed.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm import ModelRegistry
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.layers.attention import Attention

from grpo.engine.adapters import AdapterMerge
from grpo.engine.vllm_staging import OpenedStaging, StagedPiece
from model import ModelArgs, Transformer
from model.lora import LoRASpec

# The name the wrapper is registered under; the engine's config.json asks for it.
ARCHITECTURE = "TandemForCausalLM"


# vLLM compiles forward (when its compilation mode asks for it) with the token axis dynamic, and
# splits the graph at its attention op to capture the pieces in CUDA graphs, as for its own models.
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})
class TandemForCausalLM(nn.Module):
    """vLLM's model interface over `Transformer`: flattened tokens in, hidden states out, logits
    from the (possibly tied) output weight. The projections are fused as in the native engine
    (one q/k/v matmul, one gate/up matmul per block; parameters are views into them)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config.to_dict()
        # The engine writes config.json from ModelArgs with the native architecture it came from.
        config["architectures"] = [config.pop("tandem_architecture")]
        args = ModelArgs.from_hf_config(config)
        self.model = Transformer(args, dtype=vllm_config.model_config.dtype)
        self.model.fuse_projections()
        self.model.keep_rope_on(vllm_config.device_config.device)
        self.attention = nn.ModuleList(
            Attention(
                args.n_heads,
                args.head_dim,
                args.head_dim**-0.5,
                num_kv_heads=args.n_kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}attention.{i}",
            )
            for i in range(args.n_layers)
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None, inputs_embeds=None
    ) -> torch.Tensor:
        """input_ids, positions [N] (every scheduled token of the batch) -> hidden states [N, dim]."""
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise NotImplementedError("the tandem model takes token ids on a single pipeline stage")

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attention[layer](q.flatten(1), k.flatten(1), v.flatten(1)).view(q.shape)

        return self.model.decode_hidden(input_ids, positions, attend)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[M, dim] -> [M, V]."""
        return F.linear(hidden_states, self.model.output_weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy native-named tensors into the parameters, in place; returns the names loaded. (vLLM's
        loaders call this for checkpoint formats; the engine starts from dummy weights and syncs
        through the staging buffer instead.)"""
        params = {f"model.{name}": p for name, p in self.model.named_parameters()}
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                key = name if name in params else f"model.{name}"
                if key not in params:
                    raise KeyError(f"vLLM engine: no parameter {name!r} in the tandem model")
                params[key].copy_(tensor)
                loaded.add(key)
        return loaded


class TandemWorkerExtension:
    """Methods vLLM mixes into its worker (`worker_extension_cls`), called from the engine through
    `LLM.collective_rpc`; each name starts with `tandem_` so none shadows the worker's own."""

    def tandem_open_staging(self, handle: bytes) -> None:
        """Map the rank's staging buffer (vllm_staging.py) into this process, once."""
        self._tandem_staging = OpenedStaging(handle)
        self._tandem_params = dict(self.model_runner.get_model().model.named_parameters())
        # plan id -> (targets, sources, adapted layers the plan writes into)
        self._tandem_plans: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], set[str]]] = {}
        self._tandem_adapters: AdapterMerge | None = None

    def tandem_enable_lora(self, rank: int, alpha: float, targets: list[str]) -> None:
        """Take adapted layers' base weights and adapters from now on, and merge them into the
        parameters in place (grpo/engine/adapters.py, the native engine's rule)."""
        spec = LoRASpec(rank, alpha, tuple(targets))
        n_layers = self.model_runner.get_model().model.args.n_layers
        self._tandem_adapters = AdapterMerge(self._tandem_params, spec, n_layers)

    def tandem_load_staged(self, plan_id: int, pieces: list[StagedPiece] | None) -> None:
        """Copy a buffer-full of pieces into the parameters (an adapted layer's base weight and
        adapters into the adapter merge's copies): `param[box] = staging[offset:][:numel]`.
        `pieces` describes the plan the first time it is used; later calls name it by its id.
        Returns when the copies are done, so that the rank may refill the buffer."""
        if pieces is not None:
            self._tandem_plans[plan_id] = self._tandem_plan(pieces)
        targets, sources, adapted = self._tandem_plans[plan_id]
        with torch.no_grad():
            torch._foreach_copy_(targets, sources)
        if adapted:
            self._tandem_adapters.touch(adapted)
        if targets[0].is_cuda:
            torch.cuda.synchronize(targets[0].device)

    def _tandem_plan(self, pieces: list[StagedPiece]) -> tuple[list[torch.Tensor], list[torch.Tensor], set[str]]:
        staging, adapters = self._tandem_staging.tensor, self._tandem_adapters
        targets, adapted = [], set()
        for name, box, _, _ in pieces:
            index = tuple(slice(lo, hi) for lo, hi in box)
            if adapters is not None and adapters.owns(name):
                targets.append(adapters.storage(name)[index])
                adapted.add(name.rpartition(".")[0])
            else:
                targets.append(self._tandem_params[name][index])
        sources = [staging[offset : offset + math.prod(shape)].view(shape) for _, _, offset, shape in pieces]
        return targets, sources, adapted

    def tandem_merge_adapters(self) -> None:
        """Merge what the last sync brought into the adapted layers' parameters."""
        self._tandem_adapters.merge()
        if next(iter(self._tandem_params.values())).is_cuda:
            torch.cuda.synchronize()

    def tandem_release_kv(self) -> int:
        """Unmap the physical pages of vLLM's "kv_cache" pool (the K/V tensors and the buffers
        allocated with them), keeping their virtual addresses; the weights stay on the GPU, where
        vLLM's own sleep copies them to host memory. Returns the bytes given back."""
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        torch.cuda.synchronize()
        released = 0
        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            if data.tag == "kv_cache" and not data.is_asleep:
                unmap_and_release(data.handle)
                data.is_asleep = True
                released += data.handle[1]
        return released

    def tandem_restore_kv(self) -> None:
        """Map fresh pages at the K/V cache's addresses (their contents are undefined: the engine
        resets the prefix cache next)."""
        from vllm.device_allocator.cumem import CuMemAllocator, create_and_map

        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            if data.tag == "kv_cache" and data.is_asleep:
                create_and_map(data.handle)
                data.is_asleep = False
        # What vLLM's own wake-up does for this pool: buffers that live beside the K/V tensors
        # (the block tables' layout) are filled in again.
        self.model_runner.post_kv_cache_wake_up()

    def tandem_device_bytes(self) -> int:
        """Device memory this process holds through PyTorch, less the K/V pages now unmapped."""
        from vllm.device_allocator.cumem import CuMemAllocator

        unmapped = sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.is_asleep)
        return torch.cuda.memory_reserved() - unmapped

    def tandem_close_staging(self) -> None:
        self._tandem_params, self._tandem_plans, self._tandem_adapters = {}, {}, None
        self._tandem_staging.close()


if ARCHITECTURE not in ModelRegistry.get_supported_archs():
    ModelRegistry.register_model(ARCHITECTURE, TandemForCausalLM)
