"""The built-in tokenizer and digit tasks: held-out isolation, answers, and the reward floor."""

from __future__ import annotations

import random

import pytest

from grpo.config import Config
from grpo.data.digits import CharTokenizer, DigitTask
from rewards import digit_match


def task(kind: str = "copy_digits", digits_min: int = 4, digits_max: int = 4, num_eval: int = 64) -> DigitTask:
    return DigitTask(kind, CharTokenizer(), digits_min, digits_max, seed=0, num_eval=num_eval)


def test_tokenizer_round_trip_and_eos():
    tok = CharTokenizer()
    ids = tok.encode("0123456789=")
    assert ids == list(range(1, 12)) and tok.vocab_size == 12
    assert tok.decode(ids + [tok.eos_id]) == "0123456789="
    with pytest.raises(ValueError, match="not in the built-in tokenizer's alphabet"):
        tok.encode("12a")


@pytest.mark.parametrize("kind", ["copy_digits", "reverse_digits"])
def test_answers_and_prompt_tokens(kind):
    t = task(kind, 3, 5)
    for prompt in t.train_prompts(step=1, count=50):
        assert 3 <= len(prompt.text) <= 5 and prompt.text.isdigit()
        assert prompt.answer == (prompt.text if kind == "copy_digits" else prompt.text[::-1])
        assert CharTokenizer().decode(prompt.token_ids) == prompt.text + "="


def test_held_out_prompts_are_never_trained_on():
    t = task(num_eval=256)
    held_out = {p.text for p in t.eval_prompts}
    assert len(held_out) == 256
    trained = {p.text for step in range(1, 400) for p in t.train_prompts(step, 16)}
    assert not held_out & trained
    # Training draws still cover most of the 10k strings: held-out ones are excluded, not the rest.
    assert len(trained) > 4000


def test_step_batches_are_reproducible_and_indexed():
    a, b = task(), task()
    assert [p.text for p in a.train_prompts(7, 16)] == [p.text for p in b.train_prompts(7, 16)]
    assert [p.index for p in a.train_prompts(7, 16)] == list(range(7 * 16, 8 * 16))
    assert [p.text for p in a.train_prompts(7, 16)] != [p.text for p in a.train_prompts(8, 16)]


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown built-in task 'sort_digits'; expected one of copy_digits, reverse_digits"):
        task("sort_digits")


@pytest.mark.parametrize("kind", ["copy_digits", "reverse_digits"])
def test_random_and_prompt_ignoring_policies_score_at_most_0_15(kind):
    """Under the demo's own settings: uniform sampling over the whole vocabulary (EOS included)
    until EOS or max_new_tokens, and the best constant answers, all stay at or below 0.15."""
    cfg = Config()
    tok = CharTokenizer()
    t = task(kind, cfg.data.digits_min, cfg.data.digits_max)
    prompts = t.train_prompts(step=1, count=4000)
    rng = random.Random(0)

    def uniform_policy() -> str:
        ids = []
        for _ in range(cfg.generation.max_new_tokens):
            token = rng.randrange(tok.vocab_size)
            if token == tok.eos_id:
                break
            ids.append(token)
        return tok.decode(ids)

    def mean_reward(policy) -> float:
        return sum(digit_match(p.text, policy(), p.answer, {}) for p in prompts) / len(prompts)

    assert mean_reward(uniform_policy) <= 0.15
    for constant in ("0000", "1234", "9", ""):
        assert mean_reward(lambda: constant) <= 0.15
    assert sum(digit_match(p.text, p.answer, p.answer, {}) for p in prompts) == len(prompts)
