"""Prompt datasets from files: JSONL/Parquet records, chat-template rendering, and a seeded,
epoch-shuffled `PromptDataset` of `grpo.data.digits.Prompt`s with a held-out split (the tokenizer is in
grpo/data/tokenizer.py).

Everything here runs offline. pyarrow is imported only when a Parquet file is read.
"""

from __future__ import annotations

import json
import random
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo.config.sections import TooLong
from grpo.data.prompt import Prompt
from grpo.data.tokenizer import HFTokenizer

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")
# ---------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------


def read_records(path: str | Path, prompt_field: str = "question", answer_field: str = "answer") -> list[dict]:
    """Records of a `.jsonl` file, a `.parquet` file, or a folder of them (files sorted by name).

    Each record is `{"text": str, "answer": str, "metadata": {other fields}, "source": "file:line"}`
    (Parquet sources say `file:row N`, 1-based). Non-string answers (e.g. ints) become strings.
    In a folder, files of other extensions and names starting with "." or "_" are ignored.
    Errors are one-line ValueErrors (FileNotFoundError for a missing path) that name the file.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"dataset path {str(root)!r} does not exist")
    if root.is_dir():
        files = sorted(
            p for p in root.iterdir()
            if p.is_file() and p.suffix.lower() in SUPPORTED_EXTENSIONS and not p.name.startswith((".", "_"))
        )
        if not files:
            raise ValueError(f"empty dataset: no .jsonl or .parquet files in folder {str(root)!r}")
    else:
        if root.suffix.lower() not in SUPPORTED_EXTENSIONS:
            raise ValueError(
                f"unsupported dataset file extension {root.suffix or '(none)'!r} of {str(root)!r}; "
                f"expected one of {', '.join(SUPPORTED_EXTENSIONS)}"
            )
        files = [root]
    records: list[dict] = []
    for file in files:
        if file.suffix.lower() == ".jsonl":
            records.extend(_read_jsonl(file, prompt_field, answer_field))
        else:
            records.extend(_read_parquet(file, prompt_field, answer_field))
    if not records:
        raise ValueError(f"empty dataset: no records in {str(root)!r}")
    return records


def _record(row: Any, where: str, prompt_field: str, answer_field: str) -> dict:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in (prompt_field, answer_field):
        if row.get(name) is None:
            raise ValueError(f"{where}: missing field {name!r}" + (" (null)" if name in row else ""))
    text = row[prompt_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {prompt_field!r} must be a string, got {type(text).__name__}")
    answer = row[answer_field]
    metadata = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
    return {"text": text, "answer": answer if isinstance(answer, str) else str(answer), "metadata": metadata, "source": where}


def _read_jsonl(file: Path, prompt_field: str, answer_field: str) -> list[dict]:
    records = []
    with open(file, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                # Some editors (Notepad, Excel exports) open a UTF-8 file with a byte-order mark.
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{file} line {line_number} is not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1})"
                ) from None
            if not line.strip():
                continue
            where = f"{file}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"malformed JSON in {file} line {line_number}: {error.msg} (column {error.colno})") from None
            records.append(_record(row, where, prompt_field, answer_field))
    return records


def _read_parquet(file: Path, prompt_field: str, answer_field: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for corrupt files
        raise ValueError(f"could not read Parquet file {file}: {str(error).strip().splitlines()[0]}") from None
    for name in (prompt_field, answer_field):
        if name not in table.column_names:
            raise ValueError(f"{file}: missing field {name!r} (columns: {', '.join(table.column_names)})")
    return [
        _record(row, f"{file}:row {i}", prompt_field, answer_field)
        for i, row in enumerate(table.to_pylist(), start=1)
    ]


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------


def _as_ids(result: Any) -> list[int]:
    """Token ids from apply_chat_template/encode output: a list, a batch of one, or a BatchEncoding."""
    if isinstance(result, Mapping) or hasattr(result, "input_ids"):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    result = list(result)
    if result and isinstance(result[0], (list, tuple)):
        if len(result) != 1:
            raise ValueError(f"expected the token ids of one prompt, got a batch of {len(result)}")
        result = list(result[0])
    return [int(i) for i in result]


def render_prompt(
    record_text: str,
    tokenizer: Any,
    system_prompt: str = "",
    template: str = "",
    use_chat_template: bool = True,
    enable_thinking: bool | None = None,
    response_prefix: str = "",
) -> list[int]:
    """Prompt token ids of one record, then those of `response_prefix` (encoded on its own, without
    special tokens), the text the model's answer starts with.

    - `template` set: `template.format(prompt=record_text, system=system_prompt)` encoded with the
      tokenizer's default special tokens (e.g. a BOS where the tokenizer adds one).
    - otherwise, `use_chat_template`: the chat template over an optional system message and the user
      message, with the generation prompt (`enable_thinking` is passed only when not None).
    - otherwise: the raw text (`system_prompt + "\\n\\n"` before it when set), encoded the same way.
    `tokenizer` is an `HFTokenizer` or a plain Hugging Face tokenizer.
    """
    hf = tokenizer.hf if isinstance(tokenizer, HFTokenizer) else tokenizer
    opening = _as_ids(hf.encode(response_prefix, add_special_tokens=False)) if response_prefix else []
    if template:
        return _as_ids(hf.encode(template.format(prompt=record_text, system=system_prompt))) + opening
    if use_chat_template:
        if not getattr(hf, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set a prompt template or use_chat_template = false")
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": record_text}
        ]
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return _as_ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)) + opening
    text = f"{system_prompt}\n\n{record_text}" if system_prompt else record_text
    return _as_ids(hf.encode(text)) + opening


# ---------------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------------


class PromptDataset:
    """Rendered prompts of `records` (from `read_records`) with seeded per-epoch shuffling.

    `Prompt.index` is the record's position in file order (stable, also for skipped records, which
    leave gaps). Prompts longer than `max_prompt_tokens` are skipped and counted (`num_skipped`,
    `skipped_indices`) with `too_long="skip"`, or raise a ValueError naming the record with "error".

    `batch(step, count)` returns stream positions [step * count, (step + 1) * count) of a stream of
    epochs, each a permutation of the training prompts; epoch e's permutation comes from
    `random.Random(f"{seed}-epoch-{e}")`. So every training prompt appears exactly once per epoch and
    a batch depends only on (seed, step, count). A batch never repeats a prompt (prompt indices key
    groups): where a batch straddles an epoch boundary, records of the new epoch that the old
    epoch's tail already put in that batch are swapped to later in the new epoch (still once per
    epoch). `round_index > 0` reads an independent stream (seed + round) for extra generation rounds.

    `held_out(n)` (or `num_held_out=n`) reserves n prompts, the last n of a shuffle seeded by
    `f"{seed}-held-out"`, for evaluation; they never appear in training batches. Reserve before the
    first batch.
    """

    def __init__(
        self,
        records: Sequence[Mapping],
        tokenizer: Any,
        *,
        max_prompt_tokens: int,
        system_prompt: str = "",
        template: str = "",
        use_chat_template: bool = True,
        enable_thinking: bool | None = None,
        response_prefix: str = "",
        too_long: TooLong = "skip",
        seed: int = 0,
        num_held_out: int = 0,
    ):
        if too_long not in typing.get_args(TooLong):
            raise ValueError(f"too_long must be one of {typing.get_args(TooLong)}, got {too_long!r}")
        if max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
        if not records:
            raise ValueError("empty dataset: no records")
        self.tokenizer, self.seed, self.max_prompt_tokens = tokenizer, seed, max_prompt_tokens
        self.prompts: list[Prompt] = []
        self.skipped_indices: list[int] = []
        for index, record in enumerate(records):
            token_ids = render_prompt(
                record["text"], tokenizer, system_prompt, template, use_chat_template, enable_thinking, response_prefix
            )
            if len(token_ids) > max_prompt_tokens:
                if too_long == "error":
                    source = f" ({record['source']})" if record.get("source") else ""
                    raise ValueError(
                        f"prompt {index}{source} has {len(token_ids)} tokens, over max_prompt_tokens={max_prompt_tokens}"
                    )
                self.skipped_indices.append(index)
                continue
            self.prompts.append(
                Prompt(index=index, text=record["text"], answer=record["answer"], token_ids=token_ids,
                       metadata=dict(record.get("metadata", {})), response_prefix=response_prefix)
            )
        if not self.prompts:
            raise ValueError(f"every one of the {len(records)} prompts is over max_prompt_tokens={max_prompt_tokens}")
        self._train: list[Prompt] = list(self.prompts)
        self._eval: list[Prompt] = []
        self._num_held_out: int | None = None
        self._orders: dict[tuple[int, int], dict[int, list[int]]] = {}
        self._batched = False
        if num_held_out:
            self.held_out(num_held_out)

    @classmethod
    def from_path(cls, path: str | Path, tokenizer: Any, *, prompt_field: str = "question",
                  answer_field: str = "answer", **kwargs: Any) -> "PromptDataset":
        return cls(read_records(path, prompt_field, answer_field), tokenizer, **kwargs)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped_indices)

    def __len__(self) -> int:
        """Number of training prompts (held-out and skipped ones excluded)."""
        return len(self._train)

    @property
    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts, in file order ([] until `held_out` is called)."""
        return list(self._eval)

    def held_out(self, n: int) -> list[Prompt]:
        """Reserve n prompts for evaluation and return them (file order). Idempotent for the same n."""
        if self._num_held_out is not None:
            if n != self._num_held_out:
                raise ValueError(f"{self._num_held_out} prompts are already held out; cannot hold out {n}")
            return self.eval_prompts
        if self._batched:
            raise ValueError("held_out must be called before the first training batch")
        if not 0 <= n < len(self.prompts):
            raise ValueError(f"cannot hold out {n} of {len(self.prompts)} prompts: at least one must stay for training")
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}-held-out").shuffle(order)
        held = set(order[len(order) - n:]) if n else set()
        self._eval = [p for i, p in enumerate(self.prompts) if i in held]
        self._train = [p for i, p in enumerate(self.prompts) if i not in held]
        self._num_held_out = n
        return self.eval_prompts

    def _order(self, epoch: int, count: int, round_index: int) -> list[int]:
        cache = self._orders.setdefault((count, round_index), {})
        n = len(self._train)
        for e in range(len(cache), epoch + 1):  # the cache holds epochs 0 .. len - 1
            order = list(range(n))
            tag = f"-round{round_index}" if round_index else ""
            random.Random(f"{self.seed}{tag}-epoch-{e}").shuffle(order)
            head = (-(e * n)) % count  # this epoch's items in the batch straddling its start
            if e > 0 and head:
                tail = set(cache[e - 1][n - (count - head):])
                j = head
                for i in range(head):
                    if order[i] in tail:
                        while order[j] in tail:
                            j += 1
                        order[i], order[j] = order[j], order[i]
                        j += 1
            cache[e] = order
        return cache[epoch]

    def batch(self, step: int, count: int, round_index: int = 0) -> list[Prompt]:
        """The `count` training prompts of step `step` (0-based stream position step * count)."""
        n = len(self._train)
        if step < 0 or count <= 0:
            raise ValueError(f"need step >= 0 and count > 0, got step={step}, count={count}")
        if count > n:
            raise ValueError(f"batch of {count} prompts is larger than the {n} training prompts")
        self._batched = True
        start = step * count
        out: list[Prompt] = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, n)
            out.append(self._train[self._order(epoch, count, round_index)[offset]])
        return out
