"""A Hugging Face tokenizer folder, loaded offline (`local_files_only=True`), behind the small
interface the rest of tandem uses: encode, decode, the vocabulary size, the chat template and the
EOS ids (end-of-turn markers included).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

# End-of-turn markers of common chat templates; one counts as an EOS id when the tokenizer's chat
# template mentions it and the vocabulary holds it as a single token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


class HFTokenizer:
    """A Hugging Face tokenizer with the interface of `grpo.data.digits.CharTokenizer` on top.

    `eos_ids`: `eos_token_id` first, then the chat template's end-of-turn token (e.g. "<|im_end|>")
    when it has one; `eos_id` is the first of them; `pad_id` is `pad_token_id`, or `eos_id` when the
    tokenizer has no pad token. `hf` is the wrapped tokenizer; any other attribute is forwarded to it.
    """

    def __init__(self, hf: Any, path: str | Path = ""):
        self.hf = hf
        self.path = str(path)
        eos_ids: list[int] = []
        if hf.eos_token_id is not None:
            eos_ids.append(int(hf.eos_token_id))
        self.end_of_turn_token: str | None = None
        template = hf.chat_template if isinstance(getattr(hf, "chat_template", None), str) else ""
        for token in END_OF_TURN_TOKENS:
            token_id = _single_token_id(hf, token)
            if token in template and token_id is not None:
                self.end_of_turn_token = token
                if token_id not in eos_ids:
                    eos_ids.append(token_id)
                break
        if not eos_ids:
            raise ValueError(f"tokenizer in {self.path or 'memory'} has no eos_token and no known end-of-turn token")
        self.eos_ids: list[int] = eos_ids
        self.eos_id: int = eos_ids[0]
        self.pad_id: int = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return len(self.hf)

    @property
    def batch_in_rust(self) -> bool:
        """Whether `decode_batch` decodes in one call of the Rust tokenizer (decodes_in_rust)."""
        return decodes_in_rust(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(i) for i in self.hf.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of the ids; special tokens (EOS, end-of-turn, padding) dropped by default."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, id_lists: Sequence[Sequence[int]]) -> list[str]:
        """`decode` of each id list, in one call of the Rust tokenizer where its text is `decode`'s
        (`batch_in_rust`): transformers' `decode` wraps the same Rust decode in Python work at every
        call, half of the time a step took to decode 512 completions (bench/RESULTS.md)."""
        if not self.batch_in_rust:
            return [self.decode(ids) for ids in id_lists]
        return self.hf.backend_tokenizer.decode_batch([list(ids) for ids in id_lists], skip_special_tokens=True)

    def __getattr__(self, name: str) -> Any:
        if name == "hf":  # not yet set (e.g. during unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)


def decodes_in_rust(hf: Any) -> bool:
    """Whether hf.decode(ids, skip_special_tokens=True) is its Rust tokenizer's decode, unchanged:
    a fast tokenizer whose class keeps transformers' own decode and whose text gets no Python
    clean-up of spaces afterwards."""
    if getattr(hf, "backend_tokenizer", None) is None or getattr(hf, "clean_up_tokenization_spaces", True):
        return False
    decode_owner = type(hf).decode.__qualname__.split(".")[0]
    inner_owner = type(hf)._decode.__qualname__.split(".")[0] if hasattr(type(hf), "_decode") else ""
    return decode_owner == "PreTrainedTokenizerBase" and inner_owner in ("TokenizersBackend", "PreTrainedTokenizerFast")


def _single_token_id(hf: Any, token: str) -> int | None:
    """The id of `token` when the vocabulary holds it as one token, else None."""
    try:
        token_id = hf.convert_tokens_to_ids(token)
    except (KeyError, ValueError, TypeError):
        return None
    if token_id is None or isinstance(token_id, list):
        return None
    if hf.unk_token_id is not None and token_id == hf.unk_token_id and token != hf.unk_token:
        return None
    return int(token_id)


def load_hf_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer saved in folder `path` (no network: `local_files_only=True`).

    Raises FileNotFoundError when the folder does not exist and ValueError when it holds no
    tokenizer or the tokenizer cannot be loaded, each naming the folder in one line.
    """
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {str(folder)!r}: expected one of {', '.join(_TOKENIZER_FILES)}")
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers and huggingface_hub raise many classes for a bad folder
        raise ValueError(f"could not load the tokenizer in {str(folder)!r}: {_summary(error)}") from error
    return HFTokenizer(hf, folder)


def _summary(error: Exception) -> str:
    """The error's message on one line: its first line, and the next one too where the first only
    announces it (huggingface_hub's validation errors end their first line with a colon)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
