"""Guard rails: the trainer skips non-finite updates on every rank alike (grpo/train/trainer.py), and the
engine halves its batch when it runs out of memory (grpo/engine/native.py).

Faults are injected from outside the code under test: a gradient hook that turns the policy's
log-prob gradients into NaN (finite loss, non-finite gradient norm), a wrapped `policy_loss` whose
value is NaN or inf while its gradient stays finite (non-finite loss only), and a wrapped
`_decode_steps` that raises torch.OutOfMemoryError for decode batches above a size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import grpo.train.trainer
from grpo.config import GRPOConfig, OptimizerConfig
from grpo.engine import GenerationOutOfMemory, GenerationRequest, NativeEngine, SamplingParams
from grpo.rollout.episode import EpisodeBatch
from grpo.train.loss import policy_loss
from grpo.train.trainer import Trainer
from model import Transformer
from tests.batches import hand_made_batch
from tests.dist_utils import one_thread, run_ranks, single_process_group
from tests.test_engine import EOS, make_engine, ref  # noqa: F401 (ref: a fixture)
from tests.trainer_setup import ADVANTAGES, COMPLETION_LENS, PROMPT_LENS, V, build_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


# ------------------------------------------------------------------------------------------ trainer


def make_batch() -> EpisodeBatch:
    """tests/test_trainer.py's 4 groups x 3 samples, with prompt indices 0..3."""
    return hand_made_batch(PROMPT_LENS, COMPLETION_LENS, ADVANTAGES, V, seed=5, first_prompt_index=0)


def groups_of(batch: EpisodeBatch, groups: list[int]) -> EpisodeBatch:
    return batch.select([i for i in range(len(batch)) if int(batch.prompt_index[i]) in groups])


def make_trainer(world: int = 1, minibatches: int = 1) -> Trainer:
    """A trainer over all ranks of the default group; collective."""
    model = build_model()
    optim = OptimizerConfig(lr=0.05, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.01, warmup_steps=0,
                            min_lr_ratio=0.1, max_grad_norm=1.0)
    grpo_cfg = GRPOConfig(group_size=3, minibatches=minibatches)
    return Trainer(model, init_device_mesh("cpu", (world,)), torch.device("cpu"), torch.float32, grpo_cfg, optim,
                   total_steps=10, micro_batch_tokens=12, temperature=0.7, max_new_tokens=8)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and every optimizer state tensor."""
    out = {}
    for name, param in trainer.model.named_parameters():
        out[name] = _local(param)
        for key, value in trainer.optimizer.state.get(param, {}).items():
            out[f"{name}/{key}"] = _local(value)
    return out


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def nan_gradients(forward: Callable) -> Callable:
    """Trainer._forward whose log-probs are unchanged but pass NaN gradients back to the policy."""

    def wrapped(rows, model=None):
        out = forward(rows, model)
        if out.logprobs.requires_grad:
            out.logprobs.register_hook(lambda grad: grad * float("nan"))
        return out

    return wrapped


def poisoned_loss(value: float, active: Callable[[], bool] = lambda: True) -> Callable:
    """policy_loss whose value gets `value` added while active(): the loss turns non-finite, its gradient does not."""

    def wrapped(*args, **kwargs):
        terms = policy_loss(*args, **kwargs)
        if active():
            terms.loss = terms.loss + value
        return terms

    return wrapped


def test_non_finite_gradient_skips_the_update_and_leaves_state_untouched():
    batch = make_batch()
    with single_process_group():
        trainer = make_trainer()
        first = trainer.train(batch)  # a normal step first, so that AdamW has state to protect
        assert first["train/skipped_updates"] == 0.0 and trainer.last_skip_reason == ""
        before = snapshot(trainer)
        assert any("exp_avg" in k for k in before)
        lr_epoch = trainer.scheduler.last_epoch

        original_forward = trainer._forward
        trainer._forward = nan_gradients(original_forward)
        metrics = trainer.train(batch)
        assert metrics["train/skipped_updates"] == 1.0
        assert trainer.last_skip_reason == "non-finite gradient norm (nan) in update 1 of 1"
        assert bitwise_equal(snapshot(trainer), before)
        assert all(p.grad is None for p in trainer.model.parameters())
        assert trainer.scheduler.last_epoch == lr_epoch + 1  # the schedule still advances
        # no applied update: nothing to average (the metrics logger drops NaN)
        assert math.isnan(metrics["loss/grad_norm"]) and math.isnan(metrics["loss/policy"])
        assert math.isfinite(metrics["loss/entropy"])

        trainer._forward = original_forward
        after = trainer.train(batch)
        assert after["train/skipped_updates"] == 0.0 and trainer.last_skip_reason == ""
        assert math.isfinite(after["loss/grad_norm"]) and math.isfinite(after["loss/policy"])
        changed = snapshot(trainer)
        assert not any(torch.equal(changed[k], before[k]) for k in before)


def _one_rank_nan_loss_worker(rank: int, world: int) -> dict:
    trainer = make_trainer(world)
    local = groups_of(make_batch(), [[0, 1], [2, 3]][rank])
    trainer.train(local)
    before = snapshot(trainer)
    with mock.patch("grpo.train.trainer.policy_loss", poisoned_loss(float("nan"), active=lambda: rank == 1)):
        metrics = trainer.train(local)
    return dict(skipped=metrics["train/skipped_updates"], reason=trainer.last_skip_reason,
                unchanged=bitwise_equal(snapshot(trainer), before), grad_norm=metrics["loss/grad_norm"])


def test_a_non_finite_loss_on_one_rank_skips_the_update_on_every_rank(tmp_path):
    # rank 1's loss is NaN but every gradient is finite: only the shared loss check makes rank 0 skip
    results = run_ranks(_one_rank_nan_loss_worker, 2, tmp_path, timeout_s=120.0)
    for rank, result in enumerate(results):
        assert result["skipped"] == 1.0, rank
        assert result["reason"] == "non-finite loss (nan) in update 1 of 1", rank
        assert result["unchanged"], f"rank {rank} changed weights or optimizer state"
        assert math.isnan(result["grad_norm"])


def test_only_the_faulty_minibatch_is_skipped(monkeypatch):
    batch = make_batch()
    with single_process_group():
        # reference: the first minibatch's update alone (groups 0 and 1, as the first of two minibatches)
        alone = make_trainer()
        want = alone.train(groups_of(batch, [0, 1]))
        want_weights = snapshot(alone)

        trainer = make_trainer(minibatches=2)
        start = snapshot(trainer)
        updates_begun = []
        update = trainer._update

        def counted_update(local_loss: float):
            updates_begun.append(local_loss)
            return update(local_loss)

        trainer._update = counted_update
        # the fault once the first update is done: in the second minibatch only
        poisoned = poisoned_loss(float("inf"), active=lambda: len(updates_begun) == 1)
        monkeypatch.setattr(grpo.train.trainer, "policy_loss", poisoned)
        metrics = trainer.train(batch)

    assert len(updates_begun) == 2
    assert metrics["train/skipped_updates"] == 1.0
    assert trainer.last_skip_reason == "non-finite loss (inf) in update 2 of 2"
    got = snapshot(trainer)
    assert not any(torch.equal(got[k], start[k]) for k in start)
    # the same start, micro-batches and single AdamW step (π_old recomputed equals π_θ detached): bitwise
    for name, want_tensor in want_weights.items():
        assert torch.equal(got[name], want_tensor), name
    # the applied update's loss and gradient norm only
    assert metrics["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-6)
    assert metrics["loss/grad_norm"] == pytest.approx(want["loss/grad_norm"], rel=1e-6)


# ------------------------------------------------------------------------------------------ engine


def engine_of(ref: Transformer, max_batch_size: int = 256) -> NativeEngine:
    return make_engine(ref, SamplingParams(max_new_tokens=8, temperature=1.0), seed=3, version=2,
                       max_batch_size=max_batch_size)


def make_requests() -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(1)
    out = []
    for prompt_index in range(4):
        prompt = torch.randint(0, EOS, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        out.extend(GenerationRequest(prompt, 5, prompt_index, s) for s in range(4))
    return out


def fail_above(engine: NativeEngine, limit: int) -> list[int]:
    """Make the engine's decode batches of more than `limit` sequences run out of memory; returns
    the batch sizes tried."""
    original = engine._decode_steps
    sizes: list[int] = []

    def decode_steps(slots: list[int], sp: SamplingParams, steps: int) -> None:
        sizes.append(len(slots))
        if len(slots) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        original(slots, sp, steps)

    engine._decode_steps = decode_steps
    return sizes


def test_out_of_memory_halves_the_batch_with_the_same_completions(ref, capsys):
    reqs = make_requests()
    engine = engine_of(ref)
    sizes = fail_above(engine, 5)
    got = engine.generate(reqs)
    assert sizes[:3] == [16, 8, 4] and max(sizes[3:]) == 4
    assert engine.max_batch_size == 4
    assert capsys.readouterr().err.splitlines() == [
        "generator: out of memory with 16 sequences at once; retrying with at most 8",
        "generator: out of memory with 8 sequences at once; retrying with at most 4",
    ]
    # bitwise the completions of a run limited to 4 sequences: no request lost, reordered or altered
    # by the restarts
    assert got == engine_of(ref, max_batch_size=4).generate(reqs)
    # and, batching not entering the sampling, those of the un-halved run (log-probs up to float
    # summation order, which the CPU's matmul kernels vary with the batch shape)
    whole = engine_of(ref).generate(reqs)
    assert [c.request for c in got] == reqs == [c.request for c in whole]
    assert [(c.tokens, c.finish_reason, c.version) for c in got] == [(c.tokens, c.finish_reason, c.version) for c in whole]
    for c, w in zip(got, whole):
        assert c.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    # the smaller limit stays: a later poll runs out of memory no more
    sizes.clear()
    assert engine.generate(reqs) == got and max(sizes) == 4
    assert capsys.readouterr().err == ""


def test_out_of_memory_on_a_single_request_is_an_error(ref, capsys):
    engine = engine_of(ref)
    sizes = fail_above(engine, 0)
    with pytest.raises(GenerationOutOfMemory, match=r"prompt of 5 tokens, max_new_tokens 8") as info:
        engine.generate([GenerationRequest([1, 2, 3, 4, 5], 0, 0, s) for s in range(3)])
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert sizes == [3, 1]
    assert capsys.readouterr().err.splitlines() == [
        "generator: out of memory with 3 sequences at once; retrying with at most 1"
    ]
