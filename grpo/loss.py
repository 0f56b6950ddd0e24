"""The GRPO loss as pure functions on per-token tensors [B, T].

Policies (DESIGN.md): π_θ is being optimised, π_old is the trainer's policy before this batch's
first update, π_gen generated the tokens. The surrogate clips r = π_θ / π_old:

    loss_t = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)

and the batch loss sums loss_t over completion tokens and divides by a normaliser that the caller
chooses so the gradient is the same however the batch is split into micro-batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SurrogateTerms:
    """Per-token loss [B, T] and the statistics logged with it ([B, T] each)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> SurrogateTerms:
    """PPO-style clipped surrogate per token. All inputs [B, T]; advantages broadcast per sequence."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages
    # The clip is active where it lowers the objective: r above the band with A > 0, below it with A < 0.
    active = ((ratio > 1 + clip_eps_high) & (advantages > 0)) | ((ratio < 1 - clip_eps_low) & (advantages < 0))
    return SurrogateTerms(loss=-torch.minimum(unclipped, clipped), ratio=ratio.detach(), clipped=active)


def token_sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of per_token [B, T] over the tokens where mask [B, T] is set."""
    return (per_token * mask).sum()
