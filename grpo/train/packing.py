"""Pack episodes for the trainer's forward: micro-batches within a token budget, each one row of
sequences back to back with no cross-attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.rollout.episode import EpisodeBatch


@dataclass
class PackedRows:
    """Model inputs and per-token training data, all [R, W] (R = 1 from `pack_episodes`).

    Token (r, c) predicts targets[r, c]. loss_mask marks targets that the model sampled;
    advantages and gen_logprobs are aligned with targets. doc_ids[r, c] is the index in the source
    batch of the episode the token belongs to, -1 on padding.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    gen_logprobs: torch.Tensor


def plan_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing: indices of lengths grouped so that each group's lengths sum to at most
    budget, in few groups. A length above the budget is refused (nothing could hold it)."""
    longest = max(lengths, default=0)
    if longest > budget:
        raise ValueError(
            f"training.micro_batch_tokens ({budget}) is smaller than an episode of {longest} tokens; "
            f"raise it to at least data.max_prompt_tokens + generation.max_new_tokens"
        )
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, space in enumerate(free) if space >= lengths[i]), None)
        if slot is None:
            bins.append([])
            free.append(budget)
            slot = len(bins) - 1
        bins[slot].append(i)
        free[slot] -= lengths[i]
    return bins


def pack_episodes(batch: EpisodeBatch, pad_id: int = 0, mask_truncated: bool = False) -> PackedRows:
    """Every episode's (seq_len - 1) input tokens back to back in one row [1, N], longest first
    (no padding: attention keeps to each episode through doc_ids, see model/attention.py).

    mask_truncated: completions cut by the token budget get no loss tokens (their reward judges an
    unfinished answer).
    """
    input_lens = (batch.seq_lens - 1).tolist()
    order = sorted(range(len(batch)), key=lambda i: -input_lens[i])
    shape = (1, max(1, sum(input_lens)))
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, pad_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    doc_ids = torch.full(shape, -1, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    gen_logprobs = torch.zeros(shape, dtype=torch.float32)
    src_tokens, src_logprobs, src_mask = batch.tokens.cpu(), batch.gen_logprobs.cpu(), batch.loss_mask.cpu()
    col = 0
    for i in order:
        n = input_lens[i]
        span = slice(col, col + n)
        tokens[0, span] = src_tokens[i, :n]
        targets[0, span] = src_tokens[i, 1 : n + 1]
        gen_logprobs[0, span] = src_logprobs[i, 1 : n + 1]
        positions[0, span] = torch.arange(n)
        doc_ids[0, span] = i
        if not (mask_truncated and bool(batch.truncated[i])):
            loss_mask[0, span] = src_mask[i, 1 : n + 1]
        advantages[0, span] = float(batch.advantages[i])
        col += n
    return PackedRows(tokens, positions, doc_ids, targets, loss_mask, advantages, gen_logprobs)
