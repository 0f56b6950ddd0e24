"""Episodes as tensors (their advantages: advantages.py).

An episode is one prompt and what follows it: one completion, or model turns with environment turns
between them, as one token sequence whose loss mask marks the tokens the model sampled. A group is
the G episodes of one prompt. A batch of episodes is a set of right-padded tensors, so it can cross
process boundaries as plain tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import torch


@dataclass
class EpisodeBatch:
    """N episodes. `tokens` holds the prompt, then everything after it, right-padded with `pad_id`.

    tokens [N, L] int64; prompt_lens [N] int64; completion_lens [N] int64: the tokens after the
    prompt (the model's and, in a multi-turn episode, the environment's);
    gen_logprobs [N, L] fp32: π_gen's log-prob of tokens[:, t] where the model sampled it, 0 elsewhere;
    truncated [N] bool: stopped by a token budget rather than EOS / a stop string / the environment;
    version [N]: policy version that generated it; prompt_index, sample_index [N] int64;
    rewards, advantages [N] fp32 (zeros until scored);
    loss_mask [N, L] bool: True at the tokens the model sampled, the only ones that carry loss.
    Left out (None), it is the single-turn mask: every token after the prompt;
    env_rewards [N] fp32: the reward an environment gave the episode, NaN where it gave none (and
    for every single-turn episode); the `env_reward` reward function reads it;
    env_failed [N] bool: the environment raised, hung or answered wrongly (rewards.on_error = "zero"
    ends such an episode there); env_seconds [N] fp32: time in the environment's calls;
    tool_calls, tool_errors [N] int64: tool calls the environment answered, and those that failed;
    turn_limited [N] bool: truncated by the turn budget (env.max_turns) rather than a token budget.
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
    loss_mask: torch.Tensor | None = None
    env_rewards: torch.Tensor | None = None
    env_failed: torch.Tensor | None = None
    env_seconds: torch.Tensor | None = None
    tool_calls: torch.Tensor | None = None
    tool_errors: torch.Tensor | None = None
    turn_limited: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.loss_mask is None:
            self.loss_mask = completion_mask(self.prompt_lens, self.completion_lens, self.tokens.shape[1])
        if self.env_rewards is None:
            self.env_rewards = torch.full((n,), float("nan"))
        if self.env_failed is None:
            self.env_failed = torch.zeros(n, dtype=torch.bool)
        if self.env_seconds is None:
            self.env_seconds = torch.zeros(n)
        if self.tool_calls is None:
            self.tool_calls = torch.zeros(n, dtype=torch.long)
        if self.tool_errors is None:
            self.tool_errors = torch.zeros(n, dtype=torch.long)
        if self.turn_limited is None:
            self.turn_limited = torch.zeros(n, dtype=torch.bool)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prompt_lens + self.completion_lens

    def select(self, index: torch.Tensor | slice | list[int]) -> EpisodeBatch:
        """The episodes at `index`, trimmed to their longest sequence."""
        lens = self.seq_lens[index]
        width = int(lens.max()) if len(lens) else 0
        # Rows and columns in one indexing: a tensor index gives a contiguous copy of just the kept columns.
        return EpisodeBatch(**{
            f.name: getattr(self, f.name)[index, :width] if f.name in PER_TOKEN else getattr(self, f.name)[index]
            for f in fields(self)
        })

    @property
    def sampled_lens(self) -> torch.Tensor:
        """[N] int64: tokens the model sampled in each episode (its loss tokens)."""
        return self.loss_mask.sum(dim=1)

    @property
    def model_turns(self) -> torch.Tensor:
        """[N] int64: the model turns of each episode (runs of sampled tokens; 1 for a completion)."""
        mask = self.loss_mask.long()
        return (mask.diff(dim=1, prepend=torch.zeros_like(mask[:, :1])) == 1).sum(dim=1)

    def turns(self, i: int) -> list[tuple[bool, list[int]]]:
        """Episode i after its prompt, turn by turn: (sampled by the model, token ids) in order."""
        start, end = int(self.prompt_lens[i]), int(self.seq_lens[i])
        out: list[tuple[bool, list[int]]] = []
        for token, sampled in zip(self.tokens[i, start:end].tolist(), self.loss_mask[i, start:end].tolist()):
            if out and out[-1][0] == sampled:
                out[-1][1].append(token)
            else:
                out.append((sampled, [token]))
        return out

    def completion(self, i: int) -> list[int]:
        start = int(self.prompt_lens[i])
        return self.tokens[i, start : start + int(self.completion_lens[i])].tolist()

    def completions(self) -> list[list[int]]:
        """Every episode's `completion`, from one read of the completion tokens (not of the prompts
        and padding around them: each token read costs a Python int)."""
        lens = self.completion_lens.tolist()
        flat = self.tokens[completion_mask(self.prompt_lens, self.completion_lens, self.tokens.shape[1])].tolist()
        ends = list(itertools.accumulate(lens))
        return [flat[end - n : end] for end, n in zip(ends, lens)]

    def to(self, device: torch.device | str) -> EpisodeBatch:
        return EpisodeBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


# The [N, L] fields; the others are per episode, [N].
PER_TOKEN = ("tokens", "gen_logprobs", "loss_mask")


def completion_mask(prompt_lens: torch.Tensor, completion_lens: torch.Tensor, width: int) -> torch.Tensor:
    """bool [N, width]: True at positions prompt_lens[i] <= t < prompt_lens[i] + completion_lens[i]
    (a single-turn episode's loss mask)."""
    t = torch.arange(width, device=prompt_lens.device)
    return (t >= prompt_lens[:, None]) & (t < (prompt_lens + completion_lens)[:, None])


def concat_episodes(batches: list[EpisodeBatch], pad_id: int) -> EpisodeBatch:
    """One batch of several (right-padded to the widest), in order."""
    width = max((b.tokens.shape[1] for b in batches), default=1)
    pad = lambda t, value: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)  # noqa: E731
    per_episode = {
        f.name: torch.cat([getattr(b, f.name) for b in batches]) for f in fields(EpisodeBatch) if f.name not in PER_TOKEN
    }
    return EpisodeBatch(
        tokens=torch.cat([pad(b.tokens, pad_id) for b in batches]),
        gen_logprobs=torch.cat([pad(b.gen_logprobs, 0.0) for b in batches]),
        loss_mask=torch.cat([pad(b.loss_mask, False) for b in batches]),
        **per_episode,
    )
