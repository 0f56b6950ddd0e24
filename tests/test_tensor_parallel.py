"""Tensor-parallel generators: a TP group's engine decodes what one whole engine decodes, and the
weight sync lands each TP rank's exact slice of the trainer's masters."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from fixtures.shards import tp_shard
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams
from model import ModelArgs, Transformer
from model.parallelize import (
    tensor_parallel_args,
    tensor_parallel_layout,
    tensor_parallel_problem,
)
from tests.dist_utils import run_ranks

BASE = ModelArgs(vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
SHAPES = {
    "qwen3": BASE,
    "llama": dataclasses.replace(BASE, arch="llama", qk_norm=False, tie_embeddings=False),
    "qwen2-one-kv-head": dataclasses.replace(BASE, arch="qwen2", qk_norm=False, qkv_bias=True, n_kv_heads=1),
}


def _reference(args: ModelArgs) -> Transformer:
    torch.manual_seed(5)
    model = Transformer(args, dtype=torch.float32)
    model.init_weights(std=0.2)
    return model


def _decode_worker(rank: int, world_size: int, shape: str) -> dict:
    args = SHAPES[shape]
    ref = _reference(args)
    g = torch.Generator().manual_seed(3)
    requests = [GenerationRequest(torch.randint(1, args.vocab_size, (n,), generator=g).tolist(), 1, i, s)
                for i, n in enumerate((3, 9, 1, 14)) for s in range(2)]
    results = {}
    for temperature in (0.0, 1.0):
        sp = SamplingParams(max_new_tokens=10, temperature=temperature)
        engine = NativeEngine(args, sp, eos_ids=[0], seed=1, dtype=torch.float32, device="cpu",
                              tensor_parallel=(world_size, dist.group.WORLD))
        updates = [(n, (), tp_shard(n, p.detach(), args, world_size, rank)) for n, p in ref.named_parameters()]
        engine.update_weights([updates], version=1)
        whole = NativeEngine(args, sp, eos_ids=[0], seed=1, dtype=torch.float32, device="cpu")
        whole.update_weights([[(n, (), p.detach()) for n, p in ref.named_parameters()]], version=1)
        results[temperature] = [
            [(c.tokens, c.logprobs) for c in e.generate(requests)] for e in (engine, whole)
        ]
    return results


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp2_decode_equals_one_engine(tmp_path, shape):
    """Greedy and sampled completions of a TP = 2 engine equal a whole engine's on every rank of the
    group (same tokens; log-probs to fp32 rounding: the row-parallel sums add in another order)."""
    for rank_results in run_ranks(functools.partial(_decode_worker, shape=shape), 2, tmp_path, timeout_s=120):
        for temperature, (tp, whole) in rank_results.items():
            assert [t for t, _ in tp] == [t for t, _ in whole], temperature
            for (_, lp_tp), (_, lp_whole) in zip(tp, whole):
                torch.testing.assert_close(torch.tensor(lp_tp), torch.tensor(lp_whole), atol=1e-5, rtol=0)


def test_tp_shards_cover_each_parameter_and_replicate_shared_kv_heads():
    args, tp = SHAPES["qwen2-one-kv-head"], 2
    local = tensor_parallel_args(args, tp)
    assert (local.n_heads, local.n_kv_heads, local.ffn_dim) == (2, 1, 32)
    ref = _reference(args)
    with torch.device("meta"):
        shard_shapes = {n: p.shape for n, p in Transformer(local).named_parameters()}
    for name, full in ref.named_parameters():
        shards = [tp_shard(name, full.detach(), args, tp, r) for r in range(tp)]
        assert all(s.shape == shard_shapes[name] for s in shards), name
        if ".wk." in name or ".wv." in name:
            assert torch.equal(shards[0], shards[1])  # one K/V head, replicated on both ranks
    assert tensor_parallel_problem(args, 3) == "does not divide the 4 query heads"
    assert tensor_parallel_problem(dataclasses.replace(args, n_heads=6, n_kv_heads=4, ffn_dim=60), 3) == (
        "neither divides nor is a multiple of the 4 K/V heads"
    )


# Uneven first dimensions (21, 13) split over 2 and 3 trainer ranks; one K/V head replicated on both TP ranks.
SYNC_SHAPES = {
    "gqa": ModelArgs(vocab_size=13, dim=21, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6, ffn_dim=38),
    "one-kv-head": ModelArgs(vocab_size=13, dim=21, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=6, ffn_dim=38,
                             arch="qwen2", qk_norm=False, qkv_bias=True),
}


def _perturbed_masters(args: ModelArgs, version: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 masters after `version` deterministic updates, on whole tensors."""
    torch.manual_seed(0)
    model = Transformer(args, dtype=torch.float32)
    model.init_weights()
    return {n: p.detach() + _offset(p.shape, version) for n, p in model.named_parameters()}


def _offset(shape, version: int) -> torch.Tensor:
    n = torch.Size(shape).numel()
    return (torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + version) * 1e-2).float().view(shape)


def _tp_sync_worker(rank: int, world_size: int, generators: int, shape: str) -> dict:
    from torch.distributed.tensor import DTensor

    from grpo.distributed.roles import build_roles
    from grpo.distributed.weight_sync import WeightSync
    from model.parallelize import parallelize

    args, tp, cpu = SYNC_SHAPES[shape], 2, torch.device("cpu")
    roles = build_roles("split", generators, cpu, generator_tp=tp)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Transformer(args).named_parameters()}
    layout = None
    if roles.is_generator:
        layout = functools.partial(tensor_parallel_layout, args=args, tp=tp, tp_rank=roles.tp_rank)
    syncs = [WeightSync(shapes, roles.trainer_ranks, roles.weight_groups, torch.bfloat16, cpu, b, generator_layout=layout)
             for b in (512, 60)]
    if roles.is_trainer:
        me, trainers = roles.trainer_ranks.index(rank), len(roles.trainer_ranks)
        torch.manual_seed(0)
        model = Transformer(args, dtype=torch.float32)
        model.init_weights()
        parallelize(model, roles.trainer_mesh, compute_dtype=torch.float32)
        for version, sync in enumerate(syncs, start=1):
            with torch.no_grad():
                for p in model.parameters():
                    assert isinstance(p, DTensor)
                    delta = _offset(p.shape, version) - (_offset(p.shape, version - 1) if version > 1 else 0)
                    chunks = delta.chunk(trainers, dim=0)
                    if me < len(chunks):
                        p.to_local().add_(chunks[me])
            sync.send(dict(model.named_parameters()))
        return {"role": "trainer"}
    engine = NativeEngine(args, SamplingParams(4), eos_ids=[0], seed=0, dtype=torch.bfloat16, device=cpu,
                          tensor_parallel=(tp, roles.tp_group))
    mismatched = []
    for version, sync in enumerate(syncs, start=1):
        sync.receive(engine, version=version)
        masters = _perturbed_masters(args, version)
        for name, param in engine.model.named_parameters():
            want = tp_shard(name, masters[name].to(torch.bfloat16), args, tp, roles.tp_rank)
            if not torch.equal(param, want):
                mismatched.append((version, name))
    return {"role": "generator", "tp_rank": roles.tp_rank, "mismatched": mismatched}


@pytest.mark.parametrize("trainers, generators", [(1, 2), (2, 2), (3, 2), (2, 4)], ids=["1+2", "2+2", "3+2", "2+4"])
@pytest.mark.parametrize("shape", list(SYNC_SHAPES))
def test_sync_lands_each_tp_rank_its_slice_of_the_masters(tmp_path, trainers, generators, shape):
    """After each sync, every rank of every TP = 2 group holds the trainer's masters (bf16) sliced by
    its placements, bitwise, with the masters sharded unevenly over 1-3 FSDP ranks."""
    results = run_ranks(functools.partial(_tp_sync_worker, generators=generators, shape=shape),
                        trainers + generators, tmp_path, timeout_s=120)
    gens = [r for r in results if r["role"] == "generator"]
    assert [r["tp_rank"] for r in gens] == [0, 1] * (generators // 2)
    for r in gens:
        assert r["mismatched"] == [], r["mismatched"][:5]


def test_generator_tp_is_checked_against_ranks_roles_and_model():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"generator_tp = 2 does not divide parallelism.generator_ranks = 3"):
        load_config(["--parallelism.generator_ranks=3", "--parallelism.generator_tp=2"], world_size=4)
    with pytest.raises(ConfigError, match="generator_tp = 2 needs split roles"):
        load_config(["--parallelism.mode=colocated", "--parallelism.generator_tp=2"], world_size=2)
    with pytest.raises(ConfigError, match="generator_tp = 3 does not divide the 4 query heads of the model"):
        load_config(["--parallelism.generator_ranks=3", "--parallelism.generator_tp=3", "--data.prompts_per_step=8"],
                    world_size=4)


def test_split_run_with_a_tp2_generator_learns_the_demo(tmp_path):
    """2 generator ranks as one TP = 2 engine + 1 trainer: the shortened demo's held-out reward rises,
    and the engine's log-probs agree with the trainer's to fp32 rounding (the weights landed right)."""
    from tests.test_e2e import launch, metrics

    result = launch(["--training.steps=25", "--parallelism.generator_ranks=2", "--parallelism.generator_tp=2",
                     f"--job.output_dir={tmp_path}", "--metrics.progress_bar=false"], nproc=3, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    first, last = rows[0]["eval/reward_mean"], rows[-1]["eval/reward_mean"]
    assert first <= 0.15 and last >= first + 0.2, (first, last)
    assert max(r["logprob_diff/max"] for r in rows if "logprob_diff/max" in r) < 1e-4


def test_lora_adapters_reach_a_tp2_generator_and_merge_in_its_shards(tmp_path):
    """LoRA with a TP = 2 engine: each step's adapters are split with their layer's shards (B by rows
    for a column-parallel layer, A by columns for a row-parallel one), merged into each rank's shard
    of the weight, and the engine's log-probs agree with the trainer's to fp32 rounding at every step."""
    from tests.test_e2e import SHORT, launch, metrics

    result = launch([*SHORT, "--lora.rank=4", "--parallelism.generator_ranks=2", "--parallelism.generator_tp=2",
                     f"--job.output_dir={tmp_path}"], nproc=3)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in metrics(tmp_path) if "logprob_diff/max" in r]
    assert len(steps) == 3
    assert all(r["logprob_diff/max"] < 1e-4 for r in steps), [r["logprob_diff/max"] for r in steps]
