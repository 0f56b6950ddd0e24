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
    order = torch.tensor(sorted(range(len(batch)), key=lambda i: -input_lens[i]), dtype=torch.long)
    total = sum(input_lens)
    if total == 0:
        shape = (1, 1)
        zeros = torch.zeros(shape, dtype=torch.float32)
        pad = torch.full(shape, pad_id, dtype=torch.long)
        return PackedRows(pad, torch.zeros(shape, dtype=torch.long), torch.full(shape, -1), pad.clone(), zeros,
                          zeros.clone(), zeros.clone())
    # One gather over the episodes in packing order: row r's first input_lens[r] columns, row by
    # row, are exactly the episodes laid back to back.
    tokens_in = batch.tokens.cpu()[order]
    width = tokens_in.shape[1] - 1
    lens = (batch.seq_lens.cpu() - 1)[order]
    columns = torch.arange(width)
    valid = columns[None, :] < lens[:, None]  # [B, T - 1]
    loss_mask = batch.loss_mask.cpu()[order][:, 1:].to(torch.float32)
    if mask_truncated:
        loss_mask = loss_mask * ~batch.truncated.cpu()[order][:, None]
    per_episode = (valid.shape[0], width)
    return PackedRows(
        tokens=tokens_in[:, :-1][valid][None],
        positions=columns.expand(per_episode)[valid][None],
        doc_ids=order[:, None].expand(per_episode)[valid][None],
        targets=tokens_in[:, 1:][valid][None],
        loss_mask=loss_mask[valid][None],
        advantages=batch.advantages.cpu().to(torch.float32)[order][:, None].expand(per_episode)[valid][None],
        gen_logprobs=batch.gen_logprobs.cpu()[order][:, 1:].to(torch.float32)[valid][None],
    )


def concat_rows(parts: list[PackedRows | None]) -> tuple[PackedRows | None, list[int]]:
    """Packed micro-batches laid back to back in one row [1, sum W] (None parts, empty micro-batches,
    add nothing), with each part's doc_ids moved past the previous parts' so that no two episodes
    share an id; and the width each part takes (0 for None). None when every part is None."""
    present = [p for p in parts if p is not None]
    widths = [0 if p is None else p.tokens.shape[1] for p in parts]
    if not present:
        return None, widths
    doc_ids, offset = [], 0
    for p in present:
        doc_ids.append(torch.where(p.doc_ids >= 0, p.doc_ids + offset, p.doc_ids))
        offset += int(p.doc_ids.max()) + 1
    fields = {
        name: torch.cat([getattr(p, name) for p in present], dim=1)
        for name in ("tokens", "positions", "targets", "loss_mask", "advantages", "gen_logprobs")
    }
    return PackedRows(doc_ids=torch.cat(doc_ids, dim=1), **fields), widths
