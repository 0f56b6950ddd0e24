"""The tokens an adapted environment's messages add to a conversation, in the run's chat template.

Other libraries' environments answer a model turn with chat messages (a tool result, a game's
observation as a user turn). Appended to the episode's one token sequence, they become: the end
of the model's turn as the template closes it, the messages as the template renders them, and the
opening of the next assistant turn (the generation prompt), so the model answers them as it
would in a chat. The wrapping is read off the template itself: a short conversation rendered
with and without the messages after an assistant turn.
"""

from __future__ import annotations

from typing import Any

_MARK = "\x00model-turn\x00"
_STAND_IN = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _MARK}]


class ChatReplies:
    """Renders messages that answer a model turn with an HF tokenizer's chat template."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "has_chat_template", False):
            raise ValueError("needs a checkpoint's tokenizer with a chat template (model.path)")
        self.tokenizer = tokenizer
        self.end_ids = set(tokenizer.eos_ids)
        self.end_text = tokenizer.end_of_turn_token or tokenizer.hf.eos_token or ""

    def text(self, messages: list[dict], model_ended_turn: bool) -> str:
        """What follows the model's turn: its closing (with the end-of-turn marker when the model
        did not sample one, e.g. cut by its token budget), `messages`, the next assistant opening.
        Messages are {"role", "content"} dicts (tool results may add "tool_call_id" and "name")."""
        hf = self.tokenizer.hf
        without = hf.apply_chat_template(_STAND_IN, tokenize=False)
        with_reply = hf.apply_chat_template([*_STAND_IN, *messages], tokenize=False, add_generation_prompt=True)
        if _MARK not in without or not with_reply.startswith(without):
            raise ValueError(f"the chat template of {self.tokenizer.path or 'the tokenizer'} does not render messages "
                             "after an assistant turn as an extension of the conversation before them")
        closing = without[without.index(_MARK) + len(_MARK):]
        if self.end_text and closing.startswith(self.end_text):
            closing = closing[len(self.end_text):]
        return (closing if model_ended_turn else self.end_text + closing) + with_reply[len(without):]

    def tokens(self, messages: list[dict], completion_tokens: list[int]) -> list[int]:
        """`text` encoded: the token ids to append after the model turn `completion_tokens`."""
        ended = bool(completion_tokens) and completion_tokens[-1] in self.end_ids
        return self.tokenizer.encode(self.text(messages, ended))
