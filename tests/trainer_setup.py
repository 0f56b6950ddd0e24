"""The trainer tests' shared setup: a tiny fp32 model, the optimizer and GRPO settings, and a
hand-made batch of 4 groups x 3 episodes with uneven prompt and completion lengths."""

from __future__ import annotations

import torch

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.rollout.episode import EpisodeBatch
from model import ModelArgs, Transformer
from tests.batches import hand_made_batch

V = 40
ARGS = ModelArgs(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
MAX_NORM = 0.05  # well below the batch's gradient norm: clipping binds
ATOL = 1e-6
# micro_batch_tokens: the whole batch in one micro-batch, or several (the longest episode has 10 input tokens)
WHOLE, SMALL = 1000, 12


def optim_config(max_grad_norm: float = 0.0) -> OptimizerConfig:
    return OptimizerConfig(
        lr=0.5, betas=[0.9, 0.99], eps=1.0, weight_decay=0.01, warmup_steps=0, min_lr_ratio=0.1,
        max_grad_norm=max_grad_norm,
    )


def grpo_config(minibatches: int = 1, num_iterations: int = 1) -> GRPOConfig:
    return GRPOConfig(group_size=3, clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH,
                      num_iterations=num_iterations, minibatches=minibatches)


# 4 groups x 3 samples; prompt lengths per group, completion lengths per episode (uneven on purpose)
PROMPT_LENS = [3, 5, 2, 4]
COMPLETION_LENS = [[2, 1, 3], [4, 2, 6], [7, 5, 3], [1, 6, 2]]
ADVANTAGES = [[1.2, -0.4, -0.8], [0.5, 0.9, -1.4], [-1.1, 0.3, 0.8], [0.0, 1.3, -1.3]]


def make_batch() -> EpisodeBatch:
    """12 episodes, group by group, right-padded with random ids (which must be ignored)."""
    return hand_made_batch(PROMPT_LENS, COMPLETION_LENS, ADVANTAGES, V, seed=123, first_prompt_index=10)


def episodes_of(batch: EpisodeBatch, groups: list[int]) -> list[int]:
    return [i for i in range(len(batch)) if int(batch.prompt_index[i]) - 10 in groups]


def build_model() -> Transformer:
    torch.manual_seed(7)
    model = Transformer(ARGS, dtype=torch.float32)
    model.init_weights(std=0.1)
    return model


def initial_weights():
    return {n: p.detach().clone() for n, p in build_model().named_parameters()}
