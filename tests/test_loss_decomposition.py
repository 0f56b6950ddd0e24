"""The loss split over micro-batches and ranks adds up to the loss of the whole minibatch: each
micro-batch's share (grpo/train/loss.py policy_loss) with the minibatch's global normalisers, summed
over micro-batches and averaged over ranks as FSDP does, against one call on everything and against
the loop formula of tests/loss_reference.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from grpo.train.loss import LossSettings, Normalizers, policy_loss
from tests.loss_reference import grads, loss_kwargs, reference_loss

WORLD, MICRO = 2, 2


def _random_sequences(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        length = int(torch.randint(3, 10, (1,), generator=g))
        prompt = int(torch.randint(1, 3, (1,), generator=g))
        old = -torch.rand(length, generator=g, dtype=torch.float64) * 2 - 0.1
        seqs.append(
            dict(
                logprobs=(old + (torch.rand(length, generator=g, dtype=torch.float64) - 0.5)).requires_grad_(True),
                old=old,
                gen=old - (torch.rand(length, generator=g, dtype=torch.float64) - 0.5) * 1.5,
                ref=old + (torch.rand(length, generator=g, dtype=torch.float64) - 0.5),
                entropy=torch.rand(length, generator=g, dtype=torch.float64).requires_grad_(True),
                # sequence 3 is truncated and masked out entirely
                mask=torch.tensor([0.0] * prompt + [0.0 if i == 3 else 1.0] * (length - prompt), dtype=torch.float64),
                advantage=float(torch.randn(1, generator=g, dtype=torch.float64)) if i % 4 else 0.0,
            )
        )
    return seqs


def _pack(seqs: list[dict]) -> dict:
    """Two sequences per row, right-padded; built with torch.cat so gradients reach each sequence's leaves."""
    rows = [seqs[i : i + 2] for i in range(0, len(seqs), 2)]
    width = max(sum(len(s["mask"]) for s in row) for row in rows)
    t: dict[str, list] = {k: [] for k in ("logprobs", "old", "gen", "ref", "entropy", "mask", "advantages", "seq_ids")}
    for r, row in enumerate(rows):
        pad = width - sum(len(s["mask"]) for s in row)
        zeros = torch.zeros(pad, dtype=torch.float64)
        for k in ("logprobs", "old", "gen", "ref", "entropy", "mask"):
            t[k].append(torch.cat([s[k] for s in row] + [zeros]))
        t["advantages"].append(torch.cat([torch.full_like(s["mask"], s["advantage"]) for s in row] + [zeros]))
        ids = [torch.full((len(s["mask"]),), 2 * r + j, dtype=torch.int64) for j, s in enumerate(row)]
        t["seq_ids"].append(torch.cat(ids + [torch.full((pad,), -1, dtype=torch.int64)]))
    return {k: torch.stack(v) for k, v in t.items()}


def _global_norm(seqs: list[dict]) -> Normalizers:
    tokens = sum(float(s["mask"].sum()) for s in seqs)
    sequences = sum(1.0 for s in seqs if s["mask"].sum() > 0)
    return Normalizers(tokens, sequences, MICRO, WORLD)


def _parts(seqs: list[dict]) -> list[list[dict]]:
    # rank 0: micro-batches of 3 and 2 sequences; rank 1: 4 and 3 (uneven on purpose)
    return [seqs[0:3], seqs[3:5], seqs[5:9], seqs[9:12]]


DECOMPOSITION_SETTINGS = {
    "plain": {},
    "everything_token": dict(clip_ratio_c=3.0, kl_coef=0.05, entropy_coef=0.02, tis_cap=1.3),
    "everything_sequence": dict(
        clip_ratio_c=3.0, kl_coef=0.05, kl_estimator="k2", entropy_coef=0.02, tis_cap=1.3, tis_level="sequence"
    ),
}


@pytest.mark.parametrize("option", list(DECOMPOSITION_SETTINGS))
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_split_over_micro_batches_and_ranks_equals_whole(loss_type: str, option: str):
    seqs = _random_sequences(12, seed=7)
    s = LossSettings(
        loss_type=loss_type,
        clip_eps_high=0.28,
        # wide enough that some gspo sequences sit inside the band
        gspo_clip_eps_low=0.1,
        gspo_clip_eps_high=0.1,
        max_new_tokens=9,
        **DECOMPOSITION_SETTINGS[option],
    )
    norm = _global_norm(seqs)
    leaves = [s_["logprobs"] for s_ in seqs] + [s_["entropy"] for s_ in seqs]

    whole = policy_loss(**loss_kwargs(_pack(seqs)), settings=s, norm=replace(norm, micro_batches=1, world_size=1))
    # each rank scales its shares by world_size; FSDP averages the ranks' gradients
    split = sum(policy_loss(**loss_kwargs(_pack(p)), settings=s, norm=norm).loss * WORLD for p in _parts(seqs)) / WORLD
    assert float(split.detach()) == pytest.approx(float(whole.loss.detach()), rel=1e-12)
    for got, want in zip(grads(split, leaves), grads(whole.loss, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    # the loop formula agrees with the whole batch too
    assert float(reference_loss(_pack(seqs), s, norm).detach()) == pytest.approx(float(whole.loss.detach()), rel=1e-12)


def test_bnpo_is_the_mean_of_micro_batch_token_means():
    seqs = _random_sequences(12, seed=11)
    s = LossSettings(loss_type="bnpo", entropy_coef=0.01, kl_coef=0.02)
    norm = _global_norm(seqs)
    shares = sum(policy_loss(**loss_kwargs(_pack(p)), settings=s, norm=norm).loss for p in _parts(seqs))
    # token mean of each micro-batch (dapo with its own token count), averaged over the 4 micro-batches
    means = [
        reference_loss(_pack(p), replace(s, loss_type="dapo"), _global_norm(p))
        for p in _parts(seqs)
    ]
    want = sum(means) / (MICRO * WORLD)
    assert float(shares.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    leaves = [s_["logprobs"] for s_ in seqs]
    for got, w in zip(grads(shares, leaves), grads(want, leaves)):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-15)
