"""FSDP2 (model.parallelize) on 2 CPU ranks over gloo, against a single-process run of the same step.

One spawn of 2 real processes runs every distributed scenario (spawning dominates the cost); each
rank writes what it saw to files under tmp_path, and the tests compare that with reference steps
computed here in the test process.
"""

from __future__ import annotations

import pytest
import torch

from model import ModelArgs, Transformer
from tests.dist_utils import run_ranks

WORLD_SIZE = 2
TIMEOUT_S = 300
LR = 1e-3
ARGS = dict(arch="qwen3", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
            qkv_bias=True, qk_norm=True, tie_embeddings=False)


def build_model() -> Transformer:
    """Deterministic fp32 model with non-trivial norms and biases (same on every rank and here)."""
    model = Transformer(ModelArgs(**ARGS), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    return model


def make_batch():
    """4 packed rows of 16 tokens, per-token weights (advantage x mask) and the global token count."""
    gen = torch.Generator().manual_seed(1)
    B, T, V = 4, 16, ARGS["vocab_size"]
    tokens = torch.randint(V, (B, T), generator=gen)
    targets = torch.randint(V, (B, T), generator=gen)
    # two sequences per row, split at a row-dependent point; positions restart at the split
    split = torch.tensor([5, 9, 3, 12])
    idx = torch.arange(T)[None].expand(B, T)
    second = idx >= split[:, None]
    doc_ids = second.long()
    positions = torch.where(second, idx - split[:, None], idx)
    mask = torch.ones(B, T)
    mask[1, 13:] = 0
    mask[2, :2] = 0
    advantages = torch.randn(B, 2, generator=gen)
    weights = advantages.gather(1, doc_ids) * mask
    return tokens, positions, doc_ids, targets, weights, mask.sum()


def step_loss(model, tokens, positions, doc_ids, targets, weights, count, scale: float = 1.0):
    out = model(tokens, positions, doc_ids, targets=targets)
    return -(out.logprobs * weights).sum() / count * scale


def reference_step():
    """Single process, whole batch: grads and updated weights after one AdamW step."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    tokens, positions, doc_ids, targets, weights, count = make_batch()
    step_loss(model, tokens, positions, doc_ids, targets, weights, count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------- the ranks


def _distributed_step(rank: int, compute_dtype: torch.dtype, activation_checkpointing: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from model.parallelize import parallelize

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    model = parallelize(build_model(), mesh, compute_dtype=compute_dtype,
                        activation_checkpointing=activation_checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    tokens, positions, doc_ids, targets, weights, count = make_batch()
    rows = slice(rank * 2, rank * 2 + 2)  # this rank's half of the batch
    # FSDP2's reduce-scatter averages over ranks: scale by world size to get the global sum / count
    loss = step_loss(model, tokens[rows], positions[rows], doc_ids[rows], targets[rows], weights[rows], count,
                     scale=WORLD_SIZE)
    loss.backward()
    info = {
        "param_dtypes": {n: p.to_local().dtype for n, p in model.named_parameters()},
        "grad_dtypes": {n: p.grad.to_local().dtype for n, p in model.named_parameters()},
        "param_types": {n: type(p).__name__ for n, p in model.named_parameters()},
        "local_numel": {n: p.to_local().numel() for n, p in model.named_parameters()},
        "loss": loss.detach().float(),
    }
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return grads, params, info


SCENARIOS = {
    "fp32": (torch.float32, False),
    "fp32_ac": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
}


def _worker(rank: int, world_size: int) -> dict:
    results = {}
    for name, (dtype, ac) in SCENARIOS.items():
        grads, params, info = _distributed_step(rank, dtype, ac)
        results[name] = {"grads": grads, "params": params, "info": info}
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, WORLD_SIZE, tmp_path_factory.mktemp("fsdp"), timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference():
    return reference_step()


# ------------------------------------------------------------------------------------------- the tests


def test_fsdp_fp32_step_matches_single_process(ranks, reference):
    ref_grads, ref_params = reference
    initial = dict(build_model().named_parameters())
    for rank_results in ranks:
        result = rank_results["fp32"]
        # really sharded: each rank holds a part of every matrix
        assert all(t == "DTensor" for t in result["info"]["param_types"].values())
        w1 = "layers.0.feed_forward.w1.weight"
        assert result["info"]["local_numel"][w1] < initial[w1].numel()
        assert result["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(result["grads"][name], grad, atol=1e-6, rtol=0, msg=name)
        for name, param in ref_params.items():
            assert not torch.equal(param, initial[name]), name  # the step moved it
            torch.testing.assert_close(result["params"][name], param, atol=1e-6, rtol=0, msg=name)


def test_fsdp_activation_checkpointing_same_grads(ranks):
    for rank_results in ranks:
        plain, ac = rank_results["fp32"], rank_results["fp32_ac"]
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(ac["grads"][name], grad, atol=1e-6, rtol=0, msg=name)
        for name, param in plain["params"].items():
            torch.testing.assert_close(ac["params"][name], param, atol=1e-6, rtol=0, msg=name)


def test_fsdp_bf16_compute_keeps_fp32_masters_and_grads(ranks, reference):
    ref_grads, ref_params = reference
    for rank_results in ranks:
        result = rank_results["bf16"]
        info = result["info"]
        assert set(info["param_dtypes"].values()) == {torch.float32}
        assert set(info["grad_dtypes"].values()) == {torch.float32}
        assert torch.isfinite(info["loss"])
        # bf16 compute: close to the fp32 step but not identical to it
        differs = False
        for name, grad in ref_grads.items():
            assert result["grads"][name].dtype == torch.float32
            scale = grad.abs().max()
            assert (result["grads"][name] - grad).abs().max() <= 0.1 * scale + 1e-3, name
            differs |= not torch.equal(result["grads"][name], grad)
        assert differs
        for name, param in ref_params.items():
            assert result["params"][name].dtype == torch.float32
            # AdamW's first step moves each weight by about lr: a wrong-signed update would be 2 * lr off
            assert (result["params"][name] - param).abs().max() <= 2 * LR + 1e-6, name


def test_parallelize_refuses_non_fp32_masters():
    from torch.distributed.device_mesh import DeviceMesh

    from model.parallelize import parallelize

    model = Transformer(ModelArgs(**ARGS), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        parallelize(model, mesh=DeviceMesh.__new__(DeviceMesh))
