"""reasoning-gym as a prompt source and a reward (grpo/data/gym.py, rewards.reasoning_gym): problems
from reasoning-gym itself, deterministic by seed, held out from a seed of their own; config keys
checked against the dataset's config class; rewards from the dataset's own score_answer."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

import rewards
from grpo.config import ConfigError, load_config
from grpo.data.gym import HELD_OUT_SEED_OFFSET, check_gym_config, gym_records
from grpo.data.sources import GymSource

reasoning_gym = pytest.importorskip("reasoning_gym")

SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_records_are_reasoning_gyms_own_problems_by_seed():
    records = gym_records("chain_sum", SUMS, size=5, seed=3)
    dataset = reasoning_gym.create_dataset("chain_sum", size=5, seed=3, **SUMS)
    assert [r["text"] for r in records] == [dataset[i]["question"] for i in range(5)]
    assert [r["answer"] for r in records] == [str(dataset[i]["answer"]) for i in range(5)]
    assert records[2]["metadata"]["reasoning_gym"] == {"dataset": "chain_sum", "config": SUMS, "entry": dataset[2]}
    assert gym_records("chain_sum", SUMS, size=5, seed=3) == records
    assert [r["text"] for r in gym_records("chain_sum", SUMS, size=5, seed=4)] != [r["text"] for r in records]


class CharCodes:
    """Enough of a tokenizer for a "{prompt}" template: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 251 + 1 for c in text]


def _cfg(steps: int = 3, prompts: int = 4, held_out: int = 40, seed: int = 0):
    data = SimpleNamespace(path="reasoning_gym:chain_sum", reasoning_gym=SUMS, prompts_per_step=prompts,
                           enable_thinking="default", max_prompt_tokens=512, system_prompt="", response_prefix="",
                           prompt_template="{prompt}", too_long="error")
    return SimpleNamespace(data=data, job=SimpleNamespace(seed=seed), eval=SimpleNamespace(num_prompts=held_out),
                           training=SimpleNamespace(steps=steps))


def test_held_out_problems_are_never_trained_on():
    # one-digit sums and differences: few distinct problems, so the two seeds' draws overlap
    task = GymSource(_cfg(steps=10, prompts=8, held_out=40), CharCodes())
    held_out = {p.text for p in task.eval_prompts}
    assert len(task.eval_prompts) == 40 and all(p.index < 0 for p in task.eval_prompts)
    expected = [r["text"] for r in gym_records("chain_sum", SUMS, 40, HELD_OUT_SEED_OFFSET)]
    assert [p.text for p in task.eval_prompts] == expected
    trained = [p for step in range(1, 11) for p in task.train_prompts(step, 8)]
    assert trained and not held_out & {p.text for p in trained}
    overlap = {r["text"] for r in gym_records("chain_sum", SUMS, 80, 0)} & held_out
    assert overlap, "the seeds' draws should overlap here, or the test shows nothing"
    again = GymSource(_cfg(steps=10, prompts=8), CharCodes())
    assert [p.text for p in task.train_prompts(2, 8)] == [p.text for p in again.train_prompts(2, 8)]


@pytest.mark.parametrize(
    "path, options, message",
    [
        ("reasoning_gym:chain_summ", {}, r"has no dataset 'chain_summ' \(did you mean 'reasoning_gym:chain_sum'\?\)"),
        ("reasoning_gym:chain_sum", {"min_digit": 1},
         r"data.reasoning_gym.min_digit is not a config key .* \(did you mean 'min_digits'\?\)"),
        ("reasoning_gym:chain_sum", {"zzz": 1}, r"\(chain_sum takes: min_terms, max_terms, min_digits"),
        ("reasoning_gym:chain_sum", {"min_digits": 3, "max_digits": 2},
         r"refused by reasoning-gym's 'chain_sum': max_digits must be >= min_digits"),
    ],
)
def test_bad_gym_settings_get_one_line(path, options, message):
    with pytest.raises(ValueError, match=message):
        check_gym_config(path, options)


def test_a_missing_package_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    with pytest.raises(ValueError, match=r"needs the reasoning-gym package: pip install -e '.\[reasoning-gym\]'"):
        check_gym_config("reasoning_gym:chain_sum", {})


def test_gym_options_without_a_gym_path_are_refused():
    with pytest.raises(ConfigError, match="data.reasoning_gym is set but data.path does not name a reasoning-gym dataset"):
        load_config(["--data.reasoning_gym={min_digits=1}"], world_size=2)


def _entry(seed: int = 5) -> dict:
    return reasoning_gym.create_dataset("chain_sum", size=1, seed=seed, **SUMS)[0]


@pytest.mark.parametrize(
    "completion, candidate",
    [
        ("{answer}", "{answer}"),
        ("The answer is {answer}.", "{answer}"),
        ("First 1, then {answer}", "{answer}"),  # the last number
        ("<answer>{answer}</answer> and later 1234", "{answer}"),  # the tag wins over the last number
        ("<answer>1234</answer> although {answer}", "1234"),
        ("no idea", "no idea"),
    ],
)
def test_reward_is_score_answer_of_the_prompts_dataset(completion, candidate):
    entry = _entry()
    metadata = {"reasoning_gym": {"dataset": "chain_sum", "config": SUMS, "entry": entry}}
    got = rewards.reasoning_gym(entry["question"], completion.format(answer=entry["answer"]), entry["answer"], metadata)
    dataset = reasoning_gym.create_dataset("chain_sum", size=1, seed=0, **SUMS)
    want = dataset.score_answer(answer=candidate.format(answer=entry["answer"]), entry=entry)
    assert got == want and want == (1.0 if candidate == "{answer}" else 0.0)


def test_reward_outside_gym_prompts_is_refused():
    with pytest.raises(ValueError, match="scores prompts from data.path = 'reasoning_gym:NAME' only"):
        rewards.reasoning_gym("q", "1", "1", {})

