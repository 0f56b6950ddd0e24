"""The prompt sources of a run on an HF checkpoint: prompt files (`FileTask`) and reasoning-gym
datasets (`GymTask`), both rendered with the checkpoint's tokenizer. (The built-in digit tasks are
in digits.py.)"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo.config import Config
from grpo.data.digits import Prompt
from grpo.data.files import PromptDataset
from grpo.data.tokenizer import HFTokenizer
from grpo.data.gym import HELD_OUT_SEED_OFFSET, PREFIX, gym_records, is_gym_path


class DataError(ValueError):
    """The prompt file or the checkpoint's tokenizer cannot be used; the message names the culprit."""


def prompt_source(cfg: Config, tokenizer: HFTokenizer) -> FileTask | GymTask:
    """The source data.path names: a reasoning-gym dataset or a prompt file / folder."""
    return GymTask(cfg, tokenizer) if is_gym_path(cfg.data.path) else FileTask(cfg, tokenizer)


def _render_options(cfg: Config) -> dict[str, Any]:
    """PromptDataset's rendering and shuffling settings from the config."""
    d = cfg.data
    return dict(
        max_prompt_tokens=d.max_prompt_tokens,
        system_prompt=d.system_prompt,
        template=d.prompt_template,
        enable_thinking={"default": None, "on": True, "off": False}[d.enable_thinking],
        too_long=d.too_long,
        seed=cfg.job.seed,
    )


class _DatasetTask:
    """DigitTask's interface over a PromptDataset: `train_prompts(step, count)` for RL steps 1, 2, ...
    and `eval_prompts` (held out, never trained on)."""

    dataset: PromptDataset
    eval_prompts: list[Prompt]

    def __init__(self, cfg: Config):
        # prompts over the limit are skipped or refused, so no prompt is longer
        self.max_prompt_tokens = cfg.data.max_prompt_tokens

    def train_prompts(self, step: int, count: int, round_index: int = 0) -> list[Prompt]:
        return self.dataset.batch(step - 1, count, round_index)


class FileTask(_DatasetTask):
    """Prompts from the JSONL / Parquet file or folder at data.path; eval.num_prompts of them held out."""

    def __init__(self, cfg: Config, tokenizer: HFTokenizer):
        super().__init__(cfg)
        d = cfg.data
        self.dataset = PromptDataset.from_path(
            d.path,
            tokenizer,
            prompt_field=d.prompt_field,
            answer_field=d.answer_field,
            num_held_out=cfg.eval.num_prompts,
            **_render_options(cfg),
        )
        self.eval_prompts = self.dataset.eval_prompts


class GymTask(_DatasetTask):
    """reasoning-gym problems: training ones from `job.seed`, held-out ones from a seed of their own;
    a training problem whose question is also held out is dropped."""

    def __init__(self, cfg: Config, tokenizer: Any):
        super().__init__(cfg)
        d = cfg.data
        name = d.path[len(PREFIX) :]
        render = _render_options(cfg)
        held_out = gym_records(name, d.reasoning_gym, cfg.eval.num_prompts, cfg.job.seed + HELD_OUT_SEED_OFFSET)
        questions = {r["text"] for r in held_out}
        train = [r for r in gym_records(name, d.reasoning_gym, cfg.training.steps * d.prompts_per_step, cfg.job.seed)
                 if r["text"] not in questions]
        if not train:
            raise ValueError(f"every training problem of {d.path!r} is also a held-out one; widen data.reasoning_gym")
        self.dataset = PromptDataset(train, tokenizer, **render)
        # Negative indices: held-out prompts key their sampling apart from every training prompt.
        self.eval_prompts = [
            dataclasses.replace(p, index=-(i + 1))
            for i, p in enumerate(PromptDataset(held_out, tokenizer, **render).prompts)
        ]
