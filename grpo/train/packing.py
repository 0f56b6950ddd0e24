"""Pack episodes for the trainer's forward: micro-batches within a token budget, each one row of
sequences back to back with no cross-attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.rollout.episode import EpisodeBatch
from model.attention import concat_ranges


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
    lens = _lengths(sub)
    bins = plan_micro_batches([unit_tokens(*lens, u) for u in units], budget)
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
    total = int(lens.sum())

    def spread(per_run: torch.Tensor) -> torch.Tensor:
        """A value per run [R] repeated over the run's tokens [total] (faster than indexing by run)."""
        return per_run.repeat_interleave(lens, output_size=total)

    column = concat_ranges(first, lens)
    carries = doc_ids >= 0
    keeps = carries & ~batch.truncated.cpu()[episodes] if mask_truncated else carries
    # Flat offsets into the [N, L] per-token fields: index_select on a flat view is several times
    # faster than indexing rows and columns.
    at = spread(episodes) * batch.tokens.shape[1] + column

    def gathered(field: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return field.cpu().reshape(-1).index_select(0, offsets)

    return PackedRows(
        tokens=gathered(batch.tokens, at)[None],
        positions=column[None],
        doc_ids=spread(doc_ids)[None],
        targets=gathered(batch.tokens, at + 1)[None],
        loss_mask=(gathered(batch.loss_mask, at + 1) & spread(keeps)).to(torch.float32)[None],
        advantages=spread(batch.advantages.cpu().to(torch.float32)[episodes] * carries)[None],
        gen_logprobs=gathered(batch.gen_logprobs, at + 1).to(torch.float32)[None],
        group_ids=None if group_ids is None else spread(group_ids)[None],
    )


def prompt_units(batch: EpisodeBatch) -> list[list[int]]:
    """The episodes that can share their prompt: those of one prompt index whose prompts (at least
    2 tokens) are the same tokens, each such set of two or more one unit, every other episode a
    unit of its own. Units in order of their first episode."""
    lens, indices = batch.prompt_lens.tolist(), batch.prompt_index.tolist()
    # Each episode against the first episode of its prompt index and prompt length, in one comparison
    # (hashing every prompt's tokens on the host cost milliseconds); only a mismatch is hashed.
    firsts: dict[tuple[int, int], int] = {}
    candidate = [firsts.setdefault((index, length), i) for i, (index, length) in enumerate(zip(indices, lens))]
    prompts = batch.tokens.cpu()[:, : max(lens, default=0)]
    beyond = torch.arange(prompts.shape[1])[None, :] >= batch.prompt_lens.cpu()[:, None]
    matches = ((prompts == prompts[candidate]) | beyond).all(dim=1).tolist()
    units: dict[tuple, list[int]] = {}
    for i, (index, length) in enumerate(zip(indices, lens)):
        if length < 2:
            key: tuple = ("alone", i)
        elif matches[i]:
            key = ("first", candidate[i])
        else:
            key = ("prompt", index, tuple(prompts[i, :length].tolist()))
        units.setdefault(key, []).append(i)
    return list(units.values())


def _lengths(batch: EpisodeBatch) -> tuple[list[int], list[int]]:
    """Each episode's input tokens (seq_len - 1) and prompt tokens, on the host once for the loops below."""
    return (batch.seq_lens - 1).tolist(), batch.prompt_lens.tolist()


def unit_tokens(input_lens: list[int], prompt_lens: list[int], unit: list[int]) -> int:
    """Tokens a unit of prompt_units takes when packed with shared prompts (a lone episode: its
    input tokens), from the episodes' input and prompt lengths (_lengths)."""
    inputs = sum(input_lens[i] for i in unit)
    return inputs if len(unit) == 1 else inputs - (len(unit) - 1) * (prompt_lens[unit[0]] - 1)


def fit_units(batch: EpisodeBatch, units: list[list[int]], budget: int) -> list[list[int]]:
    """units (of prompt_units) split where one is longer than budget tokens packed: its episodes,
    longest first, in as few parts as fit, each part with the prompt again (an episode longer than
    the budget stays alone, for plan_micro_batches to refuse)."""
    fitted = []
    input_lens, prompt_lens = _lengths(batch)
    for unit in units:
        if unit_tokens(input_lens, prompt_lens, unit) <= budget:
            fitted.append(unit)
            continue
        part: list[int] = []
        for i in sorted(unit, key=lambda i: -input_lens[i]):
            if part and unit_tokens(input_lens, prompt_lens, part + [i]) > budget:
                fitted.append(part)
                part = []
            part.append(i)
        fitted.append(part)
    return fitted


def _pack_shared(batch: EpisodeBatch, mask_truncated: bool) -> PackedRows:
    """pack_episodes with share_prompts: per unit of prompt_units, longest unit first, the shared
    prefix (prompt[:-1]) and then each episode's inputs from column prompt_len - 1 on."""
    input_lens, prompt_lens = _lengths(batch)
    units = sorted(prompt_units(batch), key=lambda u: -unit_tokens(input_lens, prompt_lens, u))
    # (episode, first column, end column, doc id, group id) of each run, in packing order
    runs = []
    for group, unit in enumerate(units):
        if len(unit) == 1:
            runs.append((unit[0], 0, input_lens[unit[0]], unit[0], -1))
            continue
        start = prompt_lens[unit[0]] - 1
        runs.append((unit[0], 0, start, -1, group))
        for i in sorted(unit, key=lambda i: -input_lens[i]):
            runs.append((i, start, input_lens[i], i, group))
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
