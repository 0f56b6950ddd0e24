"""Episodes over the wire: generator ranks send whole groups to trainer ranks as plain tensors.

One exchange per batch:
1. every rank all-gathers a small table describing each generator's groups (prompt index,
   episodes, tokens, width) and its generation time;
2. every rank computes the same assignment of groups to trainer ranks: longest-processing-time
   first by token count, so trainer loads are balanced and a group is never split;
3. each generator sends each trainer one int64 tensor (lengths, flags, indices, token ids, loss
   mask) and one fp32 tensor (the environment's reward and time, then the generator log-probs)
   holding that trainer's groups; shapes are known from the table.
Trainers receive their groups ordered by (prompt index, sample index), independent of which
generator produced them. Episode tensors stay on the CPU: they are small and this keeps weight
traffic, which uses the device, on its own groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo.distributed.roles import Roles
from grpo.rollout.episode import EpisodeBatch, concat_episodes

# Per-episode header columns in the int64 message, before the token ids and the loss mask.
_HEADER = (
    "prompt_lens", "completion_lens", "truncated", "version", "prompt_index", "sample_index", "env_failed", "tool_calls",
    "tool_errors", "turn_limited",
)
# Per-episode columns in the fp32 message, before the generator log-probs.
_FLOAT_HEADER = ("env_rewards", "env_seconds")
# Columns of the all-gathered group table.
_PROMPT, _EPISODES, _TOKENS, _WIDTH, _VALID = range(5)


def _group_spans(batch: EpisodeBatch) -> list[tuple[int, int]]:
    """[start, end) of each group in a batch laid out group by group."""
    spans, start = [], 0
    indices = batch.prompt_index.tolist()
    for i in range(1, len(indices) + 1):
        if i == len(indices) or indices[i] != indices[start]:
            spans.append((start, i))
            start = i
    return spans


def assign_groups(tokens: list[int], prompt_indices: list[int], num_trainers: int) -> list[int]:
    """Trainer (0-based) for each group: largest groups first, each to the least-loaded trainer."""
    loads = [0] * num_trainers
    owner = [0] * len(tokens)
    for g in sorted(range(len(tokens)), key=lambda g: (-tokens[g], prompt_indices[g])):
        t = min(range(num_trainers), key=lambda t: (loads[t], t))
        owner[g] = t
        loads[t] += tokens[g]
    return owner


def _encode(batch: EpisodeBatch, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    header = torch.stack([getattr(batch, name)[rows].long() for name in _HEADER], dim=1)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    used = min(width, batch.tokens.shape[1])
    tokens[:, :used] = batch.tokens[rows, :used]
    mask[:, :used] = batch.loss_mask[rows, :used]
    logprobs[:, :used] = batch.gen_logprobs[rows, :used]
    per_episode = torch.stack([getattr(batch, name)[rows].float() for name in _FLOAT_HEADER], dim=1)
    return torch.cat([header, tokens, mask], dim=1), torch.cat([per_episode, logprobs], dim=1)


def _decode(ints: torch.Tensor, floats: torch.Tensor) -> EpisodeBatch:
    """Inverse of `_encode`: ints [n, len(_HEADER) + 2 W], floats [n, len(_FLOAT_HEADER) + W]."""
    n, width = floats.shape[0], floats.shape[1] - len(_FLOAT_HEADER)
    fields = {name: ints[:, i] for i, name in enumerate(_HEADER)}
    fields |= {name: floats[:, i] for i, name in enumerate(_FLOAT_HEADER)}
    fields["truncated"] = fields["truncated"].bool()
    for name in ("env_failed", "turn_limited"):
        fields[name] = fields[name].bool()
    body = ints[:, len(_HEADER) :]
    return EpisodeBatch(
        tokens=body[:, :width],
        loss_mask=body[:, width:].bool(),
        gen_logprobs=floats[:, len(_FLOAT_HEADER) :],
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
        **fields,
    )


def exchange_episodes(
    batch: EpisodeBatch | None, roles: Roles, max_groups: int, generate_s: float = 0.0
) -> tuple[EpisodeBatch | None, float]:
    """Move generator ranks' episodes to trainer ranks. Collective over all ranks.

    batch: this generator's episodes, group by group (None on trainer ranks).
    max_groups: the most groups any generator can hold in this exchange (sizes the table).
    Returns (this trainer's episodes, or None on generator ranks; the slowest generator's generate_s).
    """
    world = dist.get_world_size(roles.episode_group)
    table = torch.zeros((max_groups + 1, 5), dtype=torch.long)
    spans = _group_spans(batch) if batch is not None else []
    if len(spans) > max_groups:
        raise ValueError(f"generator holds {len(spans)} groups, more than the {max_groups} planned")
    for g, (start, end) in enumerate(spans):
        table[g] = torch.tensor(
            [int(batch.prompt_index[start]), end - start, int(batch.seq_lens[start:end].sum()),
             int(batch.seq_lens[start:end].max()), 1]
        )
    table[max_groups, 0] = int(generate_s * 1e6)
    tables = [torch.empty_like(table) for _ in range(world)]
    dist.all_gather(tables, table, group=roles.episode_group)

    groups = [(src, g) for src in roles.generator_ranks for g in range(max_groups) if tables[src][g, _VALID]]
    owner = assign_groups(
        [int(tables[src][g, _TOKENS]) for src, g in groups],
        [int(tables[src][g, _PROMPT]) for src, g in groups],
        len(roles.trainer_ranks),
    )
    generate_s = max(float(tables[src][max_groups, 0]) / 1e6 for src in roles.generator_ranks)

    ops, received = [], []
    for t, trainer in enumerate(roles.trainer_ranks):
        for src in roles.generator_ranks:
            mine = [g for (s, g), o in zip(groups, owner) if s == src and o == t]
            if not mine or roles.rank not in (src, trainer):
                continue
            n = sum(int(tables[src][g, _EPISODES]) for g in mine)
            width = max(int(tables[src][g, _WIDTH]) for g in mine)
            if roles.rank == src:
                rows = [i for g in mine for i in range(*spans[g])]
                ints, floats = _encode(batch, rows, width)
                ops += [dist.P2POp(dist.isend, ints, trainer, roles.episode_group),
                        dist.P2POp(dist.isend, floats, trainer, roles.episode_group)]
            else:
                ints = torch.empty((n, len(_HEADER) + 2 * width), dtype=torch.long)
                floats = torch.empty((n, len(_FLOAT_HEADER) + width), dtype=torch.float32)
                ops += [dist.P2POp(dist.irecv, ints, src, roles.episode_group),
                        dist.P2POp(dist.irecv, floats, src, roles.episode_group)]
                received.append((ints, floats))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if not roles.is_trainer:
        return None, generate_s
    if not received:
        return _decode(torch.zeros((0, len(_HEADER) + 2), dtype=torch.long), torch.zeros((0, len(_FLOAT_HEADER) + 1))), generate_s
    episodes = concat_episodes([_decode(i, f) for i, f in received], pad_id=0)
    order = sorted(range(len(episodes)), key=lambda i: (int(episodes.prompt_index[i]), int(episodes.sample_index[i])))
    return episodes.select(order), generate_s
