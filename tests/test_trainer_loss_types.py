"""Trainer.train is split-invariant for every token/sequence-normalised loss type (grpo/train/trainer.py).

For loss_type in grpo, dapo, dr_grpo and gspo, a fixed batch is trained (fp32) as
  (a) the whole batch in one micro-batch, one process (1-rank gloo mesh),
  (b) several micro-batches (micro_batch_tokens=12), one process,
  (c) 2 gloo ranks, rank 0 holding groups {0, 1, 2} and rank 1 group {3} (uneven token counts and
      micro-batch counts: rank 1 pads with empty micro-batches), micro_batch_tokens=12,
and the gradient of every optimizer step (recorded by a Trainer subclass just before the step) and
the final weights must agree to 1e-6. Each loss type runs in two settings: one update on the batch
(π_old = π_θ, ratios exactly 1), and 2 iterations x 2 minibatches (4 optimizer steps, ratios move
away from 1, the clip binds on some tokens / sequences and π_old is held fixed over the updates);
gspo also with a tight sequence clip (0.05) that zeroes one update's gradient entirely.

The optimizer is AdamW with betas (0, 0), eps = 1 and no weight decay, warmup or gradient clipping:
the update is lr * g / (|g| + 1), close to linear in g, so a gradient error shows in the weights
(AdamW's usual first step, nearly sign(g), would hide it). bnpo is left out: its loss is defined
per micro-batch and rank, so it is not split-invariant by design (grpo/train/loss.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.rollout.episode import EpisodeBatch
from grpo.train.packing import pack_episodes
from grpo.train.trainer import Trainer
from model import ModelArgs, Transformer
from tests.batches import hand_made_batch
from tests.dist_utils import abandon_group, one_thread, run_ranks, single_process_group

V = 40
ARGS = ModelArgs(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
LR = 0.005  # small enough that no minibatch has all its tokens clipped (a zero gradient) by its second pass
MAX_NEW_TOKENS = 8
ATOL = 1e-6

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")
# setting -> (num_iterations, minibatches, gspo's clip eps on the sequence ratio). With eps 0.2 gspo's
# clip binds on some sequences, never on all of a minibatch's; with 0.05 it binds on all three sequences of group 0
# (the only ones with a non-zero advantage in minibatch 0) at their second pass: a zero gradient there.
SETTINGS = {"one_update": (1, 1, 0.2), "iters2_mb2": (2, 2, 0.2), "iters2_mb2_tight": (2, 2, 0.05)}
CASES = [(loss_type, setting) for loss_type in LOSS_TYPES for setting in ("one_update", "iters2_mb2")]
CASES.append(("gspo", "iters2_mb2_tight"))

# 4 groups x 3 samples: prompt lengths per group, completion lengths per episode (uneven), advantages
# (positive and negative; group 1 all zero, as for a group whose rewards are all equal)
PROMPT_LENS = [3, 5, 2, 4]
COMPLETION_LENS = [[2, 1, 3], [4, 2, 6], [7, 5, 3], [1, 6, 2]]
ADVANTAGES = [[1.2, -0.4, -0.8], [0.0, 0.0, 0.0], [-1.1, 0.3, 0.8], [0.5, 1.3, -1.8]]
# rank -> groups in (c): 33 completion tokens / 9 episodes on rank 0, 9 tokens / 3 episodes on rank 1
RANK_GROUPS = [[0, 1, 2], [3]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def make_batch() -> EpisodeBatch:
    """12 episodes, group by group, right-padded with random ids (which must be ignored)."""
    return hand_made_batch(PROMPT_LENS, COMPLETION_LENS, ADVANTAGES, V, seed=2024, first_prompt_index=20)


def episodes_of(batch: EpisodeBatch, groups: list[int]) -> list[int]:
    return [i for i in range(len(batch)) if int(batch.prompt_index[i]) - 20 in groups]


def build_model() -> Transformer:
    torch.manual_seed(11)
    model = Transformer(ARGS, dtype=torch.float32)
    model.init_weights(std=0.1)
    return model


def optim_config() -> OptimizerConfig:
    return OptimizerConfig(lr=LR, betas=[0.0, 0.0], eps=1.0, weight_decay=0.0, warmup_steps=0,
                           min_lr_ratio=1.0, max_grad_norm=0.0)


def grpo_config(loss_type: str, setting: str) -> GRPOConfig:
    num_iterations, minibatches, gspo_clip = SETTINGS[setting]
    return GRPOConfig(group_size=3, loss_type=loss_type, num_iterations=num_iterations, minibatches=minibatches,
                      clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH,
                      gspo_clip_eps_low=gspo_clip, gspo_clip_eps_high=gspo_clip)


class RecordingTrainer(Trainer):
    """Records the full (reduced) gradient of every parameter just before each optimizer step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grads: list[dict[str, torch.Tensor]] = []

    def _optimizer_step(self) -> float:
        step = {}
        for name, param in self.model.named_parameters():
            grad = param.grad
            if grad is None:
                grad = torch.zeros_like(param)
            step[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
        self.grads.append(step)
        return super()._optimizer_step()


def run_trainer(batch: EpisodeBatch, world: int, micro_batch_tokens: int, loss_type: str, setting: str) -> dict:
    """Trainer.train on this rank's part of the batch. Collective (on the default group)."""
    mesh = init_device_mesh("cpu", (world,))
    trainer = RecordingTrainer(build_model(), mesh, torch.device("cpu"), torch.float32, grpo_config(loss_type, setting),
                               optim_config(), total_steps=10, micro_batch_tokens=micro_batch_tokens,
                               temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS)
    metrics = trainer.train(batch)
    weights = {}
    for name, param in trainer.model.named_parameters():
        weights[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
    return dict(grads=trainer.grads, weights=weights, metrics=metrics)


def _dist_worker(rank: int, world: int) -> dict:
    batch = make_batch()
    local = batch.select(episodes_of(batch, RANK_GROUPS[rank]))
    results = {}
    for case in CASES:
        try:
            results[case] = run_trainer(local, world, 12, *case)
        except Exception as exc:  # recorded; the test of that case reports it
            results[case] = f"{type(exc).__name__}: {exc}"
            abandon_group()
            break
    return results


@pytest.fixture(scope="module")
def single() -> dict:
    """(loss_type, setting, micro_batch_tokens) -> result of a one-process run on the whole batch."""
    batch = make_batch()
    out = {}
    with single_process_group():
        for case in CASES:
            for mbs in (1000, 12):
                out[(*case, mbs)] = run_trainer(batch, 1, mbs, *case)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_dist_worker, 2, tmp_path_factory.mktemp("trainer_loss_types"), timeout_s=240.0)


def rank_result(rank_results: dict, case: tuple) -> dict:
    result = rank_results.get(case, "not run: an earlier case broke the process group")
    if isinstance(result, str):
        pytest.fail(f"2-rank case {case!r} failed: {result}")
    return result


def assert_close(got: dict, want: dict, what: str):
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=ATOL, rtol=0, msg=lambda m: f"{what} {name}: {m}")


def assert_same_run(got: dict, want: dict):
    assert len(got["grads"]) == len(want["grads"])
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        assert_close(g, w, f"gradient of step {step}:")
    assert_close(got["weights"], want["weights"], "weights:")


def max_abs(tensors: dict) -> float:
    return max(float(t.abs().max()) for t in tensors.values())


@pytest.mark.parametrize("loss_type,setting", CASES)
def test_whole_batch_run_is_non_trivial(single, loss_type: str, setting: str):
    """The reference run (a): gradients far above the tolerance, and the clip really in play."""
    whole = single[(loss_type, setting, 1000)]
    iterations, minibatches, _ = SETTINGS[setting]
    sizes = [max_abs(grads) for grads in whole["grads"]]
    assert len(sizes) == iterations * minibatches
    if setting == "iters2_mb2_tight":
        # minibatch 0's second pass: every sequence with A != 0 clipped, so nothing to follow
        assert sizes[2] == 0.0 and min(sizes[:2] + sizes[3:]) > 1000 * ATOL
    else:
        assert min(sizes) > 1000 * ATOL
    # the weights move by lr * g / (|g| + 1): far less than g at LR, so the gradients are the sharper check
    initial = {n: p.detach() for n, p in build_model().named_parameters()}
    assert max_abs({n: whole["weights"][n] - initial[n] for n in initial}) > 100 * ATOL
    metrics = whole["metrics"]
    if setting == "one_update":
        assert metrics["loss/ratio_mean"] == 1.0 and metrics["loss/clip_frac"] == 0.0
    else:
        # ratios move away from 1 and the clip binds on part of the tokens (gspo: of the sequences)
        assert metrics["loss/ratio_max"] > 1.2
        assert 0.0 < metrics["loss/clip_frac"] < 0.5


@pytest.mark.parametrize("setting", ["one_update", "iters2_mb2"])
def test_loss_types_give_different_gradients(single, setting: str):
    """The loss type is really in effect (else the comparisons below would test one loss four times)."""

    def grad_diff(a: str, b: str, step: int) -> float:
        ga, gb = single[(a, setting, 1000)]["grads"][step], single[(b, setting, 1000)]["grads"][step]
        return max(float((ga[n] - gb[n]).abs().max()) for n in ga)

    for i, a in enumerate(LOSS_TYPES):
        for b in LOSS_TYPES[i + 1 :]:
            if {a, b} == {"grpo", "gspo"}:
                # at the first update (π_old = π_θ) gspo's gradient is grpo's: s_i = 1 and
                # ∇s_i = mean_t ∇log π_t; they part once the ratios move
                assert grad_diff(a, b, 0) < ATOL
                if setting == "iters2_mb2":
                    assert grad_diff(a, b, 1) > 100 * ATOL
            else:
                assert grad_diff(a, b, 0) > 100 * ATOL, (a, b)


@pytest.mark.parametrize("loss_type,setting", CASES)
def test_micro_batches_match_whole_batch(single, loss_type: str, setting: str):
    assert_same_run(single[(loss_type, setting, 12)], single[(loss_type, setting, 1000)])


@pytest.mark.parametrize("loss_type,setting", CASES)
def test_two_ranks_match_whole_batch(single, two_ranks, loss_type: str, setting: str):
    want = single[(loss_type, setting, 1000)]
    for rank_results in two_ranks:
        got = rank_result(rank_results, (loss_type, setting))
        assert_same_run(got, want)
        for key in ("loss/policy", "loss/clip_frac", "loss/ratio_mean", "loss/ratio_max", "loss/grad_norm"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7), key


def test_mask_truncated_removes_loss_tokens_of_cut_completions():
    batch = make_batch()
    batch.truncated = torch.zeros(len(batch), dtype=torch.bool)
    batch.truncated[[1, 4]] = True
    plain, masked = pack_episodes(batch), pack_episodes(batch, mask_truncated=True)
    for i in range(len(batch)):
        tokens_of_i = plain.doc_ids == i
        expected = 0.0 if i in (1, 4) else float(plain.loss_mask[tokens_of_i].sum())
        assert float(masked.loss_mask[tokens_of_i].sum()) == expected
        assert float(plain.loss_mask[tokens_of_i].sum()) == int(batch.completion_lens[i])
