"""Tiny random native models and packed rows for the model's tests."""

from __future__ import annotations

import torch

from model import ModelArgs, Transformer


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int, std: float = 0.12) -> torch.nn.Module:
    """Non-trivial weights everywhere: N(0, std) matrices, N(0, 0.2) biases, U(0.5, 1.5) norms."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        if "norm" in name:
            values = 0.5 + torch.rand(param.shape, generator=gen)
        elif name.endswith("bias"):
            values = 0.2 * torch.randn(param.shape, generator=gen)
        else:
            values = std * torch.randn(param.shape, generator=gen)
        param.copy_(values.to(param.dtype))
    return module


def native_model(seed: int = 0, **overrides) -> Transformer:
    fields = dict(arch="qwen3", vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  ffn_dim=128, qkv_bias=True, qk_norm=True, tie_embeddings=False, rope_theta=10000.0)
    fields.update(overrides)
    torch.manual_seed(seed)
    return randomize_(Transformer(ModelArgs(**fields), dtype=torch.float32), seed, std=0.15)


def pack(seqs: list[torch.Tensor], row_len: int):
    """One packed row: tokens, positions restarting at 0, one doc id per sequence, padding as its own doc."""
    tokens, positions, doc_ids = [], [], []
    for i, seq in enumerate(seqs):
        tokens.append(seq)
        positions.append(torch.arange(len(seq)))
        doc_ids.append(torch.full((len(seq),), i))
    pad = row_len - sum(len(s) for s in seqs)
    assert pad >= 0
    if pad:
        tokens.append(torch.zeros(pad, dtype=torch.long))
        positions.append(torch.arange(pad))
        doc_ids.append(torch.full((pad,), len(seqs)))
    return torch.cat(tokens), torch.cat(positions), torch.cat(doc_ids)


def random_tokens(batch: int, seq_len: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
