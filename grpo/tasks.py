"""Prompt sources read from a file, for a run on an HF checkpoint (the built-in digit tasks are in
data.py, reasoning-gym datasets in gym.py)."""

from __future__ import annotations

from grpo.config import Config
from grpo.data import Prompt
from grpo.datasets import HFTokenizer, PromptDataset


class DataError(ValueError):
    """The prompt file or the checkpoint's tokenizer cannot be used; the message names the culprit."""


class FileTask:
    """Prompts from data.path rendered with the checkpoint's tokenizer, with DigitTask's interface:
    `train_prompts(step, count)` for RL steps 1, 2, ... and `eval_prompts` (held out, never trained on)."""

    def __init__(self, cfg: Config, tokenizer: HFTokenizer):
        d = cfg.data
        thinking = {"default": None, "on": True, "off": False}[d.enable_thinking]
        self.dataset = PromptDataset.from_path(
            d.path,
            tokenizer,
            prompt_field=d.prompt_field,
            answer_field=d.answer_field,
            max_prompt_tokens=d.max_prompt_tokens,
            system_prompt=d.system_prompt,
            template=d.prompt_template,
            enable_thinking=thinking,
            too_long=d.too_long,
            seed=cfg.job.seed,
            num_held_out=cfg.eval.num_prompts,
        )
        self.eval_prompts = self.dataset.eval_prompts
        # prompts over the limit are skipped or refused, so no prompt is longer
        self.max_prompt_tokens = d.max_prompt_tokens

    def train_prompts(self, step: int, count: int, round_index: int = 0) -> list[Prompt]:
        return self.dataset.batch(step - 1, count, round_index)
