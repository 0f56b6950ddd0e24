"""File datasets: offline HF tokenizer loading, chat-template rendering, JSONL/Parquet records and
their errors, over-long prompts, seeded epoch batches and the held-out split."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from fixtures.hf import FIXTURE, SYSTEM, build_tokenizer
from grpo.data.files import PromptDataset, read_records, render_prompt
from grpo.data.prompt import Prompt
from grpo.data.tokenizer import load_hf_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE trained on the fixture plus chat markup, saved as a Qwen-style HF tokenizer."""
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_hf_tokenizer(tokenizer_dir)


def write_parquet(records: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)


def fixture_rows() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]


# --- tokenizer -----------------------------------------------------------------------------------


def test_load_hf_tokenizer_offline_eos_and_pad(tok, monkeypatch, tokenizer_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = load_hf_tokenizer(tokenizer_dir)
    endoftext, im_end = (tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
    assert tok.eos_ids == [endoftext, im_end] and tok.eos_id == endoftext and tok.pad_id == endoftext
    assert tok.end_of_turn_token == "<|im_end|>"
    assert tok.vocab_size == len(tok.hf)
    ids = tok.encode("Owen walks 3 kilometers.")
    assert tok.decode(ids + [tok.eos_id]) == "Owen walks 3 kilometers."


def test_decode_batch_is_decode_of_each_list_in_rust_or_in_python(tokenizer_dir):
    """The Rust batch call serves a tokenizer whose decode is the Rust decode as is; one that cleans
    up spaces in Python decodes one list at a time. Either way each text is `decode`'s."""
    texts = [row["question"] + " " + row["answer"] for row in fixture_rows()[:40]]
    for clean_up in (True, False):
        tok = load_hf_tokenizer(tokenizer_dir)
        tok.hf.clean_up_tokenization_spaces = clean_up
        assert tok.batch_in_rust is not clean_up
        id_lists = [tok.encode(t) + [tok.eos_id] for t in texts] + [[], [tok.eos_id]]
        assert tok.decode_batch(id_lists) == [tok.decode(ids) for ids in id_lists]
    assert tok.decode_batch(id_lists[: len(texts)]) == texts  # the last one, in Rust: the texts encoded


def test_load_hf_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_tokenizer(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"no tokenizer in .*{tmp_path.name}"):
        load_hf_tokenizer(tmp_path)


def test_any_error_loading_the_tokenizer_is_one_line_naming_the_folder(tokenizer_dir, monkeypatch):
    """transformers and huggingface_hub raise errors of their own classes for a bad folder; one announces
    its cause on its second line."""
    import transformers

    class ForeignValidationError(Exception):
        pass

    def refuse(*args, **kwargs):
        raise ForeignValidationError("Class validation error for validator 'x':\n    ValueError: 32 layers, 2 types\n  more")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    with pytest.raises(ValueError) as info:
        load_hf_tokenizer(tokenizer_dir)
    assert str(info.value) == (
        f"could not load the tokenizer in {str(tokenizer_dir)!r}: "
        "Class validation error for validator 'x': ValueError: 32 layers, 2 types"
    )


# --- rendering -----------------------------------------------------------------------------------


def test_render_prompt_matches_auto_tokenizer_chat_template(tok, tokenizer_dir):
    from transformers import AutoTokenizer

    question = fixture_rows()[3]["question"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers 5 may return a BatchEncoding
        expected = expected["input_ids"]
    ids = render_prompt(question, tok, system_prompt=SYSTEM)
    assert ids == [int(i) for i in expected] and all(type(i) is int for i in ids)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    # the plain HF tokenizer works as well as the wrapper
    assert render_prompt(question, reference, system_prompt=SYSTEM) == ids


def test_render_prompt_thinking_template_and_raw(tok):
    question = "What is 6 * 7?"
    plain = render_prompt(question, tok)
    assert render_prompt(question, tok, enable_thinking=True) == plain
    no_think = tok.decode(render_prompt(question, tok, enable_thinking=False), skip_special_tokens=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "system" not in tok.decode(plain, skip_special_tokens=False)
    templated = render_prompt(question, tok, template="Question: {prompt}\nAnswer:", use_chat_template=True)
    assert tok.decode(templated) == "Question: What is 6 * 7?\nAnswer:"
    assert tok.decode(render_prompt(question, tok, use_chat_template=False)) == question


def test_response_prefix_opens_the_answer_in_every_layout(tok):
    question, opening = "What is 6 * 7?", '<tool_call>{"name": "calculator"'
    opening_ids = tok.hf.encode(opening, add_special_tokens=False)
    for layout in (dict(), dict(template="Question: {prompt}\nAnswer:"), dict(use_chat_template=False)):
        plain = render_prompt(question, tok, **layout)
        assert render_prompt(question, tok, response_prefix=opening, **layout) == plain + opening_ids
    dataset = PromptDataset([{"text": question, "answer": "42"}], tok, max_prompt_tokens=256, response_prefix=opening)
    assert dataset.prompts[0].response_prefix == opening
    assert tok.decode(dataset.prompts[0].token_ids, skip_special_tokens=False).endswith("assistant\n" + opening)


# --- records -------------------------------------------------------------------------------------


def test_jsonl_and_parquet_give_the_same_prompts(tok, tmp_path):
    rows = fixture_rows()
    write_parquet(rows, tmp_path / "sample.parquet")
    from_jsonl = read_records(FIXTURE)
    from_parquet = read_records(tmp_path / "sample.parquet")
    assert len(from_jsonl) == len(rows) == 12
    assert from_jsonl[0]["metadata"] == {"id": "sample-00", "difficulty": 1}
    assert from_jsonl[0]["source"].endswith("gsm8k_sample.jsonl:1")
    a = PromptDataset(from_jsonl, tok, max_prompt_tokens=512, seed=3)
    b = PromptDataset(from_parquet, tok, max_prompt_tokens=512, seed=3)
    assert a.prompts == b.prompts and len(a.prompts) == 12
    p = a.prompts[5]
    assert isinstance(p, Prompt) and p.index == 5 and p.text == rows[5]["question"]
    assert p.answer == rows[5]["answer"] and p.metadata == {"id": "sample-05", "difficulty": 3}
    assert p.token_ids == render_prompt(rows[5]["question"], tok)


def test_folder_of_files_in_name_order_and_custom_fields(tmp_path):
    rows = fixture_rows()
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[6:]))
    write_parquet(rows[:6], tmp_path / "a.parquet")
    (tmp_path / "README.md").write_text("ignored")
    records = read_records(tmp_path)
    assert [r["text"] for r in records] == [r["question"] for r in rows]
    custom = [{"problem": "1+1?", "solution": 2, "level": "easy"}]
    (tmp_path / "custom.jsonl").write_text(json.dumps(custom[0]) + "\n")
    [record] = read_records(tmp_path / "custom.jsonl", prompt_field="problem", answer_field="solution")
    assert record["text"] == "1+1?" and record["answer"] == "2" and record["metadata"] == {"level": "easy"}


def test_record_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n\n{"question": "q2", "answer": \n')
    with pytest.raises(ValueError, match=r"malformed JSON in .*bad\.jsonl line 3"):
        read_records(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"question": "q", "answer": "a"}\n{"question": "q2"}\n')
    with pytest.raises(ValueError, match=r"missing\.jsonl:2: missing field 'answer'"):
        read_records(missing)
    write_parquet([{"question": "q"}], tmp_path / "noanswer.parquet")
    with pytest.raises(ValueError, match=r"noanswer\.parquet: missing field 'answer'"):
        read_records(tmp_path / "noanswer.parquet")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty dataset: no records in .*empty\.jsonl"):
        read_records(empty)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=r"empty dataset: .*empty_dir"):
        read_records(tmp_path / "empty_dir")
    csv = tmp_path / "data.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"unsupported dataset file extension '\.csv'"):
        read_records(csv)
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path / "absent.jsonl")
    for error_path in (bad, missing, empty):  # one-line messages
        with pytest.raises(ValueError) as info:
            read_records(error_path)
        assert "\n" not in str(info.value)


def test_jsonl_may_open_with_a_byte_order_mark(tmp_path):
    marked = tmp_path / "bom.jsonl"
    marked.write_text('{"question": "q1", "answer": "a1"}\n{"question": "q2", "answer": 2}\n', encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    records = [(r["text"], r["answer"], r["source"]) for r in read_records(marked)]
    assert records == [("q1", "a1", f"{marked}:1"), ("q2", "2", f"{marked}:2")]


# --- PromptDataset -------------------------------------------------------------------------------


def test_too_long_skip_and_error(tok):
    records = read_records(FIXTURE)
    lengths = [len(render_prompt(r["text"], tok)) for r in records]
    limit = sorted(lengths)[len(lengths) // 2]
    over = [i for i, n in enumerate(lengths) if n > limit]
    assert over, "the fixture needs prompts of different lengths"
    ds = PromptDataset(records, tok, max_prompt_tokens=limit, seed=0)
    assert ds.num_skipped == len(over) and ds.skipped_indices == over
    assert [p.index for p in ds.prompts] == [i for i in range(len(records)) if i not in over]
    where = rf"prompt {over[0]} \(.*gsm8k_sample\.jsonl:{over[0] + 1}\)"
    with pytest.raises(ValueError, match=rf"{where} has {lengths[over[0]]} tokens, over max_prompt_tokens={limit}"):
        PromptDataset(records, tok, max_prompt_tokens=limit, too_long="error", seed=0)
    with pytest.raises(ValueError, match="over max_prompt_tokens"):
        PromptDataset(records, tok, max_prompt_tokens=1, seed=0)


@pytest.mark.parametrize("count", [4, 5, 12])
def test_batches_reproducible_and_cover_each_epoch(tok, count):
    records = read_records(FIXTURE)
    ds = PromptDataset(records, tok, max_prompt_tokens=512, seed=7)
    again = PromptDataset(records, tok, max_prompt_tokens=512, seed=7)
    other = PromptDataset(records, tok, max_prompt_tokens=512, seed=8)
    n, epochs = len(ds), 5
    steps = n * epochs // count
    batches = [[p.index for p in ds.batch(step, count)] for step in range(steps)]
    assert batches == [[p.index for p in again.batch(step, count)] for step in range(steps)]
    assert batches[3] == [p.index for p in ds.batch(3, count)]  # out of order, same answer
    assert any(b != [p.index for p in other.batch(s, count)] for s, b in enumerate(batches))
    stream = [i for b in batches for i in b]
    for epoch in range(epochs):
        assert sorted(stream[epoch * n:(epoch + 1) * n]) == list(range(n))
    assert all(len(set(b)) == len(b) == count for b in batches)  # no repeats inside a batch
    assert len({tuple(stream[e * n:(e + 1) * n]) for e in range(epochs)}) > 1  # reshuffled per epoch
    extra = [p.index for p in ds.batch(0, count, round_index=1)]
    assert len(set(extra)) == count and extra == [p.index for p in again.batch(0, count, round_index=1)]


def test_held_out_never_in_training_batches(tok):
    records = read_records(FIXTURE)
    ds = PromptDataset(records, tok, max_prompt_tokens=512, seed=1)
    held = ds.held_out(3)
    assert len(held) == 3 and ds.eval_prompts == held and len(ds) == 9
    assert ds.held_out(3) == held
    same = PromptDataset(records, tok, max_prompt_tokens=512, seed=1, num_held_out=3)
    assert same.eval_prompts == held
    held_ids = {p.index for p in held}
    trained = Counter(p.index for step in range(30) for p in ds.batch(step, 4))
    assert not held_ids & set(trained) and set(trained) == {p.index for p in ds.prompts} - held_ids
    with pytest.raises(ValueError, match="already held out"):
        ds.held_out(2)
    fresh = PromptDataset(records, tok, max_prompt_tokens=512, seed=1)
    fresh.batch(0, 4)
    with pytest.raises(ValueError, match="before the first training batch"):
        fresh.held_out(3)
    with pytest.raises(ValueError, match="larger than the 9 training prompts"):
        ds.batch(0, 10)


# --- the engine's KV slots follow the data --------------------------------------------------------


def test_kv_slots_are_sized_from_the_longest_prompt_in_the_data(tmp_path):
    """With generation.max_seq_len = 0 a slot holds the longest rendered prompt of the run (held-out
    ones included) plus the completion, not data.max_prompt_tokens: short prompts leave room for
    more rows in the same KV memory."""
    from fixtures.hf import build_checkpoint, chat_prompt_lengths
    from grpo.config import load_config
    from grpo.data.sources import open_prompts

    checkpoint = build_checkpoint(tmp_path / "hf")
    questions = [f"What is {i} + 1?" + " Think about it." * (i % 5) for i in range(12)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions))
    cfg = load_config(["--parallelism.mode=colocated", "--job.device=cpu", f"--model.path={checkpoint}",
                       f"--data.path={data}", "--eval.num_prompts=4", "--data.prompts_per_step=2"])
    _, source = open_prompts(cfg)
    longest = max(chat_prompt_lengths(checkpoint, questions))
    assert source.max_prompt_tokens == longest < cfg.data.max_prompt_tokens
    # The longest question is among the held-out ones or not: either way every prompt fits.
    assert all(len(p.token_ids) <= longest for p in [*source.dataset.prompts, *source.eval_prompts])
