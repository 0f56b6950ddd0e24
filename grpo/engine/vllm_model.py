"""Our native model inside vLLM: a thin wrapper that vLLM's model registry instantiates.

The layers are `model.Transformer`'s own (same parameter names and layout, so weight updates from
the trainer need no renaming); only attention is vLLM's, one `Attention` layer per block over its
paged KV cache, called between the two halves of each block exactly where the native engine puts
its own cache-aware attention. Imported only inside vLLM's engine process (it imports vllm).
"""

from __future__ import annotations

import io
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.attention import Attention

from model import ModelArgs, Transformer


class TandemForCausalLM(nn.Module):
    """vLLM's model interface over `Transformer`: flattened tokens in, hidden states out, logits
    from the (possibly tied) output weight."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config.to_dict()
        # The engine writes config.json from ModelArgs with the native architecture it came from.
        config["architectures"] = [config.pop("tandem_architecture")]
        args = ModelArgs.from_hf_config(config)
        self.model = Transformer(args, dtype=vllm_config.model_config.dtype)
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
        """Copy native-named tensors into the parameters, in place; returns the names loaded."""
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
    """Methods vLLM mixes into its worker (`worker_extension_cls`), called through
    `LLM.collective_rpc`. Weights travel as one serialised byte string: vLLM's zero-copy tensor
    messages cannot be forwarded on to a worker process."""

    def load_tandem_weights(self, payload: bytes) -> int:
        """Copy whole native-named tensors (a `torch.save`d list of (name, tensor), in memory) into
        the wrapper's parameters; returns how many."""
        updates = torch.load(io.BytesIO(payload), weights_only=True)
        return len(self.model_runner.get_model().load_weights(updates))
