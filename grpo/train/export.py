"""HF exports of the policy: the fp32 weights (merged with LoRA's adapters, which go beside them in
PEFT's format) as a folder any HF tool loads, written whole and then renamed."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from grpo.train.checkpoint_folders import one_line
from grpo.train.save_errors import CheckpointSaveError, describe_bytes, error_chain, no_space
from grpo.train.trainer import Trainer
from model import ModelArgs
from model.hf import save_hf
from model.lora import is_adapter, merge_adapters
from model.lora_export import save_peft_adapter


def export_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """About how many bytes one HF export (`export_hf`: fp32 weights) of these parameter shapes takes."""
    return sum(math.prod(shape) for shape in shapes.values()) * 4


def export_hf(
    trainer: Trainer,
    args: ModelArgs,
    tokenizer_save: Callable[[Path], None] | None,
    path: Path,
    is_writer: bool,
    needed_bytes: int = 0,
) -> None:
    """Write the fp32 policy as an HF folder (safetensors, config.json and, when given, the tokenizer
    files via `tokenizer_save(folder)`). With LoRA: the merged model, and the adapters in PEFT's
    format in its adapter/ folder. Collective over the trainer ranks; written whole, then renamed.
    A write that fails (out of space: about `needed_bytes` are needed) removes its temporary folder and
    raises CheckpointSaveError on the writer; the other trainer ranks then lose their peer."""
    weights = ((name, tensor) for name, _, tensor in trainer.full_weights(torch.float32))
    adapters: dict[str, torch.Tensor] = {}
    if trainer.lora is not None:
        weights = merge_adapters(_keep_adapters(weights, adapters), trainer.lora, args.n_layers)
    if not is_writer:
        for _ in weights:
            pass
        return
    tmp = path.with_name(f".tmp-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_hf(args, weights, tmp)
        if trainer.lora is not None:
            save_peft_adapter(args, trainer.lora, adapters, tmp / "adapter")
        if tokenizer_save is not None:
            tokenizer_save(tmp)
    except Exception as error:  # safetensors reports a full disk as its own SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        failed = _export_failed(path, error, needed_bytes)
        if failed is None:
            raise
        raise failed from error
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def _keep_adapters(
    named: Iterator[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass `named` through, keeping a reference to each adapter in `into` on the way."""
    for name, tensor in named:
        if is_adapter(name):
            into[name] = tensor
        yield name, tensor


def _export_failed(path: Path, error: BaseException, needed_bytes: int) -> CheckpointSaveError | None:
    """The one line for an HF export whose write failed; None for an error that is not about the
    disk (a bug keeps its traceback)."""
    free = shutil.disk_usage(path.parent if path.parent.exists() else path.parent.parent).free
    if no_space(error) or free < needed_bytes:
        return CheckpointSaveError(
            f"out of disk space exporting the policy to {path}: it needs about {describe_bytes(needed_bytes)} and "
            f"{describe_bytes(free)} are free; the checkpoints are as they were (free some space, then run the same "
            "command to resume)"
        )
    if not any(isinstance(c, OSError) for c in error_chain(error)):
        return None
    return CheckpointSaveError(f"could not export the policy to {path}: {one_line(error)}")
