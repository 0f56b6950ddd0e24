"""Pack episodes into rows for the trainer's forward: several sequences per row, no cross-attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.episode import EpisodeBatch


@dataclass
class PackedRows:
    """Model inputs and per-token training data, all [R, W].

    Token (r, c) predicts targets[r, c]. loss_mask marks targets that are completion tokens;
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


def pack_episodes(batch: EpisodeBatch, pad_id: int = 0, mask_truncated: bool = False) -> PackedRows:
    """First-fit-decreasing packing of each episode's (seq_len - 1) input tokens into rows as wide as the longest.

    mask_truncated: completions cut by the token budget get no loss tokens (their reward judges an
    unfinished answer).
    """
    input_lens = (batch.seq_lens - 1).tolist()
    width = max(input_lens)
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(batch)), key=lambda i: -input_lens[i]):
        slot = next((r for r, space in enumerate(free) if space >= input_lens[i]), None)
        if slot is None:
            rows.append([])
            free.append(width)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= input_lens[i]

    shape = (len(rows), width)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, pad_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    doc_ids = torch.full(shape, -1, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    gen_logprobs = torch.zeros(shape, dtype=torch.float32)
    src_tokens, src_logprobs = batch.tokens.cpu(), batch.gen_logprobs.cpu()
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n = input_lens[i]
            span = slice(col, col + n)
            tokens[r, span] = src_tokens[i, :n]
            targets[r, span] = src_tokens[i, 1 : n + 1]
            gen_logprobs[r, span] = src_logprobs[i, 1 : n + 1]
            positions[r, span] = torch.arange(n)
            doc_ids[r, span] = i
            first_completion_target = int(batch.prompt_lens[i]) - 1
            if not (mask_truncated and bool(batch.truncated[i])):
                loss_mask[r, col + first_completion_target : col + n] = 1.0
            advantages[r, span] = float(batch.advantages[i])
            col += n
    return PackedRows(tokens, positions, doc_ids, targets, loss_mask, advantages, gen_logprobs)
