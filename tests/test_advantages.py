"""The advantage options (grpo/rollout/advantages.py) against hand numbers: baselines, scales, the
overlong penalty and the zero-variance filter."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.rollout.advantages import compute_advantages, overlong_penalty, zero_variance_groups

# Three groups of G = 4: [1, 0, 0, 0] (mean 0.25, unbiased std 0.5); [2, 2, 2, 2] (all equal);
# [3, 1, 2, 0] (mean 1.5, unbiased std sqrt(5/3)).
REWARDS = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0, 0.0]
MEAN_CENTRED = [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, 1.5, -0.5, 0.5, -1.5]
# r_i minus the mean of the other three: 1 - 0, 0 - 1/3 ...; 3 - 1, 1 - 5/3, 2 - 4/3, 0 - 2
LEAVE_ONE_OUT = [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0, 2.0, -2 / 3, 2 / 3, -2.0]
GROUP_STD = [0.5] * 4 + [0.0] * 4 + [math.sqrt(5 / 3)] * 4


@pytest.mark.parametrize("baseline, centred", [("mean", MEAN_CENTRED), ("leave_one_out", LEAVE_ONE_OUT)])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_hand_numbers(baseline: str, centred: list[float], scale: str):
    eps = 0.01
    adv = compute_advantages(torch.tensor(REWARDS), 4, baseline=baseline, scale=scale, batch_std=2.0, eps=eps)
    divisor = {"group": [sd + eps for sd in GROUP_STD], "batch": [2.0 + eps] * 12, "none": [1.0] * 12}[scale]
    assert adv.shape == (12,) and adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([c / d for c, d in zip(centred, divisor)], rel=1e-6, abs=1e-7)


def test_advantages_batch_scale_needs_batch_std():
    with pytest.raises(ValueError, match="batch_std"):
        compute_advantages(torch.tensor(REWARDS), 4, scale="batch")


def test_advantages_refuse_unknown_options():
    with pytest.raises(ValueError, match="baseline"):
        compute_advantages(torch.tensor(REWARDS), 4, baseline="median")
    with pytest.raises(ValueError, match="scale"):
        compute_advantages(torch.tensor(REWARDS), 4, scale="rank")


def test_overlong_penalty_hand_numbers():
    # max_new_tokens 10, buffer 4: free up to 6 tokens, then -0.5 * (L - 6) / 4 up to 10
    lens = torch.tensor([3, 6, 7, 9, 10, 12])
    got = overlong_penalty(lens, max_new_tokens=10, buffer=4, penalty=0.5)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.375, -0.5, -0.5])
    assert overlong_penalty(lens, 10, 4).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    assert overlong_penalty(lens, 10, 0).tolist() == [0.0] * 6
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lens, 10, 11)


def test_zero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.5, 0.5, 0.6])
    assert zero_variance_groups(rewards, 3).tolist() == [True, False, True, False]
    assert zero_variance_groups(torch.zeros(4), 2).tolist() == [True, True]
