"""`calculator`, the built-in tool-calling environment: the model calls a tool in its chat template's
tool-call format, the environment runs it and appends the result as a tool message.

A model turn that holds `<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>`
(the Hermes / Qwen format) gets the tool's result back as a tool message, rendered by the
checkpoint's own chat template, followed by the opening of the next assistant turn; a turn without
a call is the final answer and ends the episode (the reward functions score it). A malformed call,
an unknown tool or a failing one is answered with "error: ..." for the model to read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from grpo.data.prompt import Prompt
from grpo.envs.base import EnvReply
from grpo.envs.calculator import calculate

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MARK = "\x00tool-result\x00"
_ASSISTANT = "\x00assistant-turn\x00"


@dataclass
class ToolMessageText:
    """How the chat template wraps a tool result: `closing` ends the model's turn after its
    end-of-turn token, `before` and `after` surround the result and open the next assistant turn."""

    closing: str
    before: str
    after: str


def tool_message_text(tokenizer: Any) -> ToolMessageText:
    """Read the wrapping off the template: a conversation rendered with and without a tool message."""
    hf = tokenizer.hf
    turns = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _ASSISTANT}]
    without = hf.apply_chat_template(turns, tokenize=False)
    with_tool = hf.apply_chat_template([*turns, {"role": "tool", "content": _MARK}], tokenize=False,
                                       add_generation_prompt=True)
    if not with_tool.startswith(without) or _MARK not in with_tool or _ASSISTANT not in without:
        raise ValueError(f"the chat template of {tokenizer.path or 'the tokenizer'} does not render a tool message "
                         "after an assistant turn; the calculator environment needs one")
    closing = without[without.index(_ASSISTANT) + len(_ASSISTANT):]
    end = tokenizer.end_of_turn_token or hf.eos_token or ""
    if end and closing.startswith(end):
        closing = closing[len(end):]
    before, after = with_tool[len(without):].split(_MARK)
    return ToolMessageText(closing, before, after)


def parse_tool_call(text: str) -> tuple[str, dict] | str | None:
    """(tool name, arguments) of the last call in `text`, what is wrong with it, or None: no call."""
    calls = _CALL.findall(text)
    if not calls:
        return None
    try:
        call = json.loads(calls[-1])
    except json.JSONDecodeError:
        return "the tool call is not JSON"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
        return 'a tool call is {"name": ..., "arguments": {...}}'
    return call["name"], call["arguments"]


class Calculator:
    """Tool calls with one tool, `calculator(expression)`; up to `max_turns` model turns."""

    name = "calculator"

    def __init__(self, tokenizer: Any, seed: int = 0, max_turns: int = 4, timeout_s: float = 2.0):
        if not hasattr(tokenizer, "hf"):
            raise ValueError("the calculator environment needs a checkpoint's tokenizer and chat template (model.path)")
        self.tokenizer, self.max_turns, self.timeout_s = tokenizer, max_turns, timeout_s
        self.text = tool_message_text(tokenizer)
        self.end_ids = set(tokenizer.eos_ids)
        self.end_text = tokenizer.end_of_turn_token or tokenizer.hf.eos_token or ""

    def reset(self, prompt: Prompt) -> dict:
        return {"calls": 0}

    def step(self, state: dict, turn: int, completion: str, completion_tokens: list[int]) -> EnvReply:
        call = parse_tool_call(completion)
        if call is None:
            return EnvReply(done=True)
        if isinstance(call, str):
            result = f"error: {call}"
        elif call[0] != "calculator" or set(call[1]) != {"expression"}:
            result = "error: the one tool is calculator(expression: str)"
        else:
            result = calculate(str(call[1]["expression"]), timeout_s=self.timeout_s)
        state["calls"] += 1
        failed = int(result.startswith("error: "))
        ended = bool(completion_tokens) and completion_tokens[-1] in self.end_ids
        closing = self.text.closing if ended else self.end_text + self.text.closing
        text = closing + self.text.before + result + self.text.after
        return EnvReply(tokens=self.tokenizer.encode(text), tool_calls=1, tool_errors=failed)
