"""The trainer's packing (grpo/train/packing.py): episodes laid out in micro-batch rows by hand-derived
expectations (positions, document ids, loss masks, shared prompts) and the micro-batch plan."""

from __future__ import annotations

import pytest
import torch

from grpo.rollout.episode import EpisodeBatch
from grpo.train.packing import fit_units, pack_episodes, plan_micro_batches, prompt_units


def _episode_batch(prompts: list[list[int]], completions: list[list[int]], advantages: list[float]) -> EpisodeBatch:
    n = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    tokens = torch.full((n, width), 99, dtype=torch.long)
    gen = torch.zeros(n, width)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tokens[i, : len(p) + len(c)] = torch.tensor(p + c)
        for t in range(len(p), len(p) + len(c)):
            gen[i, t] = -(i + 1) - 0.1 * t
    return EpisodeBatch(
        tokens=tokens, prompt_lens=torch.tensor([len(p) for p in prompts]),
        completion_lens=torch.tensor([len(c) for c in completions]), gen_logprobs=gen,
        truncated=torch.zeros(n, dtype=torch.bool), version=torch.zeros(n, dtype=torch.long),
        prompt_index=torch.tensor([0, 0, 1, 1]), sample_index=torch.tensor([0, 1, 0, 1]),
        rewards=torch.zeros(n), advantages=torch.tensor(advantages),
    )


def test_pack_episodes_hand_layout():
    # input lengths (seq_len - 1): A 4, B 2, C 3, D 2 -> one row, longest first: A C B D, no padding
    batch = _episode_batch(
        prompts=[[10, 11, 12], [20, 21], [30], [40, 41]],
        completions=[[13, 14], [22], [31, 32, 33], [42]],
        advantages=[0.5, -1.0, 2.0, -0.25],
    )
    rows = pack_episodes(batch, pad_id=0)
    assert rows.tokens.tolist() == [[10, 11, 12, 13, 30, 31, 32, 20, 21, 40, 41]]
    assert rows.targets.tolist() == [[11, 12, 13, 14, 31, 32, 33, 21, 22, 41, 42]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1]]
    assert rows.doc_ids.tolist() == [[0, 0, 0, 0, 2, 2, 2, 1, 1, 3, 3]]
    # a target is trained on iff it is a completion token
    assert rows.loss_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 1]]
    assert rows.advantages.tolist() == [[0.5] * 4 + [2.0] * 3 + [-1.0] * 2 + [-0.25] * 2]
    # π_gen's log-prob of each target (episode i, sequence position t: -(i+1) - 0.1 t)
    expected_gen = [[0, 0, -1.3, -1.4, -3.1, -3.2, -3.3, 0, -2.2, 0, -4.2]]
    torch.testing.assert_close(rows.gen_logprobs, torch.tensor(expected_gen), atol=1e-6, rtol=0)


def test_pack_episodes_multi_turn_mask_hand_built():
    """A conversation: prompt [10 11], model turn [12 13], environment turn [14 15], model turn [16];
    a single-turn episode beside it. Only the model's tokens are loss targets, with their log-probs."""
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 99, 99, 99, 99]])
    model_turns = torch.tensor([[0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    gen = torch.where(model_turns, -torch.arange(1, 8, dtype=torch.float32) / 10, torch.zeros(2, 7))
    batch = EpisodeBatch(
        tokens=tokens, prompt_lens=torch.tensor([2, 2]), completion_lens=torch.tensor([5, 1]), gen_logprobs=gen,
        truncated=torch.zeros(2, dtype=torch.bool), version=torch.zeros(2, dtype=torch.long),
        prompt_index=torch.tensor([0, 1]), sample_index=torch.tensor([0, 0]), rewards=torch.zeros(2),
        advantages=torch.tensor([1.0, -1.0]), loss_mask=model_turns,
    )
    rows = pack_episodes(batch, pad_id=0)
    assert rows.tokens.tolist() == [[10, 11, 12, 13, 14, 15, 20, 21]]
    assert rows.targets.tolist() == [[11, 12, 13, 14, 15, 16, 21, 22]]
    # targets 12, 13 (model), 14, 15 (environment: no loss), 16 (model); 21 (prompt), 22 (model)
    assert rows.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1, 0, 1]]
    torch.testing.assert_close(rows.gen_logprobs, torch.tensor([[0, -0.3, -0.4, 0, 0, -0.7, 0, -0.3]]))
    assert batch.sampled_lens.tolist() == [3, 1]
    # left out, the mask is the single-turn one: every token after the prompt
    plain = EpisodeBatch(**{**batch.__dict__, "loss_mask": None})
    assert plain.loss_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0, 0]]


def test_pack_episodes_with_shared_prompts_hand_layout():
    """Two episodes of prompt [10 11 12] (its first two tokens laid down once, then each episode from
    the prompt's last token on), one of another prompt index alone, one of the same index whose
    prompt differs (alone too)."""
    batch = _episode_batch(
        prompts=[[10, 11, 12], [10, 11, 12], [30, 31], [10, 11, 19]],
        completions=[[13, 14], [15], [32, 33, 34], [16]],
        advantages=[0.5, -1.0, 2.0, -0.25],
    )
    batch.prompt_index = torch.tensor([0, 0, 1, 0])
    assert prompt_units(batch) == [[0, 1], [2], [3]]
    rows = pack_episodes(batch, share_prompts=True)
    # units longest first: [0, 1] takes 2 + 2 + 1 = 5 tokens, [2] 4, [3] 3
    assert rows.tokens.tolist() == [[10, 11, 12, 13, 12, 30, 31, 32, 33, 10, 11, 19]]
    assert rows.targets.tolist() == [[11, 12, 13, 14, 15, 31, 32, 33, 34, 11, 19, 16]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3, 0, 1, 2]]
    assert rows.doc_ids.tolist() == [[-1, -1, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3]]
    assert rows.group_ids.tolist() == [[0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1]]
    assert rows.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1]]
    assert rows.advantages.tolist() == [[0, 0, 0.5, 0.5, -1.0, 2.0, 2.0, 2.0, 2.0, -0.25, -0.25, -0.25]]
    # a 5-token budget holds the pair; at 4 it is split, each part with the prompt again
    assert fit_units(batch, [[0, 1]], 5) == [[0, 1]]
    assert fit_units(batch, [[0, 1]], 4) == [[0], [1]]


def test_prompt_units_when_the_first_episode_of_a_prompt_differs():
    """The first episode of prompt index 0 has another prompt than the next two (which share one);
    one-token prompts never share; index 2's pair shares although index 0 has the same tokens."""
    batch = _episode_batch(
        prompts=[[10, 11, 19], [10, 11, 12], [10, 11, 12], [7], [7], [10, 11, 12], [10, 11, 12]],
        completions=[[1]] * 7,
        advantages=[0.0] * 7,
    )
    batch.prompt_index = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    assert prompt_units(batch) == [[0], [1, 2], [3], [4], [5, 6]]


def test_plan_micro_batches_first_fit_decreasing():
    # lengths 5 2 7 3 4 into 8-token micro-batches: 7 -> [7]; 5 -> [5]; 4 -> [4]; 3 -> 5 + 3; 2 -> 4 + 2
    assert plan_micro_batches([5, 2, 7, 3, 4], 8) == [[2], [0, 3], [4, 1]]
    assert plan_micro_batches([3, 3], 8) == [[0, 1]]
    assert plan_micro_batches([], 8) == []
    with pytest.raises(ValueError, match=r"training.micro_batch_tokens \(8\) is smaller than an episode of 9 tokens"):
        plan_micro_batches([3, 9], 8)
