"""The calculator tool and the tool-calling environment: results and failures as text the model
reads, the tool message rendered by the checkpoint's chat template, and a scripted tool
conversation kept token for token, its final turn scored as the answer."""

from __future__ import annotations

import time

import pytest
import torch

from fixtures.hf import build_tokenizer
from grpo.data.prompt import Prompt
from grpo.data.tokenizer import load_hf_tokenizer
from grpo.engine import Completion, SamplingParams
from grpo.envs import EnvironmentLoadError, make_environment
from grpo.envs.calculator import calculate
from grpo.envs.tools import Calculator, parse_tool_call, tool_message_text
from grpo.rollout.conversation import generate_conversations
from grpo.scoring.scorer import Scorer, score_episodes

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
ANSWER = "The answer is 84."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_hf_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


def test_calculator_results_and_failures_are_text():
    assert [calculate(e) for e in ("2+3*4", "(1234+5678)*3", "7/2", "-3 // 2")] == ["14", "20736", "3.5", "-2"]
    start = time.monotonic()
    for expression in ("__import__('os').system('ls')", "open('f', 'w')", "x", "(1).real"):
        assert calculate(expression).startswith("error: ") and "not allowed" in calculate(expression)
    assert time.monotonic() - start < 0.5  # refused by the check, before any subprocess
    assert calculate("1/0") == "error: ZeroDivisionError: division by zero"
    assert calculate("'a' * 3") == "error: 'a' is not a number"
    digits = str(7**1000)
    assert calculate("7**1000", max_chars=50) == f"{digits[:50]}... ({len(digits) - 50} characters cut)"
    start = time.monotonic()
    assert calculate("9**9**9", timeout_s=1.0) == "error: no result within 1 s"
    assert time.monotonic() - start < 5


def test_calculator_children_are_reused_and_a_stuck_one_is_replaced():
    from grpo.envs import calculator

    memory_mb = 200  # a pool of its own, apart from the other tests' children
    assert calculate("1+1", memory_mb=memory_mb) == "2"
    (first,) = calculator._idle[memory_mb]
    assert calculate("2+2", memory_mb=memory_mb) == "4" and calculator._idle[memory_mb] == [first]
    assert calculate("9**9**9", timeout_s=0.5, memory_mb=memory_mb) == "error: no result within 0.5 s"
    assert first.process.poll() is not None and calculator._idle[memory_mb] == []
    assert calculate("3*3", memory_mb=memory_mb) == "9"
    assert calculator._idle[memory_mb][0].process.pid != first.process.pid


def test_calculator_calls_from_many_threads_get_their_own_results():
    from concurrent.futures import ThreadPoolExecutor

    expressions = [f"{i} * 1000 + {i}" for i in range(64)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(calculate, expressions))
    assert results == [str(i * 1000 + i) for i in range(64)]


def test_parse_tool_call():
    assert parse_tool_call(f"let me compute {CALL}") == ("calculator", {"expression": "12*7"})
    assert parse_tool_call("the answer is 4") is None
    assert parse_tool_call("<tool_call>{calculator: 1}</tool_call>") == "the tool call is not JSON"
    assert parse_tool_call('<tool_call>{"name": "calculator"}</tool_call>') == 'a tool call is {"name": ..., "arguments": {...}}'


def test_the_tool_message_is_the_chat_templates(tokenizer):
    """fixtures/hf.py's ChatML template: `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per message."""
    text = tool_message_text(tokenizer)
    assert (text.closing, text.before, text.after) == ("\n", "<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")


class Scripted:
    """An engine whose model calls the calculator, then answers."""

    def __init__(self, tokenizer):
        end = tokenizer.eos_ids[-1]  # <|im_end|>
        self.turns = [tokenizer.encode(CALL) + [end], tokenizer.encode(ANSWER) + [end]]
        self.calls = 0

    def generate(self, requests, sampling=None):
        tokens = self.turns[self.calls]
        self.calls += 1
        return [Completion(r, list(tokens), [-0.5] * len(tokens), "eos", 1) for r in requests]


def final_turn_is_the_answer(prompt, completion, answer, metadata):
    return float(completion == ANSWER and CALL in metadata["conversation"])


def test_a_tool_conversation_is_token_exact_and_its_last_turn_is_scored(tokenizer):
    prompt_ids = tokenizer.encode("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n")
    prompt = Prompt(0, "What is 12 times 7?", "84", prompt_ids)
    engine = Scripted(tokenizer)
    batch, stats = generate_conversations(engine, Calculator(tokenizer), [prompt], 2, 1, tokenizer, tokenizer.pad_id,
                                          SamplingParams(max_new_tokens=64), max_tokens=200)
    heard = tokenizer.encode("\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n")
    first, second = engine.turns
    want = prompt_ids + first + heard + second
    for i in range(2):
        assert batch.tokens[i, : len(want)].tolist() == want and int(batch.seq_lens[i]) == len(want)
        assert batch.loss_mask[i, : len(want)].tolist() == (
            [False] * len(prompt_ids) + [True] * len(first) + [False] * len(heard) + [True] * len(second))
    assert stats.turns == [2, 2] and batch.model_turns.tolist() == [2, 2] and not batch.truncated.any()
    assert batch.tool_calls.tolist() == [1, 1] and batch.tool_errors.tolist() == [0, 0]
    scorer = Scorer(["tests.test_tools:final_turn_is_the_answer"], [1.0], timeout_s=10.0, num_workers=0)
    score_episodes(scorer, batch, {0: prompt}, tokenizer.decode_batch)
    assert torch.equal(batch.rewards, torch.ones(2))


def test_a_call_opened_by_the_response_prefix_is_heard_whole(tokenizer):
    """data.response_prefix puts the opening of the call in the prompt; the environment reads the
    first turn as that opening plus what the model wrote."""
    opening = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
    rest = CALL[len(opening):]
    assert CALL.startswith(opening)
    prompt_ids = tokenizer.encode("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n" + opening)
    prompt = Prompt(0, "What is 12 times 7?", "84", prompt_ids, response_prefix=opening)
    engine = Scripted(tokenizer)
    engine.turns[0] = tokenizer.encode(rest) + [tokenizer.eos_ids[-1]]
    batch, stats = generate_conversations(engine, Calculator(tokenizer), [prompt], 1, 1, tokenizer, tokenizer.pad_id,
                                          SamplingParams(max_new_tokens=64), max_tokens=200)
    assert stats.turns == [2] and batch.tool_calls.tolist() == [1] and batch.tool_errors.tolist() == [0]
    heard = tokenizer.encode("\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n")
    assert batch.tokens[0, : len(prompt_ids) + len(engine.turns[0]) + len(heard)].tolist() == (
        prompt_ids + engine.turns[0] + heard)


def test_a_final_answer_cut_at_the_turn_budget_marks_the_episode_truncated(tokenizer):
    prompt_ids = tokenizer.encode("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n")
    prompt = Prompt(0, "What is 12 times 7?", "84", prompt_ids)
    engine = Scripted(tokenizer)
    cut = tokenizer.encode("The answer is")  # no call, no end of turn: the model ran out of tokens
    engine.turns = [cut]
    engine.generate = lambda requests, sampling=None: [Completion(r, list(cut), [-0.5] * len(cut), "length", 1)
                                                       for r in requests]
    batch, stats = generate_conversations(engine, Calculator(tokenizer), [prompt], 2, 1, tokenizer, tokenizer.pad_id,
                                          SamplingParams(max_new_tokens=len(cut)), max_tokens=200)
    assert stats.turns == [1, 1] and batch.truncated.tolist() == [True, True] and stats.truncated_by_tokens == 2


def test_the_calculator_needs_a_chat_template():
    with pytest.raises(EnvironmentLoadError, match="env.name = 'calculator': the calculator environment needs a "
                                                   "checkpoint's tokenizer"):
        from grpo.data.digits import CharTokenizer

        make_environment("calculator", 0, CharTokenizer())


def test_calculator_replies_close_the_turn_and_count_calls_and_errors(tokenizer):
    """A turn that ended with <|im_end|> gets the rest of the template's closing; one cut by its
    token budget gets the end-of-turn marker too; failures are counted and read by the model."""
    env = Calculator(tokenizer)
    state = env.reset(None)
    end = tokenizer.eos_ids[-1]
    ok = env.step(state, 0, CALL, tokenizer.encode(CALL) + [end])
    bad_call = "<tool_call>{oops}</tool_call>"
    bad = env.step(state, 1, bad_call, tokenizer.encode(bad_call))
    done = env.step(state, 2, ANSWER, tokenizer.encode(ANSWER) + [end])
    assert (ok.tool_calls, ok.tool_errors, bad.tool_calls, bad.tool_errors) == (1, 0, 1, 1)
    assert tokenizer.decode(ok.tokens, skip_special_tokens=False) == "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(bad.tokens, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>tool\nerror: the tool call is not JSON<|im_end|>\n<|im_start|>assistant\n")
    assert done.done and done.tool_calls == 0 and state["calls"] == 2
