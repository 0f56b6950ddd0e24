"""One RL step's data path: prompts -> engine -> episodes -> Scorer -> advantages; and evaluation."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from grpo.data import Prompt
from grpo.engine import Completion, GenerationRequest, NativeEngine, SamplingParams
from grpo.episode import EpisodeBatch, group_advantages
from grpo.scorer import Scorer


@dataclass
class Rollout:
    """Scored episodes of one step, laid out group by group, and their decoded completion texts."""

    episodes: EpisodeBatch
    texts: list[str]
    # per reward function: sum over this rank's episodes (summed across ranks before averaging)
    reward_sums: dict[str, float]
    generate_s: float
    score_s: float


def generate_requests(prompts: list[Prompt], group_size: int, step: int) -> list[GenerationRequest]:
    """group_size requests per prompt, group by group."""
    return [
        GenerationRequest(prompt.token_ids, step, prompt.index, sample)
        for prompt in prompts
        for sample in range(group_size)
    ]


def episodes_from_completions(completions: list[Completion], pad_id: int) -> EpisodeBatch:
    """Lay completions out as an EpisodeBatch (prompt then completion per row, right-padded)."""
    n = len(completions)
    prompt_lens = torch.tensor([len(c.request.prompt_tokens) for c in completions])
    completion_lens = torch.tensor([len(c.tokens) for c in completions])
    width = int((prompt_lens + completion_lens).max())
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    gen_logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, c in enumerate(completions):
        p = len(c.request.prompt_tokens)
        tokens[i, :p] = torch.tensor(c.request.prompt_tokens)
        tokens[i, p : p + len(c.tokens)] = torch.tensor(c.tokens, dtype=torch.long)
        gen_logprobs[i, p : p + len(c.tokens)] = torch.tensor(c.logprobs)
    return EpisodeBatch(
        tokens=tokens,
        prompt_lens=prompt_lens,
        completion_lens=completion_lens,
        gen_logprobs=gen_logprobs,
        truncated=torch.tensor([c.finish_reason == "length" for c in completions]),
        version=torch.tensor([c.version for c in completions]),
        prompt_index=torch.tensor([c.request.prompt_index for c in completions]),
        sample_index=torch.tensor([c.request.sample_index for c in completions]),
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
    )


def score(scorer: Scorer, prompts: list[Prompt], completions: list[Completion], decode) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    """Rewards [N], per-function rewards and completion texts of completions of `prompts`."""
    by_index = {p.index: p for p in prompts}
    owners = [by_index[c.request.prompt_index] for c in completions]
    texts = [decode(c.tokens) for c in completions]
    scored = scorer.score(
        [p.text for p in owners], texts, [p.answer for p in owners], [p.metadata for p in owners]
    )
    return scored.total, scored.per_function, texts


def rollout(
    engine: NativeEngine, scorer: Scorer, prompts: list[Prompt], group_size: int, step: int, decode, pad_id: int
) -> Rollout:
    """Generate group_size completions per prompt, score them and compute group advantages."""
    start = time.perf_counter()
    completions = engine.generate(generate_requests(prompts, group_size, step))
    generated = time.perf_counter()
    episodes = episodes_from_completions(completions, pad_id)
    rewards, per_function, texts = score(scorer, prompts, completions, decode)
    episodes.rewards = rewards
    episodes.advantages = group_advantages(rewards, group_size)
    reward_sums = {name: float(values.sum()) for name, values in per_function.items()}
    return Rollout(episodes, texts, reward_sums, generated - start, time.perf_counter() - generated)


def evaluate(
    engine: NativeEngine, scorer: Scorer, prompts: list[Prompt], max_new_tokens: int, decode
) -> tuple[float, float]:
    """Greedy completions of held-out prompts: (sum of rewards, sum of completion lengths)."""
    if not prompts:
        return 0.0, 0.0
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    completions = engine.generate(generate_requests(prompts, 1, step=0), greedy)
    rewards, _, _ = score(scorer, prompts, completions, decode)
    return float(rewards.sum()), float(sum(len(c.tokens) for c in completions))
