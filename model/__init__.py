"""The native bf16 transformer shared by the generator and the trainer."""

from model.args import HFConfigError, ModelArgs, UnsupportedModelError
from model.hf import CheckpointError, from_hf, to_hf
from model.model import TokenLogprobs, Transformer

__all__ = [
    "CheckpointError",
    "HFConfigError",
    "ModelArgs",
    "TokenLogprobs",
    "Transformer",
    "UnsupportedModelError",
    "from_hf",
    "to_hf",
]
