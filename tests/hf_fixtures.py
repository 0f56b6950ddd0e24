"""A small HF tokenizer and checkpoint built in the tests: a byte-level BPE trained on the GSM8K-format
fixture plus chat markup, with a Qwen-style chat template, and a tiny random Qwen3 to match it."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_sample.jsonl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
SYSTEM = "Solve the problem. End with #### and the number."


def build_tokenizer(folder: Path) -> Path:
    """Train the BPE, save it as an HF tokenizer folder with the chat template; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rows = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
    corpus = [r["question"] for r in rows] + [r["answer"] for r in rows]
    corpus += [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(folder))
    return folder


def build_checkpoint(folder: Path) -> Path:
    """A tiny random Qwen3 (tied embeddings) sized to the tokenizer, saved with it as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder
