"""Episodes as tensors, and group-relative advantages.

An episode is one prompt plus one completion; a group is the G episodes of one prompt. A batch of
episodes is a set of right-padded tensors, so it can cross process boundaries as plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# Added to the group's standard deviation so that a group whose rewards are all equal gets zero
# advantages instead of 0 / 0.
ADVANTAGE_STD_EPS = 1e-4


@dataclass
class EpisodeBatch:
    """N episodes. `tokens` holds prompt then completion, right-padded with `pad_id`.

    tokens [N, L] int64; prompt_lens, completion_lens [N] int64;
    gen_logprobs [N, L] fp32: π_gen's log-prob of tokens[:, t] at the completion positions, 0 elsewhere;
    truncated [N] bool: stopped by max_new_tokens rather than EOS / a stop string;
    version [N]: policy version that generated it; prompt_index, sample_index [N] int64;
    rewards, advantages [N] fp32 (zeros until scored).
    """

    tokens: torch.Tensor
    prompt_lens: torch.Tensor
    completion_lens: torch.Tensor
    gen_logprobs: torch.Tensor
    truncated: torch.Tensor
    version: torch.Tensor
    prompt_index: torch.Tensor
    sample_index: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prompt_lens + self.completion_lens

    def select(self, index: torch.Tensor | slice | list[int]) -> EpisodeBatch:
        """The episodes at `index`, trimmed to their longest sequence."""
        picked = EpisodeBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})
        width = int(picked.seq_lens.max()) if len(picked) else 0
        picked.tokens, picked.gen_logprobs = picked.tokens[:, :width], picked.gen_logprobs[:, :width]
        return picked

    def completion(self, i: int) -> list[int]:
        start = int(self.prompt_lens[i])
        return self.tokens[i, start : start + int(self.completion_lens[i])].tolist()

    def to(self, device: torch.device | str) -> EpisodeBatch:
        return EpisodeBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = ADVANTAGE_STD_EPS) -> torch.Tensor:
    """(r - mean(group)) / (std(group) + eps) for rewards [N] laid out group by group.

    std is the unbiased (n - 1) estimate over the group's G rewards.
    """
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, unbiased=True, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)
