"""The generator side of a step: prompts -> engine requests -> completions -> an EpisodeBatch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo.data.prompt import Prompt
from grpo.engine import Completion, Engine, GenerationRequest, SamplingParams
from grpo.rollout.episode import EpisodeBatch


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
    prompt_lens = torch.tensor([len(c.request.prompt_tokens) for c in completions], dtype=torch.long)
    completion_lens = torch.tensor([len(c.tokens) for c in completions], dtype=torch.long)
    width = int((prompt_lens + completion_lens).max()) if n else 1
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
        truncated=torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.bool),
        version=torch.tensor([c.version for c in completions], dtype=torch.long),
        prompt_index=torch.tensor([c.request.prompt_index for c in completions], dtype=torch.long),
        sample_index=torch.tensor([c.request.sample_index for c in completions], dtype=torch.long),
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
    )


def generate_episodes(
    engine: Engine,
    prompts: list[Prompt],
    group_size: int,
    step: int,
    pad_id: int,
    sampling: SamplingParams | None = None,
    on_finished: Callable[[list[Completion]], None] | None = None,
) -> EpisodeBatch:
    """group_size completions of each prompt, as episodes laid out group by group; `on_finished`
    hears of completions as they finish (Engine.generate)."""
    requests = generate_requests(prompts, group_size, step)
    return episodes_from_completions(engine.generate(requests, sampling, on_finished=on_finished), pad_id)

