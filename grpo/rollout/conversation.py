"""Multi-turn rollout: model turns and environment turns, kept as one token sequence per episode.

Each round asks the engine for the next model turn of every unfinished conversation (its whole
history as the request's prompt), appends the sampled tokens (loss mask on, with their
generator log-probs), then the environment's reply (mask off). Token-in/token-out: the sampled
ids are appended as the engine returned them and the environment's ids as it gave them (or its
text through the tokenizer), so the trainer's sequence is exactly what was sampled and heard.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.data.prompt import Prompt, Tokenizer
from grpo.engine import Completion, Engine, GenerationRequest, SamplingParams
from grpo.envs.base import Environment, EnvReply
from grpo.envs.calls import CallOutcome, EnvCalls
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
    turn_limited: bool = False
    failed: bool = False
    reward: float | None = None
    env_seconds: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    last: Completion | None = None  # the model's latest turn, which the environment answers next

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
    failures: list[str] = field(default_factory=list)  # one line per failed environment call


def _checked(
    env: Environment, conv: Conversation, what: str, outcome: CallOutcome, timeout_s: float, on_error: str,
    stats: ConversationStats, want: type | None = None,
) -> Any:
    """The call's result, or None when it failed: then on_error "stop" raises, "zero" ends the episode."""
    kind, value = outcome
    where = f"environment '{env.name}' on episode (prompt {conv.prompt.index}, sample {conv.sample_index}), {what}"
    if kind == "ok" and (want is None or isinstance(value, want)):
        return value
    if kind == "raised":
        message = f"{where} raised {value!r}"
    elif kind == "timeout":
        message = f"{where} did not return within env.timeout_s = {timeout_s:g} s"
    else:
        message = f"{where} returned {type(value).__name__}, not an {want.__name__}"
    if on_error == "stop":
        raise EnvironmentFailure(message)
    conv.done = conv.failed = True
    stats.failures.append(message)
    return None


def _hear(env: Environment, conv: Conversation, reply: EnvReply, tokenizer: Tokenizer, max_tokens: int,
          stats: ConversationStats) -> None:
    """Append the environment's reply to the model's last turn; the conversation ends where it ends."""
    conv.tool_calls += reply.tool_calls
    conv.tool_errors += reply.tool_errors
    if reply.done:
        conv.done, conv.reward = True, reply.reward
        if conv.last.finish_reason == "length":  # the final turn was cut at generation.max_new_tokens
            conv.truncated = True
            stats.truncated_by_tokens += 1
        return
    heard = reply.tokens if reply.tokens is not None else tokenizer.encode(reply.text)
    if conv.turns >= env.max_turns:
        conv.done = conv.truncated = conv.turn_limited = True
        stats.truncated_by_turns += 1
    elif conv.after_prompt + len(heard) >= max_tokens:
        conv.done = conv.truncated = True
        stats.truncated_by_tokens += 1
    else:
        conv.append(list(heard), None)


def _model_turn(
    engine: Engine, active: list[Conversation], step: int, sampling: SamplingParams, max_tokens: int,
    stats: ConversationStats, keep_kv: bool,
) -> None:
    """The next model turn of each active conversation, appended with its log-probs under the mask."""
    requests = [
        GenerationRequest(list(c.tokens), step, c.prompt.index, c.sample_index,
                          max_new_tokens=min(sampling.max_new_tokens, max_tokens - c.after_prompt), keep_kv=keep_kv)
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
            conv.last = completion


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
    calls: EnvCalls | None = None,
    on_error: str = "stop",
    keep_kv: bool = True,
) -> tuple[EpisodeBatch, ConversationStats]:
    """group_size conversations of each prompt, group by group, as episodes.

    sampling.max_new_tokens caps each model turn; max_tokens caps all tokens after the prompt
    (model and environment together). The environment's calls run through `calls` (time-limited
    threads; default: 8 of them, 60 s a call); a call that raises, times out or answers with
    something else stops the rollout with EnvironmentFailure (on_error "stop") or ends its episode
    with no reward, marked env_failed ("zero"). keep_kv: the engine may keep each conversation's
    K/V between its turns and prefill only what was appended (GenerationRequest.keep_kv). Returns
    the episodes (env_rewards: the environment's reward, NaN where it gave none) and the batch's
    statistics.
    """
    calls = calls or EnvCalls(timeout_s=60.0, workers=8)
    check = functools.partial(_checked, env, timeout_s=calls.timeout_s, on_error=on_error)
    convs = [
        Conversation(p, s, None, list(p.token_ids), [False] * len(p.token_ids), [0.0] * len(p.token_ids))
        for p in prompts
        for s in range(group_size)
    ]
    stats = ConversationStats()
    for conv, (outcome, seconds) in zip(convs, calls.run(env.reset, [(c.prompt,) for c in convs])):
        conv.state, conv.env_seconds = check(conv, "reset", outcome, stats=stats), seconds
    for turn in range(env.max_turns):
        active = [c for c in convs if not c.done]
        if not active:
            break
        _model_turn(engine, active, step, sampling, max_tokens, stats, keep_kv)
        asking = [c for c in active if not c.done]
        # The first turn's text includes the answer's opening from the prompt (data.response_prefix).
        arguments = [(c.state, turn, (c.prompt.response_prefix if turn == 0 else "") + tokenizer.decode(c.last.tokens),
                      list(c.last.tokens)) for c in asking]
        for conv, (outcome, seconds) in zip(asking, calls.run(env.step, arguments)):
            conv.env_seconds += seconds
            stats.env_seconds += seconds
            reply = check(conv, f"turn {turn}", outcome, stats=stats, want=EnvReply)
            if reply is not None:
                _hear(env, conv, reply, tokenizer, max_tokens, stats)
    stats.turns = [c.turns for c in convs]
    if stats.failures:
        print(f"warning: {len(stats.failures)} episodes ended without a reward (rewards.on_error = \"zero\"); "
              f"first: {stats.failures[0]}", file=sys.stderr, flush=True)
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
        env_failed=torch.tensor([c.failed for c in convs], dtype=torch.bool),
        env_seconds=torch.tensor([c.env_seconds for c in convs], dtype=torch.float32),
        tool_calls=torch.tensor([c.tool_calls for c in convs], dtype=torch.long),
        tool_errors=torch.tensor([c.tool_errors for c in convs], dtype=torch.long),
        turn_limited=torch.tensor([c.turn_limited for c in convs], dtype=torch.bool),
    )
