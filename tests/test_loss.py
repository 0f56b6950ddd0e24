"""GRPO loss family (grpo/train/loss.py) and group advantages (grpo/rollout/advantages.py) against hand-derived numbers
and explicit per-token loops in plain Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.rollout.advantages import ADVANTAGE_STD_EPS, compute_advantages
from grpo.train.loss import SurrogateTerms, _surrogate

# ------------------------------------------------------------------------------------ group advantages


def clipped_surrogate(logprobs, old_logprobs, advantages, eps_low: float, eps_high: float) -> SurrogateTerms:
    """The plain PPO clip (no dual clip), r = π_θ / π_old."""
    return _surrogate(logprobs - old_logprobs, advantages, eps_low, eps_high, 0.0)


def _advantages_by_hand(rewards: list[float], group_size: int, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out.extend((r - mean) / (std + eps) for r in group)
    return out


def test_group_advantages_hand_numbers():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = compute_advantages(rewards, group_size=4)
    # group 1: mean 0.25; unbiased std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.25) = 0.5
    denom = 0.5 + ADVANTAGE_STD_EPS
    expected = [0.75 / denom, -0.25 / denom, -0.25 / denom, -0.25 / denom]
    assert adv.shape == (8,)
    for got, want in zip(adv[:4].tolist(), expected):
        assert got == pytest.approx(want, rel=1e-6)
    # an all-equal group gets exactly zero advantages (no 0 / 0)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    # zero mean within each group
    assert abs(float(adv[:4].sum())) < 1e-6


def test_group_advantages_matches_loop_formula():
    rewards = [0.3, 1.7, -0.4, 2.2, 0.0, 0.9, 0.9, 5.0, -1.0]
    adv = compute_advantages(torch.tensor(rewards, dtype=torch.float32), group_size=3)
    expected = _advantages_by_hand(rewards, 3, ADVANTAGE_STD_EPS)
    for got, want in zip(adv.tolist(), expected):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the eps argument is the one used
    adv_eps = compute_advantages(torch.tensor(rewards), group_size=3, eps=0.5)
    for got, want in zip(adv_eps.tolist(), _advantages_by_hand(rewards, 3, 0.5)):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_group_advantages_group_size_two():
    # two rewards a, b: mean (a+b)/2, unbiased std |a-b|/sqrt(2): advantages +-1/sqrt(2) (minus eps)
    adv = compute_advantages(torch.tensor([3.0, 1.0, 0.0, 4.0]), group_size=2, eps=0.0)
    s = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([s, -s, -s, s], rel=1e-6)


# ------------------------------------------------------------------------------------ clipped surrogate

EPS_LOW, EPS_HIGH = 0.2, 0.3  # asymmetric band [0.8, 1.3]

# (ratio, advantage, which branch binds) — one token each
CASES = [
    (1.0, 1.5, "in"),  # at 1, inside
    (1.1, 2.0, "in"),  # inside, A > 0
    (0.9, -1.0, "in"),  # inside, A < 0
    (1.25, -0.5, "in"),  # inside the asymmetric band (would be outside a symmetric 0.2 band)
    (1.5, 2.0, "clip"),  # above band, A > 0: clipped and binding
    (1.5, -2.0, "free"),  # above band, A < 0: unclipped r*A is smaller: gradient flows
    (0.5, -1.0, "clip"),  # below band, A < 0: clipped and binding
    (0.5, 1.0, "free"),  # below band, A > 0: unclipped r*A is smaller: gradient flows
    (0.79, -3.0, "clip"),  # just below 1 - eps_low
    (1.31, 0.7, "clip"),  # just above 1 + eps_high
    (2.0, 0.0, "free"),  # zero advantage: zero loss, zero gradient
]


def _loop_loss(r: float, a: float) -> float:
    clipped_r = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
    return -min(r * a, clipped_r * a)


def _loop_grad(r: float, a: float) -> float:
    """d loss / d logprob, with r = exp(logprob - old): -r*A unless the clipped branch binds."""
    binding = (a > 0 and r > 1 + EPS_HIGH) or (a < 0 and r < 1 - EPS_LOW)
    return 0.0 if binding else -r * a


def _tensors():
    ratios = [c[0] for c in CASES]
    advs = [c[1] for c in CASES]
    old = torch.linspace(-3.0, -0.5, len(CASES), dtype=torch.float64)
    logprobs = (old + torch.log(torch.tensor(ratios, dtype=torch.float64))).requires_grad_(True)
    return logprobs, old, torch.tensor(advs, dtype=torch.float64), ratios, advs


def test_clipped_surrogate_per_token_loss_and_ratio():
    logprobs, old, adv, ratios, advs = _tensors()
    terms = clipped_surrogate(logprobs[None], old[None], adv[None], EPS_LOW, EPS_HIGH)
    assert terms.loss.shape == (1, len(CASES))
    for j, (r, a) in enumerate(zip(ratios, advs)):
        assert float(terms.loss.detach()[0, j]) == pytest.approx(_loop_loss(r, a), rel=1e-12, abs=1e-12), CASES[j]
        assert float(terms.ratio[0, j]) == pytest.approx(r, rel=1e-12)
    assert not terms.ratio.requires_grad


def test_clipped_surrogate_gradient_matches_hand_derivative():
    logprobs, old, adv, ratios, advs = _tensors()
    terms = clipped_surrogate(logprobs[None], old[None], adv[None], EPS_LOW, EPS_HIGH)
    terms.loss.sum().backward()
    for j, (r, a) in enumerate(zip(ratios, advs)):
        assert float(logprobs.grad[j]) == pytest.approx(_loop_grad(r, a), rel=1e-12, abs=1e-12), CASES[j]
    # the band edges: some tokens really are cut off, others really flow
    assert sum(1 for c in CASES if c[2] == "clip") == 4
    assert all(float(logprobs.grad[j]) == 0.0 for j, c in enumerate(CASES) if c[2] == "clip")
    assert all(float(logprobs.grad[j]) != 0.0 for j, c in enumerate(CASES) if c[1] != 0.0 and c[2] != "clip")


def test_clipped_flag_marks_binding_clip_only():
    logprobs, old, adv, ratios, advs = _tensors()
    terms = clipped_surrogate(logprobs[None], old[None], adv[None], EPS_LOW, EPS_HIGH)
    expected = [c[2] == "clip" for c in CASES]
    assert terms.clipped.dtype == torch.bool
    assert terms.clipped[0].tolist() == expected


def test_clipped_surrogate_asymmetric_band():
    # r = 1.25 with A > 0: inside [0.8, 1.3] (unclipped) but outside a symmetric [0.8, 1.2]
    old = torch.zeros(1, 1, dtype=torch.float64)
    lp = torch.full((1, 1), math.log(1.25), dtype=torch.float64, requires_grad=True)
    a = torch.ones(1, 1, dtype=torch.float64)
    asym = clipped_surrogate(lp, old, a, 0.2, 0.3)
    asym.loss.sum().backward()
    assert float(asym.loss.detach()) == pytest.approx(-1.25)
    assert float(lp.grad) == pytest.approx(-1.25)
    assert not bool(asym.clipped)
    lp.grad = None
    sym = clipped_surrogate(lp, old, a, 0.2, 0.2)
    sym.loss.sum().backward()
    assert float(sym.loss.detach()) == pytest.approx(-1.2)
    assert float(lp.grad) == 0.0
    assert bool(sym.clipped)
    # r = 0.75, A < 0: below a low band of 0.2 (clipped at 0.8) but inside a low band of 0.3
    lp2 = torch.full((1, 1), math.log(0.75), dtype=torch.float64)
    neg = -a
    assert float(clipped_surrogate(lp2, old, neg, 0.2, 0.3).loss) == pytest.approx(0.8)
    assert float(clipped_surrogate(lp2, old, neg, 0.3, 0.2).loss) == pytest.approx(0.75)


def test_clipped_surrogate_broadcasts_sequence_advantages():
    # advantages [B, 1] broadcast over the tokens of each sequence
    old = torch.zeros(2, 3)
    lp = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]]))
    adv = torch.tensor([[2.0], [-1.0]])
    terms = clipped_surrogate(lp, old, adv, 0.2, 0.2)
    expected = [[_loss_sym(r, a) for r in (1.0, 1.5, 0.5)] for a in (2.0, -1.0)]
    torch.testing.assert_close(terms.loss, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def _loss_sym(r: float, a: float) -> float:
    return -min(r * a, min(max(r, 0.8), 1.2) * a)
