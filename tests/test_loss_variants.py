"""The loss family (grpo/train/loss.py policy_loss) against explicit formulas: the loop formula of
tests/loss_reference.py, whose autograd gives the formula's gradient, plus hand numbers. The loss
split over micro-batches and ranks is in test_loss_decomposition.py, the advantage options in
test_advantages.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from grpo.train.loss import LOSS_TYPES, LossSettings, Normalizers, policy_loss
from tests.loss_reference import grads, kl_term, reference_loss


def _call(t: dict, s: LossSettings, norm: Normalizers):
    return policy_loss(
        t["logprobs"], t["old"], t["gen"], t["ref"], t["entropy"], t["advantages"], t["mask"], t["seq_ids"], s, norm
    )


# ------------------------------------------------------------------------------------ the fixture

# Two rows of 10. Row 0 packs sequence 0 (A = +1.5) and sequence 1 (A = -0.8); row 1 holds sequence 2
# (an all-equal group: A = 0) and sequence 3 (truncated: mask 0 throughout), then padding (-1).
# Each position: (seq_id, mask, ratio π_θ/π_old, TIS weight π_old/π_gen). Masked positions carry wild
# ratios and gen = 0 (as the engine leaves them), which must not matter.
ROWS = [
    [
        (0, 0, 9.0, None),
        (0, 1, 1.1, 1.2),  # in the band
        (0, 1, 1.25, 2.0),  # inside the asymmetric [0.8, 1.28], above a symmetric 1.2
        (0, 1, 1.5, 0.9),  # above the band with A > 0: clipped, binding
        (0, 1, 0.5, 1.0),  # below the band with A > 0: free
        (1, 0, 0.1, None),
        (1, 1, 0.7, 0.5),  # below the band with A < 0: clipped, binding
        (1, 1, 3.5, 1.7),  # far above with A < 0: free, unless the dual clip (c = 3) binds
        (1, 1, 1.5, 1.1),  # above with A < 0: free (below c)
        (-1, 0, 20.0, None),
    ],
    [
        (2, 0, 0.2, None),
        (2, 1, 1.3, 1.0),
        (2, 1, 0.9, 3.0),
        (2, 1, 1.0, 0.8),
        (3, 0, 4.0, None),
        (3, 0, 0.3, None),
        (3, 0, 6.0, None),
        (-1, 0, 30.0, None),
        (-1, 0, 0.05, None),
        (-1, 0, 8.0, None),
    ],
]
SEQ_ADV = {0: 1.5, 1: -0.8, 2: 0.0, 3: 0.7, -1: 0.0}
# Pretend the rest of the minibatch lives elsewhere: normalisers are global, not this micro-batch's.
NORM = Normalizers(global_tokens=25.0, global_sequences=7.0, micro_batches=2, world_size=2)
BASE = LossSettings(clip_eps_low=0.2, clip_eps_high=0.28, max_new_tokens=12)


def fixture() -> dict:
    dtype = torch.float64
    shape = (len(ROWS), len(ROWS[0]))
    t = {k: torch.zeros(shape, dtype=dtype) for k in ("logprobs", "old", "gen", "ref", "entropy", "advantages", "mask")}
    t["seq_ids"] = torch.zeros(shape, dtype=torch.int64)
    for r, row in enumerate(ROWS):
        for c, (sid, m, ratio, w) in enumerate(row):
            k = r * shape[1] + c
            old = -0.3 - 0.17 * k
            t["old"][r, c] = old
            t["logprobs"][r, c] = old + math.log(ratio)
            t["gen"][r, c] = old - math.log(w) if m else 0.0
            t["ref"][r, c] = t["logprobs"][r, c] + 0.5 * math.sin(1.3 * k)
            t["entropy"][r, c] = 0.4 + 0.07 * k
            t["advantages"][r, c] = SEQ_ADV[sid]
            t["mask"][r, c] = float(m)
            t["seq_ids"][r, c] = sid
    t["logprobs"].requires_grad_(True)
    t["entropy"].requires_grad_(True)
    return t


def _check_against_reference(t: dict, s: LossSettings, norm: Normalizers):
    got = _call(t, s, norm)
    want = reference_loss(t, s, norm)
    assert float(got.loss.detach()) == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-14)
    got_lp, got_ent = grads(got.loss, [t["logprobs"], t["entropy"]])
    want_lp, want_ent = grads(want, [t["logprobs"], t["entropy"]])
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-12, atol=1e-14)
    return got, got_lp, got_ent


OPTIONS = {
    "base": {},
    "symmetric": dict(clip_eps_high=0.2),
    "dual_clip": dict(clip_ratio_c=3.0),
    "kl_k1": dict(kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": dict(kl_coef=0.1, kl_estimator="k2"),
    "kl_k3": dict(kl_coef=0.1, kl_estimator="k3"),
    "entropy": dict(entropy_coef=0.03),
    "tis_token_truncate": dict(tis_cap=1.5, tis_level="token", tis_mode="truncate"),
    "tis_token_mask": dict(tis_cap=1.5, tis_level="token", tis_mode="mask"),
    "tis_sequence_truncate": dict(tis_cap=1.5, tis_level="sequence", tis_mode="truncate"),
    "tis_sequence_mask": dict(tis_cap=1.5, tis_level="sequence", tis_mode="mask"),
    "everything": dict(clip_ratio_c=3.0, kl_coef=0.05, entropy_coef=0.02, tis_cap=1.5, tis_level="sequence"),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_match_loop_formula(loss_type: str, option: str):
    _check_against_reference(fixture(), replace(BASE, loss_type=loss_type, **OPTIONS[option]), NORM)


def test_masked_positions_get_no_gradient_and_do_not_matter():
    s = replace(BASE, loss_type="grpo", **OPTIONS["everything"])
    t = fixture()
    got, grad_lp, grad_ent = _check_against_reference(t, s, NORM)
    masked = t["mask"] == 0
    assert (grad_lp[masked] == 0).all() and (grad_ent[masked] == 0).all()
    # wilder values at masked positions change nothing
    t2 = fixture()
    with torch.no_grad():
        t2["logprobs"][masked] += 50.0
        t2["old"][masked] -= 50.0
        t2["ref"][masked] = 1e3
        t2["entropy"][masked] = 1e3
    assert float(_call(t2, s, NORM).loss.detach()) == pytest.approx(float(got.loss.detach()), rel=1e-12)


# ------------------------------------------------------------------------------------ hand numbers


def _one_sequence(ratios: list[float], adv: float):
    old = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64)
    lp = torch.log(torch.tensor([[1.0] + ratios], dtype=torch.float64)) + old
    lp.requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)
    return dict(
        logprobs=lp,
        old=old,
        gen=old.clone(),
        ref=None,
        entropy=torch.zeros_like(old),
        advantages=torch.full_like(old, adv),
        mask=mask,
        seq_ids=torch.zeros(1, 3, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    "loss_type, norm, loss, grad",
    [
        # ratios 1.0 and 1.5, A = 1, band [0.8, 1.2]: l = [-1.0, -1.2], sum -2.2; d l / d logprob = [-1, 0]
        ("dapo", Normalizers(5.0, 2.0, 1, 1), -2.2 / 5, [-1 / 5, 0.0]),
        ("grpo", Normalizers(5.0, 2.0, 1, 1), -2.2 / 2 / 2, [-1 / 4, 0.0]),
        ("dr_grpo", Normalizers(5.0, 2.0, 1, 1), -2.2 / (2 * 8), [-1 / 16, 0.0]),
        # bnpo: this micro-batch's token mean, / micro_batches 2, / world_size 2
        ("bnpo", Normalizers(5.0, 2.0, 2, 2), -2.2 / 2 / 4, [-1 / 8, 0.0]),
        # gspo: s = sqrt(1.5) = 1.2247 > 1 + 4e-4 with A > 0: clipped at 1.0004 for the sequence, no gradient
        ("gspo", Normalizers(5.0, 2.0, 1, 1), -1.0004 / 2, [0.0, 0.0]),
    ],
)
def test_hand_numbers(loss_type: str, norm: Normalizers, loss: float, grad: list[float]):
    t = _one_sequence([1.0, 1.5], 1.0)
    s = LossSettings(loss_type=loss_type, max_new_tokens=8)
    out = _call(t, s, norm)
    assert float(out.loss.detach()) == pytest.approx(loss, rel=1e-12)
    out.loss.backward()
    assert t["logprobs"].grad[0].tolist() == pytest.approx([0.0] + grad, abs=1e-12)


def test_gspo_gradient_by_hand_unclipped():
    # ratios 1.0001 and 0.9998 with A = -2: s = exp(mean log r) inside [1 - 3e-4, 1 + 4e-4], so
    # loss = -s A / G and d loss / d logprob_t = -A s / (n G) for each of the n = 2 tokens.
    t = _one_sequence([1.0001, 0.9998], -2.0)
    out = _call(t, LossSettings(loss_type="gspo"), Normalizers(9.0, 3.0, 1, 1))
    s = math.sqrt(1.0001 * 0.9998)
    assert float(out.loss.detach()) == pytest.approx(2 * s / 3, rel=1e-12)
    out.loss.backward()
    assert t["logprobs"].grad[0].tolist() == pytest.approx([0.0, 2 * s / 6, 2 * s / 6], rel=1e-12)
    assert float(out.stats["clipped"]) == 0.0
    assert float(out.stats["ratio_sum"]) == pytest.approx(2 * s, rel=1e-12)


def test_gspo_dual_clip_by_hand():
    # s = sqrt(4 * 5) = 4.47 > c = 3 with A = -1: the sequence loss is capped at c |A| = 3, no gradient;
    # both tokens count as clipped.
    t = _one_sequence([4.0, 5.0], -1.0)
    s = LossSettings(loss_type="gspo", clip_ratio_c=3.0)
    out = _call(t, s, Normalizers(2.0, 1.0, 1, 1))
    assert float(out.loss.detach()) == pytest.approx(3.0, rel=1e-12)
    out.loss.backward()
    assert t["logprobs"].grad.abs().max() == 0.0
    assert float(out.stats["clipped"]) == 2.0
    assert float(out.stats["ratio_max"]) == pytest.approx(math.sqrt(20.0), rel=1e-12)
    # without dual clip: |A| * s, gradient |A| s / n per token
    t = _one_sequence([4.0, 5.0], -1.0)
    out = _call(t, LossSettings(loss_type="gspo"), Normalizers(2.0, 1.0, 1, 1))
    assert float(out.loss.detach()) == pytest.approx(math.sqrt(20.0), rel=1e-12)
    out.loss.backward()
    assert t["logprobs"].grad[0, 1:].tolist() == pytest.approx([math.sqrt(20.0) / 2] * 2, rel=1e-12)


def test_dual_clip_token_by_hand():
    # r = 3.5 with A = -0.8 and c = 3: l = min(0.8 * 3.5, 3 * 0.8) = 2.4, no gradient; r = 1.5: l = 1.2, grad 1.2
    t = _one_sequence([3.5, 1.5], -0.8)
    out = _call(t, LossSettings(loss_type="dapo", clip_ratio_c=3.0), Normalizers(2.0, 1.0, 1, 1))
    assert float(out.loss.detach()) == pytest.approx((2.4 + 1.2) / 2, rel=1e-12)
    out.loss.backward()
    assert t["logprobs"].grad[0].tolist() == pytest.approx([0.0, 0.0, 1.2 / 2], rel=1e-12)
    assert float(out.stats["clipped"]) == 1.0


def test_entropy_bonus_gradient_by_hand():
    # dapo: d loss / d entropy_t = -entropy_coef / global_tokens on loss tokens, 0 elsewhere
    t = fixture()
    out = _call(t, replace(BASE, loss_type="dapo", entropy_coef=0.03), NORM)
    (grad,) = torch.autograd.grad(out.loss, [t["entropy"]])
    torch.testing.assert_close(grad, -0.03 / 25.0 * t["mask"], rtol=1e-12, atol=0)
    # grpo: -entropy_coef / (T_seq * global_sequences): T = 4, 3, 3 for sequences 0, 1, 2
    t = fixture()
    out = _call(t, replace(BASE, loss_type="grpo", entropy_coef=0.03), NORM)
    (grad,) = torch.autograd.grad(out.loss, [t["entropy"]])
    lens = {0: 4, 1: 3, 2: 3}
    want = torch.tensor(
        [[-0.03 / (lens[sid] * 7.0) if m else 0.0 for sid, m, _, _ in row] for row in ROWS], dtype=torch.float64
    )
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)


def test_kl_estimators_by_hand():
    # one token, δ = log π_ref - log π_θ = 0.5: k1 = -0.5, k2 = 0.125, k3 = e^0.5 - 1.5;
    # gradients w.r.t. log π_θ: k1: 1, k2: -δ = -0.5, k3: 1 - e^δ
    for estimator, value, grad in (
        ("k1", -0.5, 1.0),
        ("k2", 0.125, -0.5),
        ("k3", math.exp(0.5) - 1.5, 1 - math.exp(0.5)),
    ):
        t = _one_sequence([1.0, 1.0], 0.0)
        t["ref"] = t["logprobs"].detach() + 0.5
        out = _call(t, LossSettings(kl_coef=0.2, kl_estimator=estimator), Normalizers(2.0, 1.0, 1, 1))
        assert float(out.loss.detach()) == pytest.approx(0.2 * 2 * value / 2, rel=1e-12)
        assert float(out.stats["kl_sum"]) == pytest.approx(2 * value, rel=1e-12)
        out.loss.backward()
        assert t["logprobs"].grad[0, 1:].tolist() == pytest.approx([0.2 * grad / 2] * 2, rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_at_a_masked_position_with_a_huge_gap_keeps_the_gradient_finite(estimator: str):
    """fp32, as training runs: at the prompt position log π_ref - log π_θ = 100, where exp overflows.
    The penalty covers loss tokens only, so the gradient stays the hand value of the two loss tokens."""
    t = _one_sequence([1.0, 1.0], 0.0)
    t = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in t.items()}
    t["logprobs"] = t["logprobs"].detach().requires_grad_(True)
    ref = t["logprobs"].detach() + 0.5
    ref[0, 0] = t["logprobs"][0, 0].detach() + 100.0  # a prompt position: mask 0
    t["ref"] = ref
    out = _call(t, LossSettings(kl_coef=0.2, kl_estimator=estimator), Normalizers(2.0, 1.0, 1, 1))
    out.loss.backward()
    grad = t["logprobs"].grad
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    per_token = {"k1": 1.0, "k2": -0.5, "k3": 1 - math.exp(0.5)}[estimator]
    assert grad[0].tolist() == pytest.approx([0.0] + [0.2 * per_token / 2] * 2, rel=1e-5)


# ------------------------------------------------------------------------------------ stats


def _stats(option: str, loss_type: str = "dapo") -> dict[str, float]:
    out = _call(fixture(), replace(BASE, loss_type=loss_type, **OPTIONS[option]), NORM)
    assert all(not v.requires_grad and v.dim() == 0 for v in out.stats.values())
    return {k: float(v) for k, v in out.stats.items()}


def test_stats_base():
    st = _stats("base")
    assert st["tokens"] == 10.0
    assert st["sequences"] == 3.0  # sequence 3 carries no loss token
    assert st["clipped"] == 2.0  # 1.5 with A > 0, 0.7 with A < 0
    ratios = [1.1, 1.25, 1.5, 0.5, 0.7, 3.5, 1.5, 1.3, 0.9, 1.0]
    assert st["ratio_sum"] == pytest.approx(sum(ratios), rel=1e-12)
    assert st["ratio_max"] == pytest.approx(3.5, rel=1e-12)
    assert st["kl_sum"] == pytest.approx(_loop_kl_sum("k3"), rel=1e-12)  # reported even with kl_coef = 0
    assert st["entropy_sum"] == pytest.approx(_loop_masked_sum("entropy"), rel=1e-12)
    assert st["tis_clipped"] == 0.0
    assert st["tis_weight_sum"] == 10.0  # weight 1 per token when TIS is off


def test_stats_clip_variants():
    assert _stats("symmetric")["clipped"] == 3.0  # 1.25 now binds too
    assert _stats("dual_clip")["clipped"] == 3.0  # 3.5 > c with A < 0
    # gspo: s_0 = (1.1 * 1.25 * 1.5 * 0.5)^(1/4) > 1 + 4e-4 with A > 0 binds for its 4 tokens; s_1 is above
    # the band with A < 0 (free); A = 0 never binds
    st = _stats("base", "gspo")
    assert st["clipped"] == 4.0
    s0 = (1.1 * 1.25 * 1.5 * 0.5) ** 0.25
    s1 = (0.7 * 3.5 * 1.5) ** (1 / 3)
    s2 = (1.3 * 0.9 * 1.0) ** (1 / 3)
    assert st["ratio_sum"] == pytest.approx(4 * s0 + 3 * s1 + 3 * s2, rel=1e-12)
    assert st["ratio_max"] == pytest.approx(s1, rel=1e-12)


@pytest.mark.parametrize(
    "option, clipped, weight_sum",
    [
        # token weights 1.2 2.0 0.9 1.0 | 0.5 1.7 1.1 | 1.0 3.0 0.8, cap 1.5: three above it
        ("tis_token_truncate", 3.0, 1.2 + 1.5 + 0.9 + 1.0 + 0.5 + 1.5 + 1.1 + 1.0 + 1.5 + 0.8),
        ("tis_token_mask", 3.0, 7.0),
        # sequence weights 2.16 (4 tokens), 0.935 (3), 2.4 (3): sequences 0 and 2 above the cap
        ("tis_sequence_truncate", 7.0, 4 * 1.5 + 3 * 0.935 + 3 * 1.5),
        ("tis_sequence_mask", 7.0, 3.0),
    ],
)
def test_stats_tis(option: str, clipped: float, weight_sum: float):
    st = _stats(option)
    assert st["tis_clipped"] == clipped
    assert st["tis_weight_sum"] == pytest.approx(weight_sum, rel=1e-12)


def _loop_masked_sum(key: str) -> float:
    t = fixture()
    return sum(float(t[key][r, c].detach()) for r in range(2) for c in range(10) if t["mask"][r, c] == 1)


def _loop_kl_sum(estimator: str) -> float:
    t = fixture()
    return sum(
        float(kl_term(t["logprobs"][r, c].detach(), float(t["ref"][r, c]), estimator))
        for r in range(2)
        for c in range(10)
        if t["mask"][r, c] == 1
    )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_stats_kl(estimator: str):
    assert _stats(f"kl_{estimator}")["kl_sum"] == pytest.approx(_loop_kl_sum(estimator), rel=1e-12)


def test_stats_without_reference():
    t = fixture()
    t["ref"] = None
    out = _call(t, BASE, NORM)
    assert float(out.stats["kl_sum"]) == 0.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        _call(t, replace(BASE, kl_coef=0.1), NORM)


@pytest.mark.parametrize(
    "field, value",
    [
        ("loss_type", "ppo"),
        ("kl_estimator", "k4"),
        ("tis_level", "batch"),
        ("tis_mode", "drop"),
        ("clip_ratio_c", 1.0),
        ("clip_ratio_c", 0.5),
        ("tis_cap", -1.0),
        ("max_new_tokens", 0),
    ],
)
def test_settings_refuse_bad_values(field: str, value):
    with pytest.raises(ValueError, match=field):
        LossSettings(**{field: value})
