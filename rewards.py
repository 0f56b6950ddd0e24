"""Reward functions: the built-ins, and the contract a function of your own meets.

A reward function scores one episode: ``fn(prompt, completion, answer, metadata) -> float``.
A function decorated with ``@rewards.batched`` (any callable with ``batched = True``) instead scores
a whole chunk at once: ``fn(prompts, completions, answers, metadata) -> list[float]`` (lists, one
entry per episode). Either kind may be ``async def``: a chunk's coroutines are awaited concurrently
(``asyncio.gather``) inside ``asyncio.run``, so async functions must not be called from code that is
already running an event loop (e.g. a Scorer with ``num_workers == 0`` used inside one).
A function may also carry ``fn.warm_up``, a callable without arguments that each scorer worker runs
once as it starts, before any episode (``math_accuracy``'s imports and exercises math_verify), so
that the first episodes scored do not pay for a library's start-up.
``completion`` is the decoded model output with the EOS stripped; ``answer`` and ``metadata``
come from the prompt source. Functions run in worker processes, so they must be importable
module-level callables. Scorer workers import this module to run them, so at module level it
imports only the standard library and grpo.errors (which imports nothing); ``math_accuracy``
imports ``math_verify`` on first use.

Built-ins (see ``REWARDS``): ``digit_match`` (the digit tasks), ``env_reward`` (the reward a
multi-turn episode's environment gave), ``math_accuracy`` (final-answer
equivalence for math word problems), ``format_reward`` (regex layout check),
``length_penalty`` (a non-positive length shaping term) and ``reasoning_gym`` (a reasoning-gym
dataset's own ``score_answer``; imports ``reasoning_gym`` on first use). How a function is loaded
and called on a chunk of episodes, and how its failures are reported, is grpo/scoring/calls.py.
"""

import functools
import numbers
import re
import threading
from collections.abc import Callable
from fractions import Fraction

from grpo.errors import TandemError

RewardFn = Callable[[str, str, str, dict], float]


class RewardError(TandemError, ValueError):
    """A reward function cannot be loaded or failed on episodes; the message names it."""


def batched(fn):
    """Mark ``fn`` as a batch reward function: it is called once per chunk of episodes as
    ``fn(prompts, completions, answers, metadata)`` with lists, and returns one number per episode.
    It may be ``async def``. Returns ``fn`` itself with ``fn.batched = True``."""
    fn.batched = True
    return fn


def digit_match(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """The built-in digit tasks' reward: positional agreement with the reference answer.

    Partial credit per position: the reward is the number of positions where completion and
    answer agree, divided by max(len(answer), len(completion)), so it lies in [0, 1] and an
    output that is too long or too short is penalised through the max(). An empty completion
    scores 0.

    Any policy that ignores the prompt's digits (even one that knows its length) scores at most
    0.1 in expectation on uniformly random digits: each position matches with probability 1/10.
    A mean reward clearly above 0.1 therefore means the policy reads the prompt.
    """
    matches = sum(c == a for c, a in zip(completion, answer))
    length = max(len(answer), len(completion))
    return matches / length if length else 0.0


def env_reward(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """The reward the episode's environment gave (multi-turn runs, env.name); an episode that
    ended without one (a turn or token budget cut it short) scores 0."""
    if "env_reward" not in metadata:
        raise RewardError("env_reward: the episode carries no environment reward field; it scores multi-turn runs (env.name)")
    reward = metadata["env_reward"]
    return 0.0 if reward is None else float(reward)


# --- math_accuracy ------------------------------------------------------------------------------

# A number as written in running text: an optional minus sign (not a binary minus, i.e. not after
# a word character or closing bracket), then \frac{a}{b} / \dfrac / \tfrac, or an integer
# (optionally with thousands separators, 1,234,567) with an optional decimal part and an
# optional "/b" making it a simple fraction. Digits glued to a word or a dot ("x2", ".5")
# do not start a number.
_NUMBER = re.compile(
    r"""
    (?:(?<![\w)\]}])-)?
    (?<![\w.])
    (?:
        \\[dt]?frac\{\d+\}\{\d+\}
      | (?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?(?:/\d+(?!\d|[.,]\d))?
    )
    """,
    re.VERBOSE,
)
_LATEX_FRAC = re.compile(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")
# "the answer is 7", "Answer: 7", "an answer of 7", "final answer = 7" (any case); the number follows it
_ANSWER_PHRASE = re.compile(r"\banswers?\s*(?:is|was|of|=|:)\s*", re.IGNORECASE)
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# "<number> <plain words>", e.g. "72 dollars": the words are taken to be units and dropped.
# Words need two or more letters so that "3 x" (a product) is left alone.
_NUMBER_WITH_UNITS = re.compile(r"(\\?\$?\s*-?[\d.,/]+)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]{2,})*\.?")
# Extracted answers longer than this skip math_verify (sympy can be very slow on huge inputs).
_MAX_ANSWER_CHARS = 1000


def _last_boxed(text: str) -> str | None:
    """Contents of the last complete ``\\boxed{...}`` (balanced, nested braces allowed)."""
    end = len(text)
    while (start := text.rfind("\\boxed", 0, end)) >= 0:
        end = start
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text) or text[i] != "{":
            continue
        depth = 0
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j]
        # unbalanced (e.g. a truncated generation): try an earlier \boxed
    return None


def _gsm8k_answer(text: str) -> str | None:
    """The rest of the line after the last ``####``."""
    start = text.rfind("####")
    if start < 0:
        return None
    return text[start + 4 :].split("\n", 1)[0]


def _last_number(text: str) -> str | None:
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return last.group(0) if last else None


def _stated_answer(text: str) -> str | None:
    """The first number after the last explicit "answer is / answer: / answer =" phrase, so that
    "The answer is 7 apples, not 8." reads 7."""
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if not phrases:
        return None
    number = _NUMBER.search(text, phrases[-1].end())
    return number.group(0) if number else None


def _clean(answer: str) -> str:
    """Strip whitespace, a trailing period and trailing unit words ("72 dollars" -> "72")."""
    answer = answer.strip()
    if m := _NUMBER_WITH_UNITS.fullmatch(answer):
        answer = m.group(1)
    return answer.strip().rstrip(".").strip()


def extract_answer(text: str, *, reference: bool = False) -> str | None:
    """A final answer from ``text``, or None; see ``math_accuracy`` for the order tried."""
    for candidate in (_last_boxed(text), _gsm8k_answer(text)):
        if candidate is not None and (candidate := _clean(candidate)):
            return candidate
    if reference:
        return _clean(text) or None
    number = _stated_answer(text)
    if number is None:
        number = _last_number(text)
    return _clean(number) if number is not None else None


def _normalize(answer: str) -> str:
    """Cheap canonical form for the pre-check: no ``$``, spaces, trailing period, or thousands commas."""
    s = answer.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "")
    s = "".join(s.split()).rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def _as_number(s: str) -> Fraction | None:
    """``s`` (already normalized) as an exact rational if it is a plain number, else None."""
    if m := _LATEX_FRAC.fullmatch(s):
        sign, num, den = m.groups()
        s = f"{sign}{num}/{den}"
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _math_verify_equal(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    # math_verify times out through signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parsed(answer: str) -> list:
        result = parse(f"${answer}$", parsing_timeout=timeout)
        return result or parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)

    gold_parsed = parsed(gold)
    pred_parsed = parsed(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def answers_equivalent(gold: str, pred: str) -> bool:
    """Whether two extracted answers are mathematically equivalent; raises only when math_verify is
    needed and cannot be imported."""
    try:
        g, p = _normalize(gold), _normalize(pred)
        if not g or not p:
            return False
        if g == p:
            return True
        g_num, p_num = _as_number(g), _as_number(p)
        if g_num is not None and p_num is not None:
            if g_num == p_num:
                return True
            if g_num.denominator == 1 and p_num.denominator == 1:
                return False  # distinct integers: no need for sympy
        if len(gold) > _MAX_ANSWER_CHARS or len(pred) > _MAX_ANSWER_CHARS:
            return False
        return _math_verify_equal(gold, pred)
    except ImportError:
        raise  # a missing math-verify is a broken install, not a wrong answer
    except Exception:
        return False


def math_accuracy(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to the reference, else 0.0.

    The completion's final answer is the first of these that gives a non-empty answer:

    1. the contents of the last complete ``\\boxed{...}`` (balanced braces, so nested braces such
       as ``\\boxed{\\frac{1}{2}}`` work; an unbalanced, truncated one is skipped);
    2. the GSM8K form: the rest of the line after the last ``####``;
    3. the first number after the last explicit "answer is" / "answer of" / "answer:" / "answer =" phrase
       ("The answer is 7 apples, not 8." reads 7);
    4. the last number in the text: integers, decimals, negatives (``-5``, but not the binary
       minus in ``5-3``), thousands separators (``1,234``), simple fractions (``3/4``) and
       ``\\frac{a}{b}``.

    The reference answer is extracted the same way by steps 1 and 2 (``"... #### 72"``); a
    reference with neither is used whole (``"72"``, ``"\\frac{1}{2}"``, ``"0.5"``), not reduced to
    its last number.

    Units: plain words after a number are dropped, so ``"72 dollars"`` (and ``"#### 72 dollars"``,
    ``"\\boxed{72 \\text{ dollars}}"``) matches a reference of ``72``. A leading ``$``/``\\$`` is
    ignored too.

    Equivalence: first a cheap check on normalized strings (no ``$``, spaces, trailing period or
    thousands separators): equal strings, or equal exact rationals when both are plain numbers,
    score 1.0; two distinct integers score 0.0. Anything else goes to ``math_verify``
    (``verify(parse(gold), parse(pred))`` with each answer wrapped as ``$...$``), which handles
    LaTeX, ``\\sqrt``, ``\\%``, sets, intervals, matrices and symbolic expressions, and compares
    floats rounded to 6 decimals (so ``0.333333`` matches ``1/3``). Answers over 1000 characters
    skip math_verify and score 0.0.

    No extractable answer (empty completion, no number) or any parsing failure scores 0.0; it
    raises only when math_verify is needed and cannot be imported (a broken install, which a run's
    config check reports before it starts). ``prompt`` and ``metadata`` are unused.
    """
    try:
        gold = extract_answer(answer or "", reference=True)
        pred = extract_answer(completion or "")
    except Exception:
        return 0.0
    if gold is None or pred is None:
        return 0.0
    return 1.0 if answers_equivalent(gold, pred) else 0.0


def _warm_up_math_verify() -> None:
    """Import math_verify and run its parser and comparison on a few kinds of answers (numbers,
    fractions, expressions, intervals, sets, roots, stray text): its first calls in a process cost
    0.3-0.7 s more than later ones (imports, parser set-up), which a pool worker would otherwise
    pay in the middle of a step's scoring."""
    examples = (("\\frac{1}{2}", "0.5"), ("x + 1", "1 + x"), ("(1, 2]", "(1,2]"), ("\\{1, 2\\}", "\\{2, 1\\}"),
                ("\\sqrt{2}", "1.41421356"), ("18", "7 apples and x"), ("18", "ab\x1cc d"))
    for gold, pred in examples:
        answers_equivalent(gold, pred)


math_accuracy.warm_up = _warm_up_math_verify


# --- format_reward -------------------------------------------------------------------------------

DEFAULT_FORMAT_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$"


def format_reward(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """1.0 if the whole completion matches a layout regex, else 0.0.

    The regex is ``metadata["format_pattern"]`` if present, else ``DEFAULT_FORMAT_PATTERN``
    (``<think>...</think>`` then ``<answer>...</answer>``, whitespace around allowed). It must
    match the whole completion (``re.fullmatch``) with ``re.DOTALL``, so ``.`` spans lines. An
    invalid pattern raises ``re.error`` (a configuration error, reported by the scorer).
    """
    pattern = (metadata or {}).get("format_pattern") or DEFAULT_FORMAT_PATTERN
    return 1.0 if re.fullmatch(pattern, completion, re.DOTALL) else 0.0


# --- length_penalty ------------------------------------------------------------------------------


def length_penalty(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """A non-positive shaping term: ``-scale * min(1, len(completion) / limit)``, in [-1, 0].

    Length is in characters of the decoded completion. ``limit`` is
    ``metadata.get("length_limit", 4096)`` (must be > 0); ``scale`` is
    ``metadata.get("length_penalty_scale", 1.0)`` (must be in [0, 1]; for a stronger penalty
    raise this function's weight instead). An empty completion scores 0.0 (-0.0 is returned as
    0.0); one of ``limit`` characters or more scores ``-scale``. Bad settings raise ValueError.
    """
    metadata = metadata or {}
    limit = metadata.get("length_limit", 4096)
    scale = metadata.get("length_penalty_scale", 1.0)
    if not (isinstance(limit, numbers.Real) and limit > 0):
        raise ValueError(f"length_limit must be a positive number, got {limit!r}")
    if not (isinstance(scale, numbers.Real) and 0 <= scale <= 1):
        raise ValueError(f"length_penalty_scale must be in [0, 1], got {scale!r}")
    return -float(scale) * min(1.0, len(completion) / limit) + 0.0


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def reasoning_gym(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """reasoning-gym's own verifier: the prompt's dataset (``data.path = "reasoning_gym:NAME"``)
    scores the completion with its ``score_answer``.

    The answer handed over is the text of the last ``<answer>...</answer>`` in the completion (the
    reasoning-gym convention); without one, the final answer as ``math_accuracy`` reads it (boxed,
    ``####``, "the answer is ...", the last number); failing that, the whole completion, stripped.
    """
    spec = (metadata or {}).get("reasoning_gym")
    if spec is None:
        raise ValueError("the reasoning_gym reward scores prompts from data.path = 'reasoning_gym:NAME' only")
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        candidate = tagged[-1].strip()
    else:
        candidate = extract_answer(completion) or completion.strip()
    dataset = _gym_dataset(spec["dataset"], tuple(sorted(spec["config"].items())))
    return float(dataset.score_answer(answer=candidate, entry=spec["entry"]))


@functools.cache
def _gym_dataset(name: str, options: tuple):
    """A dataset instance to score with (score_answer reads only its config, not its problems)."""
    from reasoning_gym import create_dataset

    return create_dataset(name, size=1, seed=0, **dict(options))


REWARDS: dict[str, RewardFn] = {
    "digit_match": digit_match,
    "env_reward": env_reward,
    "math_accuracy": math_accuracy,
    "format_reward": format_reward,
    "length_penalty": length_penalty,
    "reasoning_gym": reasoning_gym,
}
