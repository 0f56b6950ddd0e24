"""The math-task built-in rewards: math_accuracy, format_reward, length_penalty."""

import importlib.util
import math
import re
import subprocess
import sys

import pytest

from grpo.scoring.calls import load_reward, score_chunk
from rewards import (
    REWARDS,
    RewardError,
    extract_answer,
    format_reward,
    length_penalty,
    math_accuracy,
)

# (completion, reference, expected). Every pair's verdict is mathematically right and math_verify
# agrees where it is consulted (pairs the library gets wrong are left out on purpose).
# Units decision: plain words after a number are units and are ignored ("72 dollars" == 72).
MATH_CASES = [
    # fractions and decimals
    (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    ("So the answer is 3/4", "0.75", 1.0),
    ("so the answer is 1/2.", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{3}{2}}", "1.5", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.333333", 1.0),  # math_verify compares floats to 6 decimals
    (r"\boxed{0.3}", r"\frac{1}{3}", 0.0),
    # LaTeX that needs math_verify
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{50\%}", "0.5", 1.0),
    (r"\boxed{\{2, 1\}}", r"\{1, 2\}", 1.0),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0.0),
    # nested braces inside \boxed, last \boxed wins, truncated \boxed skipped
    (r"\boxed{\frac{\frac{1}{2}}{2}}", "0.25", 1.0),
    (r"First \boxed{3}, then on reflection \boxed{4}.", "4", 1.0),
    (r"First \boxed{3}, then on reflection \boxed{4}.", "3", 0.0),
    (r"It is \boxed{7} ... wait \boxed{\frac{1}{2", "7", 1.0),
    # units (ignored) and currency
    ("She earns 72 dollars.", "72", 1.0),
    (r"\boxed{72 \text{ dollars}}", "72", 1.0),
    ("#### 72 dollars", "72", 1.0),
    (r"The total is \$72.00", "72", 1.0),
    # thousands separators
    ("The total is 1,234", "1234", 1.0),
    (r"\boxed{1234}", "#### 1,234", 1.0),
    ("He has 1,234,567 coins.", "1234567", 1.0),
    ("The total is 1,235", "1234", 0.0),
    # negatives (a binary minus is not a sign)
    ("The temperature is -5 degrees.", "-5", 1.0),
    (r"\boxed{-5}", "#### -5", 1.0),
    ("The change is 5", "-5", 0.0),
    ("10-3=7", "7", 1.0),
    # GSM8K references and completions
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "Natalia sold 48+24 = 72 clips.\n#### 72", 1.0),
    ("#### 72", "72", 1.0),
    ("#### 71", "#### 72", 0.0),
    ("Step 1 gives 12.\n#### 72\nHope that helps, 3 more words.", "72", 1.0),  # #### beats last number
    (r"\boxed{72} and #### 5", "#### 72", 1.0),  # \boxed beats ####
    # last-number fallback
    ("so the answer is 18.", "18", 1.0),
    ("3 + 4 = 7, times 2 is 14", "14", 1.0),
    ("so the answer is 18.", "19", 0.0),
    ("The answer is 3.0", "3", 1.0),
    # an explicit "answer is ..." beats a later number
    ("The answer is 7 apples, not 8.", "7", 1.0),
    ("The answer is 7 apples, not 8.", "8", 0.0),
    ("Answer: 12. Check: 3 * 4 = 12, plus 5 is 17", "12", 1.0),
    ("I first thought the answer was 9, but 2 - 5 gives a final answer of -3", "-3", 1.0),
    ("The final answer is -3, since 2 - 5 = -3 and 4 more", "-3", 1.0),
    # wrong, empty, nothing to extract
    (r"\boxed{73}", "72", 0.0),
    ("", "72", 0.0),
    ("I do not know.", "72", 0.0),
    (r"\boxed{}", "72", 0.0),
    ("The answer is 72", "", 0.0),
]


@pytest.mark.parametrize("completion, reference, expected", MATH_CASES)
def test_math_accuracy(completion, reference, expected):
    assert math_accuracy("prompt", completion, reference, {}) == expected


def test_math_accuracy_table_is_broad():
    assert len(MATH_CASES) >= 30
    assert {e for _, _, e in MATH_CASES} == {0.0, 1.0}


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"x \boxed{\frac{1}{2}} y", r"\frac{1}{2}"),
        (r"\boxed {5}", "5"),
        ("a\n#### 1,234\nb", "1,234"),
        ("so the answer is 18.", "18"),
        ("The answer is 7 apples, not 8.", "7"),
        ("5-3=2", "2"),
        ("x = -5", "-5"),
        ("1/2.", "1/2"),
        (r"half: $\frac{1}{2}$", r"\frac{1}{2}"),
        ("x2 and nothing else", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_reference_without_markers_is_used_whole():
    assert extract_answer(r"\frac{1}{2}", reference=True) == r"\frac{1}{2}"
    assert extract_answer("x^2+1", reference=True) == "x^2+1"
    assert extract_answer("  ", reference=True) is None


@pytest.mark.parametrize(
    "completion",
    ["\\boxed{" * 50, "}" * 100 + "{", "#" * 1000, "\x00\ud800", r"\boxed{\frac{1}{0}}", "1/0", "9" * 5000,
     r"\boxed{" + "x+" * 2000 + "1}", "$$$", r"\boxed{\left(}"],
)
def test_math_accuracy_never_raises(completion):
    assert math_accuracy("", completion, "72", {}) in (0.0, 1.0)
    assert math_accuracy("", "72", completion, {}) in (0.0, 1.0)


def test_format_reward_default_pattern():
    assert format_reward("", "<think>a\nb</think>\n<answer>42</answer>\n", "", {}) == 1.0
    assert format_reward("", "<think></think><answer></answer>", "", {}) == 1.0
    assert format_reward("", "<answer>42</answer>", "", {}) == 0.0
    assert format_reward("", "preamble <think>a</think><answer>42</answer>", "", {}) == 0.0
    assert format_reward("", "<think>a</think><answer>42</answer> trailing", "", {}) == 0.0
    assert format_reward("", "", "", {}) == 0.0


def test_format_reward_custom_pattern():
    meta = {"format_pattern": r".*\\boxed\{.+\}\s*"}
    assert format_reward("", "work\nwork \\boxed{3}", "", meta) == 1.0
    assert format_reward("", "<think>a</think><answer>42</answer>", "", meta) == 0.0
    assert format_reward("", "abc", "", {"format_pattern": "[a-c]+"}) == 1.0
    assert format_reward("", "abcd", "", {"format_pattern": "[a-c]+"}) == 0.0  # whole completion
    with pytest.raises(re.error):
        format_reward("", "abc", "", {"format_pattern": "("})


@pytest.mark.parametrize(
    "completion, metadata, expected",
    [
        ("", {}, 0.0),
        ("x" * 1024, {}, -0.25),
        ("x" * 4096, {}, -1.0),
        ("x" * 10_000, {}, -1.0),
        ("x" * 50, {"length_limit": 100}, -0.5),
        ("x" * 50, {"length_limit": 100, "length_penalty_scale": 0.5}, -0.25),
        ("x" * 500, {"length_limit": 100, "length_penalty_scale": 0.1}, -0.1),
        ("x" * 500, {"length_penalty_scale": 0.0}, 0.0),
    ],
)
def test_length_penalty(completion, metadata, expected):
    value = length_penalty("", completion, "", metadata)
    assert value == pytest.approx(expected)
    assert -1.0 <= value <= 0.0 and math.copysign(1.0, value) == math.copysign(1.0, expected)


@pytest.mark.parametrize(
    "metadata", [{"length_limit": 0}, {"length_limit": "4096"}, {"length_penalty_scale": 2.0},
                 {"length_penalty_scale": -1.0}]
)
def test_length_penalty_bad_settings(metadata):
    with pytest.raises(ValueError):
        length_penalty("", "abc", "", metadata)


def test_load_builtins():
    for name, fn in [("math_accuracy", math_accuracy), ("format_reward", format_reward),
                     ("length_penalty", length_penalty)]:
        assert REWARDS[name] is fn
        assert load_reward(name) is fn
        assert load_reward(f"rewards:{name}") is fn
    assert "digit_match" in REWARDS
    builtins = "digit_match, env_reward, format_reward, length_penalty, math_accuracy, reasoning_gym"
    with pytest.raises(RewardError, match=f"built-ins: {builtins}"):
        load_reward("math_acc")


def test_score_chunk_with_math_builtins():
    completions = [r"\boxed{72}", "no idea", "<think>t</think><answer>5</answer>"]
    answers = ["#### 72", "#### 72", "5"]
    args = (["p"] * 3, completions, answers, [{}] * 3)
    assert score_chunk("math_accuracy", 0, *args) == ([1.0, 0.0, 1.0], None, 0, None)
    assert score_chunk("format_reward", 0, *args) == ([0.0, 0.0, 1.0], None, 0, None)
    rewards, error, _, _ = score_chunk("length_penalty", 0, *args)
    assert error is None and all(-1.0 <= r <= 0.0 for r in rewards)


def test_rewards_module_does_not_import_math_verify():
    code = "import sys, rewards; assert 'math_verify' not in sys.modules and 'sympy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_math_accuracys_warm_up_imports_math_verify():
    """What a reward worker runs as it starts (rewards.py, grpo/scoring/calls.py warm_up): math_verify
    is loaded and has parsed before the first episode arrives."""
    pytest.importorskip("math_verify")
    code = ("import sys, rewards; rewards.math_accuracy.warm_up(); "
            "assert 'math_verify' in sys.modules and 'latex2sympy2_extended' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_a_missing_math_verify_is_an_error_not_a_wrong_answer(monkeypatch):
    """Without math-verify, an answer only it can judge raises ImportError (the scorer reports it
    as the function's failure), and a run naming math_accuracy stops at its config check."""
    from grpo.config import ConfigError, load_config

    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    assert math_accuracy("", "#### 72", "#### 72", {}) == 1.0  # equal strings need no math_verify
    with pytest.raises(ImportError):
        math_accuracy("", r"\boxed{\sqrt{4}}", "#### 2", {})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^rewards.functions names math_accuracy, which needs the math-verify "
                                          r"package \(a dependency of tandem\): pip install math-verify$"):
        load_config(['--rewards.functions=["math_accuracy"]'], world_size=2)
    load_config(['--rewards.functions=["digit_match"]'], world_size=2)  # other functions do not need it
