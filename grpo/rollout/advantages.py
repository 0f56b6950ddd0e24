"""Group-relative advantages from the rewards of a batch of episodes: DAPO's overlong penalty, the
group's baseline and scale, and the filter of groups whose rewards are all equal."""

from __future__ import annotations

import math
import typing

import torch
import torch.distributed as dist

from grpo.config.sections import Baseline, GRPOConfig, RewardScaling
from grpo.distributed.collectives import all_reduce
from grpo.rollout.episode import EpisodeBatch

# Added to the group's standard deviation so that a group whose rewards are all equal gets zero
# advantages instead of 0 / 0.
ADVANTAGE_STD_EPS = 1e-4

# Advantage options (compute_advantages): what is subtracted from a reward, and what divides the difference.
SCALE_REWARDS = typing.get_args(RewardScaling)
BASELINES = typing.get_args(Baseline)


def training_advantages(
    episodes: EpisodeBatch, grpo: GRPOConfig, max_new_tokens: int, group: dist.ProcessGroup | None
) -> tuple[EpisodeBatch, int]:
    """The overlong penalty, advantages and the zero-variance filter on a trainer's scored episodes,
    as `grpo` sets them: the episodes to train on, and how many groups were dropped here. With
    grpo.scale_rewards = "batch", collective over the trainer ranks' `group` (the batch's std)."""
    G = grpo.group_size
    if grpo.overlong_buffer:
        penalty = overlong_penalty(episodes.completion_lens, max_new_tokens, grpo.overlong_buffer, grpo.overlong_penalty)
        episodes.rewards = episodes.rewards + penalty
    batch_std = None
    if grpo.scale_rewards == "batch":
        r = episodes.rewards.double()
        s = all_reduce({"n": float(len(r)), "sum": float(r.sum()), "sq": float((r * r).sum())}, group)
        mean = s["sum"] / max(s["n"], 1.0)
        batch_std = math.sqrt(max(s["sq"] - s["n"] * mean * mean, 0.0) / max(s["n"] - 1, 1.0))
    episodes.advantages = compute_advantages(episodes.rewards, G, grpo.baseline, grpo.scale_rewards, batch_std)
    if not grpo.filter_zero_variance:
        return episodes, 0
    flat = zero_variance_groups(episodes.rewards, G)
    keep = (~flat).repeat_interleave(G).nonzero().flatten()
    return episodes.select(keep), int(flat.sum())


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    baseline: str = "mean",
    scale: str = "group",
    batch_std: float | None = None,
    eps: float = ADVANTAGE_STD_EPS,
) -> torch.Tensor:
    """Advantages [N] for rewards [N] laid out group by group (G = group_size).

    baseline "mean": A_i = r_i - mean(group) (GRPO, Shao et al. 2024); "leave_one_out":
    A_i = r_i - mean of the other G - 1 rewards = G / (G - 1) · (r_i - mean(group)) (RLOO,
    Ahmadian et al. 2024). scale "group": divide by (unbiased std of the group + eps); "batch": by
    (batch_std + eps), batch_std being the unbiased std of the whole batch's rewards over all ranks,
    which only the caller can compute; "none": no division (Dr. GRPO, Liu et al. 2025).
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale must be one of {SCALE_REWARDS}, got {scale!r}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if baseline == "leave_one_out":
        if group_size < 2:
            raise ValueError("the leave-one-out baseline needs group_size >= 2")
        centred = centred * (group_size / (group_size - 1))
    if scale == "group":
        centred = centred / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("scale='batch' needs batch_std, the std of the rewards over the whole batch")
        centred = centred / (batch_std + eps)
    return centred.reshape(-1)


def overlong_penalty(
    completion_lens: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), fp32 [N] for completion_lens [N]:

        0                                                    L ≤ max_new_tokens - buffer
        -penalty · (L - (max_new_tokens - buffer)) / buffer  max_new_tokens - buffer < L ≤ max_new_tokens
        -penalty                                             L > max_new_tokens (cannot happen when
                                                             generation stops at max_new_tokens)

    A buffer of 0 turns it off (zeros).
    """
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    if buffer == 0:
        return torch.zeros(completion_lens.shape, dtype=torch.float32, device=completion_lens.device)
    excess = (completion_lens - (max_new_tokens - buffer)).clamp(min=0, max=buffer).to(torch.float32)
    return -penalty * excess / buffer


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [N // group_size]: True for the groups of rewards [N] whose G rewards are all equal
    (their advantages are all 0, so they carry no gradient)."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)
