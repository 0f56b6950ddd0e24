"""Bitwise on-policy log-probs (job.bitwise_logprobs, model/batch_invariant.py): the engine's
per-token log-probs equal the trainer's recomputation exactly, in fp32 on the CPU.

The expectation is independent of both sides: the trainer recomputes π_old from the packed
episodes with its own forward (`logprob_diff/{max,exact_frac}` compare it with what the engine
reported). Without the mode the same pipeline is a few ulps off on most tokens, which the control
cases check, so an always-exact comparison cannot pass these tests.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams
from grpo.rollout.generate import episodes_from_completions
from grpo.train.trainer import Trainer
from model import ModelArgs, Transformer, batch_invariant
from model.batch_invariant import BLOCK, causal_attention
from tests.dist_utils import one_thread, single_process_group
from tests.test_e2e import SHORT, launch, metrics

V = 48
ARGS = ModelArgs(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
EOS = V - 1
GROUP = 3


@pytest.fixture(autouse=True)
def _one_thread_and_mode_reset():
    with one_thread():
        yield
    batch_invariant.enable(False)


def policy() -> Transformer:
    torch.manual_seed(3)
    model = Transformer(ARGS, dtype=torch.float32)
    model.init_weights(std=0.1)
    return model


def mixed_prompts(n: int) -> list[list[int]]:
    """Prompt lengths 1..(BLOCK + 7): single tokens and prompts that cross a key block."""
    g = torch.Generator().manual_seed(11)
    lengths = [1, BLOCK + 7, 5, 2, BLOCK - 1, 9, 1, 17][:n]
    return [torch.randint(0, EOS, (length,), generator=g).tolist() for length in lengths]


def pi_old_gap(max_batch_size: int, micro_batch_tokens: int, temperature: float = 1.0,
               prompts: int = 8) -> dict[str, float]:
    """Generate GROUP completions of each of the first `prompts` mixed prompts, then let a trainer
    recompute their log-probs: the trainer's logprob_diff metrics of that first step."""
    model = policy()
    sampling = SamplingParams(max_new_tokens=12, temperature=temperature)
    engine = NativeEngine(ARGS, sampling, eos_ids=[EOS], seed=1, dtype=torch.float32, device="cpu",
                          max_batch_size=max_batch_size)
    engine.update_weights([[(n, (), p.detach()) for n, p in model.named_parameters()]], version=0)
    requests = [GenerationRequest(p, 0, i, s) for i, p in enumerate(mixed_prompts(prompts)) for s in range(GROUP)]
    batch = episodes_from_completions(engine.generate(requests), pad_id=0)
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))
    with single_process_group():
        trainer = Trainer(model, init_device_mesh("cpu", (1,)), torch.device("cpu"), torch.float32,
                          GRPOConfig(group_size=GROUP), OptimizerConfig(lr=1e-3, warmup_steps=0), total_steps=4,
                          micro_batch_tokens=micro_batch_tokens, temperature=temperature, max_new_tokens=12)
        return trainer.train(batch)


# micro_batch_tokens: 64 packs a few episodes per row; 4096 puts the whole batch in one row.
CASES = [(1, 64), (1, 4096), (24, 64), (24, 4096), (5, 50)]


@pytest.mark.parametrize(("max_batch_size", "micro_batch_tokens"), CASES)
def test_engine_logprobs_equal_the_trainers_bitwise(max_batch_size, micro_batch_tokens):
    batch_invariant.enable(True)
    gap = pi_old_gap(max_batch_size, micro_batch_tokens)
    assert gap["logprob_diff/max"] == 0.0
    assert gap["logprob_diff/exact_frac"] == 1.0


def test_greedy_logprobs_equal_the_trainers_bitwise():
    batch_invariant.enable(True)
    gap = pi_old_gap(24, 64, temperature=0.0)
    assert gap["logprob_diff/max"] == 0.0 and gap["logprob_diff/exact_frac"] == 1.0


@pytest.mark.parametrize(("max_batch_size", "micro_batch_tokens"), [(1, 64), (24, 4096)])
def test_without_the_mode_the_same_pipeline_is_not_exact(max_batch_size, micro_batch_tokens):
    gap = pi_old_gap(max_batch_size, micro_batch_tokens)
    assert 0.0 < gap["logprob_diff/max"] < 1e-4
    assert gap["logprob_diff/exact_frac"] < 1.0


def test_block_attention_equals_sdpa_and_ignores_its_company():
    """causal_attention against causal SDPA (fp32, 1e-6), and each query's output bitwise the same
    alone (decode), with the queries around it (prefill) and with more keys past it."""
    g = torch.Generator().manual_seed(5)
    L, H, Hkv, D = 2 * BLOCK + 9, 4, 2, 8
    q, k, v = (torch.randn(L, h, D, generator=g) for h in (H, Hkv, Hkv))
    whole = causal_attention(q, 0, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(whole, want, atol=1e-6, rtol=0)
    for p in (0, 1, BLOCK - 1, BLOCK, L - 1):
        alone = causal_attention(q[p : p + 1], p, k[: p + 1], v[: p + 1])
        assert torch.equal(alone[0], whole[p]), p
    tail = causal_attention(q[BLOCK + 3 :], BLOCK + 3, k, v)
    assert torch.equal(tail, whole[BLOCK + 3 :])


@pytest.mark.parametrize(("mode", "nproc"), [("colocated", None), ("split", 2)])
def test_demo_run_reports_exact_logprobs_every_step(tmp_path, mode, nproc):
    """The demo, colocated on one process and split 1 + 1 (engine and trainer in separate processes),
    with weights changing over 10 steps: every step's logprob_diff is 0."""
    run = launch([*SHORT, "--training.steps=10", "--job.bitwise_logprobs=true", f"--parallelism.mode={mode}",
                  f"--job.output_dir={tmp_path}"],
                 nproc=nproc)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [r for r in metrics(tmp_path) if "logprob_diff/max" in r]
    assert len(steps) == 10
    assert all(r["logprob_diff/max"] == 0.0 and r["logprob_diff/exact_frac"] == 1.0 for r in steps)
    assert steps[0]["loss/grad_norm"] > 0


def test_bitwise_logprobs_refuses_what_it_does_not_cover(tmp_path):
    run = launch([*SHORT, "--job.bitwise_logprobs=true", "--parallelism.mode=colocated", '--generation.engine="vllm"',
                  "--generation.kv_cache_gb=1", f"--job.output_dir={tmp_path}"], nproc=None)
    assert run.returncode != 0
    assert "job.bitwise_logprobs" in run.stderr and "vLLM" in run.stderr
    assert "Traceback" not in run.stderr
