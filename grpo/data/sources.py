"""A run's prompt source and tokenizer, chosen from the config: the built-in digit tasks with the
character tokenizer (digits.py), or, on an HF checkpoint, prompt files (`FileSource`) or
reasoning-gym datasets (`GymSource`) rendered with the checkpoint's tokenizer."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo.config import Config
from grpo.data.digits import CharTokenizer, DigitTask
from grpo.data.files import PromptDataset
from grpo.data.gym import HELD_OUT_SEED_OFFSET, PREFIX, gym_records, is_gym_path
from grpo.data.prompt import Prompt, PromptSource, Tokenizer
from grpo.data.tokenizer import HFTokenizer, load_hf_tokenizer
from grpo.errors import TandemError


class DataError(TandemError, ValueError):
    """The prompt file or the checkpoint's tokenizer cannot be used; the message names the culprit."""


def open_prompts(cfg: Config) -> tuple[Tokenizer, PromptSource]:
    """The run's tokenizer and prompt source: model.path's tokenizer with the file or reasoning-gym
    dataset data.path names, or the built-in tokenizer and digit task."""
    d = cfg.data
    if not cfg.model.path:
        tokenizer = CharTokenizer()
        source = DigitTask(d.task, tokenizer, d.digits_min, d.digits_max, cfg.job.seed, cfg.eval.num_prompts)
    else:
        try:
            tokenizer = load_hf_tokenizer(cfg.model.path)
            source = GymSource(cfg, tokenizer) if is_gym_path(d.path) else FileSource(cfg, tokenizer)
        except (ValueError, FileNotFoundError) as error:
            raise DataError(str(error)) from None
    _check_slot_room(cfg, source)
    return tokenizer, source


def _check_slot_room(cfg: Config, source: PromptSource) -> None:
    """A generation.max_seq_len set by hand must hold the longest prompt and its completion: found
    here, before any model is loaded, not at the first generation."""
    g = cfg.generation
    needed = source.max_prompt_tokens + g.max_new_tokens
    if g.max_seq_len and g.max_seq_len < needed:
        where = f"in {cfg.data.path!r}" if cfg.data.path else "of the built-in task"
        raise DataError(
            f"generation.max_seq_len = {g.max_seq_len} cannot hold the longest prompt {where} "
            f"({source.max_prompt_tokens} tokens) and generation.max_new_tokens = {g.max_new_tokens}: "
            f"raise it to at least {needed}, or set it to 0 (sized from the data)"
        )


def _render_options(cfg: Config) -> dict[str, Any]:
    """PromptDataset's rendering and shuffling settings from the config."""
    d = cfg.data
    return dict(
        max_prompt_tokens=d.max_prompt_tokens,
        system_prompt=d.system_prompt,
        response_prefix=d.response_prefix,
        template=d.prompt_template,
        enable_thinking={"default": None, "on": True, "off": False}[d.enable_thinking],
        too_long=d.too_long,
        seed=cfg.job.seed,
    )


class _DatasetSource:
    """`PromptSource` over a PromptDataset: RL step s (1, 2, ...) takes the dataset's batch s - 1."""

    dataset: PromptDataset
    eval_prompts: list[Prompt]

    def _fit(self, prompts: list[Prompt]) -> None:
        """`max_prompt_tokens`: the longest of the rendered prompts the run can draw (at most
        data.max_prompt_tokens, whose longer prompts are skipped or refused). The engine's KV slots
        hold it plus an episode's tokens, so prompts far below the limit leave room for more rows."""
        self.max_prompt_tokens = max(len(p.token_ids) for p in prompts)

    def train_prompts(self, step: int, count: int, round_index: int = 0) -> list[Prompt]:
        return self.dataset.batch(step - 1, count, round_index)

    def _check_enough(self, cfg: Config, left: int) -> None:
        """A step's batch must fit in the `left` training prompts: found now, not after the first evaluation."""
        d = cfg.data
        if left < d.prompts_per_step:
            held = f"eval.num_prompts = {cfg.eval.num_prompts} held out, " if cfg.eval.num_prompts else ""
            raise ValueError(
                f"{d.path!r} leaves {left} training prompts ({held}{self.dataset.num_skipped} skipped as too "
                f"long), fewer than data.prompts_per_step = {d.prompts_per_step}; lower eval.num_prompts "
                "or data.prompts_per_step, or add prompts"
            )


class FileSource(_DatasetSource):
    """Prompts from the JSONL / Parquet file or folder at data.path; eval.num_prompts of them held out."""

    def __init__(self, cfg: Config, tokenizer: HFTokenizer):
        d = cfg.data
        self.dataset = PromptDataset.from_path(
            d.path,
            tokenizer,
            prompt_field=d.prompt_field,
            answer_field=d.answer_field,
            **_render_options(cfg),
        )
        # Checked before holding out: a file too small to hold them out gets the same line.
        self._check_enough(cfg, max(0, len(self.dataset.prompts) - cfg.eval.num_prompts))
        self.eval_prompts = self.dataset.held_out(cfg.eval.num_prompts)
        self._fit(self.dataset.prompts)


class GymSource(_DatasetSource):
    """reasoning-gym problems: training ones from `job.seed`, held-out ones from a seed of their own;
    a training problem whose question is also held out is dropped."""

    def __init__(self, cfg: Config, tokenizer: Any):
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
        self._check_enough(cfg, len(self.dataset))
        self._fit(self.dataset.prompts + self.eval_prompts)
