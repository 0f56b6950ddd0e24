"""The trainer's logprob_diff/exact_frac, and its one-rank path (plain masters, no FSDP) against
FSDP2 on a one-rank mesh (grpo/train/trainer.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from grpo.config import GRPOConfig
from grpo.train.packing import plan_micro_batches
from grpo.train.trainer import Trainer
from tests.dist_utils import one_thread, single_process_group
from tests.trainer_setup import (
    CLIP_HIGH,
    CLIP_LOW,
    COMPLETION_LENS,
    MAX_NORM,
    SMALL,
    TEMPERATURE,
    WHOLE,
    build_model,
    grpo_config,
    initial_weights,
    make_batch,
    optim_config,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


# ------------------------------------------------------------------ logprob_diff/exact_frac


def test_exact_frac_counts_tokens_whose_generator_logprob_equals_pi_old_bitwise():
    """gen_logprobs set to the trainer's own π_old (same packing, same forward) on the episodes of
    two groups and nudged by 1e-3 on the others: exact_frac is the first share of completion tokens,
    and logprob_diff/max is the nudge."""
    batch = make_batch()
    with single_process_group():
        mesh = init_device_mesh("cpu", (1,))
        trainer = Trainer(build_model(), mesh, torch.device("cpu"), torch.float32, grpo_config(), optim_config(),
                          total_steps=10, micro_batch_tokens=SMALL, temperature=TEMPERATURE, max_new_tokens=8)
        exact_groups = {10, 12}
        # The trainer's micro-batches, and which batch episodes each packs (doc ids count within it).
        (micro_batches,) = trainer._micro_batches(batch)
        chunks = plan_micro_batches((batch.seq_lens - 1).tolist(), SMALL)
        assert len(chunks) == len(micro_batches) > 1
        with torch.no_grad():
            for mb, chunk in zip(micro_batches, chunks):
                rows = mb.rows
                logprobs = trainer._forward(rows).logprobs
                for r, c in (rows.loss_mask > 0).nonzero().tolist():
                    i = chunk[int(rows.doc_ids[r, c])]
                    nudge = 0.0 if int(batch.prompt_index[i]) in exact_groups else 1e-3
                    # target (r, c) is token positions[r, c] + 1 of episode i
                    batch.gen_logprobs[i, int(rows.positions[r, c]) + 1] = logprobs[r, c] + nudge
        metrics = trainer.train(batch)
    tokens = [sum(c) for c in COMPLETION_LENS]
    assert metrics["logprob_diff/exact_frac"] == pytest.approx((tokens[0] + tokens[2]) / sum(tokens), abs=1e-12)
    assert metrics["logprob_diff/max"] == pytest.approx(1e-3, rel=1e-3)


# ------------------------------------------------------------------ one rank without FSDP


def test_one_rank_path_equals_fsdp_on_one_rank_bitwise():
    """The one-rank trainer (plain masters, a bf16 copy, fp32 gradient accumulation) against FSDP2
    on the same one-rank mesh: bf16 compute, several micro-batches, two minibatches, two
    iterations, clipping and a KL reference, two RL steps. Weights, optimizer state and metrics
    are bitwise equal."""
    batch = make_batch()
    grpo = GRPOConfig(group_size=3, clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH, num_iterations=2,
                      minibatches=2, kl_coef=0.05)
    runs = {}
    with single_process_group():
        mesh = init_device_mesh("cpu", (1,))
        for fsdp in (False, True):
            reference = build_model()
            trainer = Trainer(build_model(), mesh, torch.device("cpu"), torch.bfloat16, grpo, optim_config(MAX_NORM),
                              total_steps=10, micro_batch_tokens=SMALL, temperature=TEMPERATURE, max_new_tokens=8,
                              reference=reference, fsdp_on_one_rank=fsdp)
            assert (trainer.one_rank is None) == fsdp
            metrics = [trainer.train(batch) for _ in range(2)]
            weights = {}
            for name, param in trainer.model.named_parameters():
                weights[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
            moments = []
            for state in trainer.optimizer.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    value = state[key]
                    moments.append((value.full_tensor() if isinstance(value, DTensor) else value).clone())
            runs[fsdp] = weights, moments, metrics
    (w_plain, m_plain, metrics_plain), (w_fsdp, m_fsdp, metrics_fsdp) = runs[False], runs[True]
    assert all(w.dtype == torch.float32 for w in w_plain.values())
    initial = initial_weights()
    assert any(not torch.equal(w_plain[n], initial[n]) for n in initial)
    for name in w_fsdp:
        assert torch.equal(w_plain[name], w_fsdp[name]), name
    assert len(m_plain) == len(m_fsdp) > 0
    assert all(torch.equal(a, b) for a, b in zip(m_plain, m_fsdp))
    assert metrics_plain == metrics_fsdp
    assert metrics_plain[0]["loss/kl"] != 0 and metrics_plain[1]["loss/grad_norm"] > MAX_NORM


def test_one_rank_trainer_takes_a_batch_without_episodes():
    """Nothing to learn from (every group filtered out, say): the step runs, reports a zero gradient
    norm and leaves the weights as they were."""
    with single_process_group():
        mesh = init_device_mesh("cpu", (1,))
        trainer = Trainer(build_model(), mesh, torch.device("cpu"), torch.float32, grpo_config(), optim_config(MAX_NORM),
                          total_steps=10, micro_batch_tokens=WHOLE, temperature=TEMPERATURE, max_new_tokens=8)
        metrics = trainer.train(make_batch().select(torch.zeros(0, dtype=torch.long)))
    assert metrics["loss/grad_norm"] == 0.0
    initial = initial_weights()
    assert all(torch.equal(p.detach(), initial[n]) for n, p in trainer.model.named_parameters())


def test_accumulate_sums_each_micro_batch_in_fp32_and_zeroes_what_none_reached():
    """Two backwards through the bf16 copy, each followed by accumulate(): a master's fp32 gradient
    is the first backward's bf16 gradient plus the second's, each cast to fp32 (a hand-derived
    sum), and a parameter neither reached has a zero gradient."""
    from model.mixed_precision import OneRankMixedPrecision

    mixed = OneRankMixedPrecision(build_model(), torch.bfloat16)
    mixed.prepare()
    mixed(torch.zeros(1, 2, dtype=torch.long))  # casts the masters into the copy
    norm, wq = mixed.compute.norm.weight, mixed.compute.layers[0].attention.wq.weight
    (3 * norm.float()).sum().backward()
    mixed.accumulate()
    (norm.float() ** 2).sum().add(wq.float().sum()).backward()
    expected_norm = torch.full_like(norm, 3).float() + (2 * norm.float()).to(torch.bfloat16).float()
    mixed.accumulate()
    masters = dict(mixed.master.named_parameters())
    assert torch.equal(masters["norm.weight"].grad, expected_norm)
    assert torch.equal(masters["layers.0.attention.wq.weight"].grad, torch.ones_like(wq, dtype=torch.float32))
    assert masters["layers.0.attention.wk.weight"].grad.count_nonzero() == 0
    assert all(p.grad.dtype == torch.float32 for p in mixed.master.parameters())
