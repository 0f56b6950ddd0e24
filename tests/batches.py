"""Hand-made episode batches for trainer tests."""

from __future__ import annotations

import torch

from grpo.rollout.episode import EpisodeBatch


def hand_made_batch(
    prompt_lens: list[int],
    completion_lens: list[list[int]],
    advantages: list[list[float]],
    vocab_size: int,
    seed: int,
    first_prompt_index: int,
) -> EpisodeBatch:
    """Groups g = 0, 1, ... of len(completion_lens[g]) episodes each, laid out group by group, with
    prompt index first_prompt_index + g, random token ids (random past each sequence too: padding
    must be ignored) and random generator log-probs on the completion tokens."""
    g = torch.Generator().manual_seed(seed)
    n = sum(len(c) for c in completion_lens)
    width = max(prompt_lens[gi] + c for gi, cs in enumerate(completion_lens) for c in cs) + 2
    tokens = torch.randint(1, vocab_size, (n, width), generator=g)
    gen_logprobs = torch.zeros(n, width)
    prompts, completions, prompt_index, sample_index, flat_advantages = [], [], [], [], []
    i = 0
    for gi, cs in enumerate(completion_lens):
        for s, c in enumerate(cs):
            p = prompt_lens[gi]
            gen_logprobs[i, p : p + c] = -torch.rand(c, generator=g) * 3
            prompts.append(p)
            completions.append(c)
            prompt_index.append(first_prompt_index + gi)
            sample_index.append(s)
            flat_advantages.append(advantages[gi][s])
            i += 1
    return EpisodeBatch(
        tokens=tokens,
        prompt_lens=torch.tensor(prompts),
        completion_lens=torch.tensor(completions),
        gen_logprobs=gen_logprobs,
        truncated=torch.zeros(n, dtype=torch.bool),
        version=torch.zeros(n, dtype=torch.long),
        prompt_index=torch.tensor(prompt_index),
        sample_index=torch.tensor(sample_index),
        rewards=torch.zeros(n),
        advantages=torch.tensor(flat_advantages),
    )
