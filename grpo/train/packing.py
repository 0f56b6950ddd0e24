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
    batch of the episode the token belongs to, -1 on padding and on shared prompts. group_ids (None:
    nothing is shared): a group id for every token of an episode that continues a shared prompt and
    for that prompt's tokens (doc id -1), else -1 (model/attention.py sequence_layout).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    gen_logprobs: torch.Tensor
    group_ids: torch.Tensor | None = None


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


def micro_batch_episodes(
    batch: EpisodeBatch, episodes: torch.Tensor, budget: int, share_prompts: bool = False
) -> list[torch.Tensor]:
    """The episodes (of `episodes`, indices into batch) of each micro-batch of at most budget packed
    tokens: first fit of whole episodes, or with shared prompts of whole prompt units (a unit too
    long for one micro-batch is split, each part with its own copy of the prompt: fit_units)."""
    if not share_prompts:
        lengths = (batch.seq_lens[episodes] - 1).tolist()
        return [episodes[members] for members in plan_micro_batches(lengths, budget)]
    sub = batch.select(episodes)
    units = fit_units(sub, prompt_units(sub), budget)
    bins = plan_micro_batches([unit_tokens(sub, u) for u in units], budget)
    return [episodes[[i for u in members for i in units[u]]] for members in bins]


def pack_episodes(
    batch: EpisodeBatch, pad_id: int = 0, mask_truncated: bool = False, share_prompts: bool = False
) -> PackedRows:
    """Every episode's (seq_len - 1) input tokens back to back in one row [1, N], longest first
    (no padding: attention keeps to each episode through doc_ids, see model/attention.py).

    mask_truncated: completions cut by the token budget get no loss tokens (their reward judges an
    unfinished answer).
    share_prompts: the episodes of one prompt (see prompt_units) lay its tokens but the last down
    once, as a shared prefix, then each episode from the prompt's last token on; each episode
    attends to the prefix and then to itself, so its tokens' log-probs are those of the plain layout.
    """
    input_lens = (batch.seq_lens - 1).tolist()
    order = torch.tensor(sorted(range(len(batch)), key=lambda i: -input_lens[i]), dtype=torch.long)
    total = sum(input_lens)
    if share_prompts and total:
        return _pack_shared(batch, mask_truncated)
    if total == 0:
        shape = (1, 1)
        zeros = torch.zeros(shape, dtype=torch.float32)
        pad = torch.full(shape, pad_id, dtype=torch.long)
        return PackedRows(pad, torch.zeros(shape, dtype=torch.long), torch.full(shape, -1), pad.clone(), zeros,
                          zeros.clone(), zeros.clone())
    # Every episode whole, longest first: one run each over its input columns.
    return _gather_runs(batch, order, torch.zeros_like(order), (batch.seq_lens.cpu() - 1)[order], order, None,
                        mask_truncated)


def _gather_runs(
    batch: EpisodeBatch, episodes: torch.Tensor, first: torch.Tensor, end: torch.Tensor, doc_ids: torch.Tensor,
    group_ids: torch.Tensor | None, mask_truncated: bool,
) -> PackedRows:
    """The packed row of runs [R] laid back to back: run r is episode episodes[r]'s input columns
    first[r]:end[r], with doc id doc_ids[r] and group id group_ids[r] (None: no groups). One gather
    per field; a run of doc id -1 (a shared prompt) carries no loss."""
    lens = end - first
    runs = torch.arange(len(lens)).repeat_interleave(lens)
    run_starts = lens.cumsum(0) - lens
    episode = episodes[runs]
    column = first[runs] + torch.arange(int(lens.sum())) - run_starts[runs]
    doc = doc_ids[runs]
    carries = doc >= 0
    loss_mask = batch.loss_mask.cpu().to(torch.float32)[episode, column + 1] * carries
    if mask_truncated:
        loss_mask = loss_mask * ~batch.truncated.cpu()[episode]
    return PackedRows(
        tokens=batch.tokens.cpu()[episode, column][None],
        positions=column[None],
        doc_ids=doc[None],
        targets=batch.tokens.cpu()[episode, column + 1][None],
        loss_mask=loss_mask[None],
        advantages=(batch.advantages.cpu().to(torch.float32)[episode] * carries)[None],
        gen_logprobs=batch.gen_logprobs.cpu().to(torch.float32)[episode, column + 1][None],
        group_ids=None if group_ids is None else group_ids[runs][None],
    )


def prompt_units(batch: EpisodeBatch) -> list[list[int]]:
    """The episodes that can share their prompt: those of one prompt index whose prompts (at least
    2 tokens) are the same tokens, each such set of two or more one unit, every other episode a
    unit of its own. Units in order of their first episode."""
    units: dict[tuple, list[int]] = {}
    lens = batch.prompt_lens.tolist()
    for i, (index, length) in enumerate(zip(batch.prompt_index.tolist(), lens)):
        key = (index, tuple(batch.tokens[i, :length].tolist())) if length >= 2 else (i,)
        units.setdefault(key, []).append(i)
    return list(units.values())


def unit_tokens(batch: EpisodeBatch, unit: list[int]) -> int:
    """Tokens a unit of prompt_units takes when packed with shared prompts (a lone episode: its seq_len - 1)."""
    inputs = sum(int(batch.seq_lens[i]) - 1 for i in unit)
    return inputs if len(unit) == 1 else inputs - (len(unit) - 1) * (int(batch.prompt_lens[unit[0]]) - 1)


def fit_units(batch: EpisodeBatch, units: list[list[int]], budget: int) -> list[list[int]]:
    """units (of prompt_units) split where one is longer than budget tokens packed: its episodes,
    longest first, in as few parts as fit, each part with the prompt again (an episode longer than
    the budget stays alone, for plan_micro_batches to refuse)."""
    fitted = []
    for unit in units:
        if unit_tokens(batch, unit) <= budget:
            fitted.append(unit)
            continue
        part: list[int] = []
        for i in sorted(unit, key=lambda i: -int(batch.seq_lens[i])):
            if part and unit_tokens(batch, part + [i]) > budget:
                fitted.append(part)
                part = []
            part.append(i)
        fitted.append(part)
    return fitted


def _pack_shared(batch: EpisodeBatch, mask_truncated: bool) -> PackedRows:
    """pack_episodes with share_prompts: per unit of prompt_units, longest unit first, the shared
    prefix (prompt[:-1]) and then each episode's inputs from column prompt_len - 1 on."""
    units = sorted(prompt_units(batch), key=lambda u: -unit_tokens(batch, u))
    # (episode, first column, end column, doc id, group id) of each run, in packing order
    runs = []
    for group, unit in enumerate(units):
        if len(unit) == 1:
            runs.append((unit[0], 0, int(batch.seq_lens[unit[0]]) - 1, unit[0], -1))
            continue
        start = int(batch.prompt_lens[unit[0]]) - 1
        runs.append((unit[0], 0, start, -1, group))
        for i in sorted(unit, key=lambda i: -int(batch.seq_lens[i])):
            runs.append((i, start, int(batch.seq_lens[i]) - 1, i, group))
    episodes, first, end, doc_ids, group_ids = (torch.tensor(column, dtype=torch.long) for column in zip(*runs))
    return _gather_runs(batch, episodes, first, end, doc_ids, group_ids, mask_truncated)


def concat_rows(parts: list[PackedRows | None]) -> tuple[PackedRows | None, list[int]]:
    """Packed micro-batches laid back to back in one row [1, sum W] (None parts, empty micro-batches,
    add nothing), with each part's doc_ids moved past the previous parts' so that no two episodes
    share an id; and the width each part takes (0 for None). None when every part is None."""
    present = [p for p in parts if p is not None]
    widths = [0 if p is None else p.tokens.shape[1] for p in parts]
    if not present:
        return None, widths
    doc_ids, group_ids, offset, group_offset = [], [], 0, 0
    for p in present:
        doc_ids.append(torch.where(p.doc_ids >= 0, p.doc_ids + offset, p.doc_ids))
        offset += int(p.doc_ids.max()) + 1
        groups = torch.full_like(p.doc_ids, -1) if p.group_ids is None else p.group_ids
        group_ids.append(torch.where(groups >= 0, groups + group_offset, groups))
        group_offset += int(groups.max()) + 1
    fields = {
        name: torch.cat([getattr(p, name) for p in present], dim=1)
        for name in ("tokens", "positions", "targets", "loss_mask", "advantages", "gen_logprobs")
    }
    shared = any(p.group_ids is not None for p in present)
    return PackedRows(doc_ids=torch.cat(doc_ids, dim=1), group_ids=torch.cat(group_ids, dim=1) if shared else None,
                      **fields), widths
