"""Multi-turn rollout: model turns and environment turns, kept as one token sequence per episode.

Each round asks the engine for the next model turn of every unfinished conversation (its whole
history as the request's prompt), appends the sampled tokens (loss mask on, with their
generator log-probs), then the environment's reply (mask off). Token-in/token-out: the sampled
ids are appended as the engine returned them and the environment's ids as it gave them (or its
text through the tokenizer), so the trainer's sequence is exactly what was sampled and heard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.data.prompt import Prompt, Tokenizer
from grpo.engine import Completion, Engine, GenerationRequest, SamplingParams
from grpo.envs.base import Environment, EnvReply
from grpo.errors import TandemError
from grpo.rollout.episode import EpisodeBatch


class EnvironmentFailure(TandemError, RuntimeError):
    """An environment raised or answered with something that is not an EnvReply; the message
    names the environment, the episode and the turn."""


@dataclass
class Conversation:
    """One episode being built: tokens [T] with their loss mask and generator log-probs."""

    prompt: Prompt
    sample_index: int
    state: Any
    tokens: list[int]
    mask: list[bool]
    logprobs: list[float]
    version: int = -1
    turns: int = 0
    done: bool = False
    truncated: bool = False
    reward: float | None = None

    @property
    def after_prompt(self) -> int:
        return len(self.tokens) - len(self.prompt.token_ids)

    def append(self, tokens: list[int], logprobs: list[float] | None) -> None:
        """Model tokens (with their log-probs) or the environment's (None: no loss, no log-prob)."""
        self.tokens += tokens
        self.mask += [logprobs is not None] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


@dataclass
class ConversationStats:
    """Per-batch numbers for the step's metrics."""

    turns: list[int] = field(default_factory=list)
    env_seconds: float = 0.0
    truncated_by_turns: int = 0
    truncated_by_tokens: int = 0


def _reply(env: Environment, conv: Conversation, turn: int, completion: Completion, tokenizer: Tokenizer) -> EnvReply:
    where = f"environment '{env.name}' on episode (prompt {conv.prompt.index}, sample {conv.sample_index}), turn {turn}"
    try:
        reply = env.step(conv.state, turn, tokenizer.decode(completion.tokens), list(completion.tokens))
    except Exception as error:
        raise EnvironmentFailure(f"{where} raised {error!r}") from error
    if not isinstance(reply, EnvReply):
        raise EnvironmentFailure(f"{where} returned {type(reply).__name__}, not an EnvReply")
    return reply


def _hear(
    env: Environment, conv: Conversation, turn: int, completion: Completion, tokenizer: Tokenizer, max_tokens: int,
    stats: ConversationStats,
) -> None:
    """The environment's reply to model turn `turn`, appended; the conversation ends where it ends."""
    start = time.perf_counter()
    reply = _reply(env, conv, turn, completion, tokenizer)
    stats.env_seconds += time.perf_counter() - start
    if reply.done:
        conv.done, conv.reward = True, reply.reward
        return
    heard = reply.tokens if reply.tokens is not None else tokenizer.encode(reply.text)
    if conv.turns >= env.max_turns:
        conv.done = conv.truncated = True
        stats.truncated_by_turns += 1
    elif conv.after_prompt + len(heard) >= max_tokens:
        conv.done = conv.truncated = True
        stats.truncated_by_tokens += 1
    else:
        conv.append(list(heard), None)


def generate_conversations(
    engine: Engine,
    env: Environment,
    prompts: list[Prompt],
    group_size: int,
    step: int,
    tokenizer: Tokenizer,
    pad_id: int,
    sampling: SamplingParams,
    max_tokens: int,
) -> tuple[EpisodeBatch, ConversationStats]:
    """group_size conversations of each prompt, group by group, as episodes.

    sampling.max_new_tokens caps each model turn; max_tokens caps all tokens after the prompt
    (model and environment together). Returns the episodes (env_rewards: the environment's reward,
    NaN where it gave none) and the batch's statistics.
    """
    convs = [
        Conversation(p, s, env.reset(p), list(p.token_ids), [False] * len(p.token_ids), [0.0] * len(p.token_ids))
        for p in prompts
        for s in range(group_size)
    ]
    stats = ConversationStats()
    for turn in range(env.max_turns):
        active = [c for c in convs if not c.done]
        if not active:
            break
        requests = [
            GenerationRequest(c.tokens, step, c.prompt.index, c.sample_index,
                              max_new_tokens=min(sampling.max_new_tokens, max_tokens - c.after_prompt))
            for c in active
        ]
        for conv, completion in zip(active, engine.generate(requests, sampling)):
            conv.append(list(completion.tokens), list(completion.logprobs))
            conv.version = completion.version if conv.version < 0 else min(conv.version, completion.version)
            conv.turns += 1
            if completion.finish_reason == "length" and conv.after_prompt >= max_tokens:
                conv.done = conv.truncated = True
                stats.truncated_by_tokens += 1
            else:
                _hear(env, conv, turn, completion, tokenizer, max_tokens, stats)
    stats.turns = [c.turns for c in convs]
    return _episodes(convs, pad_id), stats


def _episodes(convs: list[Conversation], pad_id: int) -> EpisodeBatch:
    n = len(convs)
    width = max((len(c.tokens) for c in convs), default=1)
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, c in enumerate(convs):
        tokens[i, : len(c.tokens)] = torch.tensor(c.tokens, dtype=torch.long)
        mask[i, : len(c.mask)] = torch.tensor(c.mask, dtype=torch.bool)
        logprobs[i, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    prompt_lens = torch.tensor([len(c.prompt.token_ids) for c in convs], dtype=torch.long)
    return EpisodeBatch(
        tokens=tokens,
        prompt_lens=prompt_lens,
        completion_lens=torch.tensor([len(c.tokens) for c in convs], dtype=torch.long) - prompt_lens,
        gen_logprobs=logprobs,
        truncated=torch.tensor([c.truncated for c in convs], dtype=torch.bool),
        version=torch.tensor([c.version for c in convs], dtype=torch.long),
        prompt_index=torch.tensor([c.prompt.index for c in convs], dtype=torch.long),
        sample_index=torch.tensor([c.sample_index for c in convs], dtype=torch.long),
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
        loss_mask=mask,
        env_rewards=torch.tensor([float("nan") if c.reward is None else c.reward for c in convs], dtype=torch.float32),
    )
