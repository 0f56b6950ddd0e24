"""Where the engine-trainer log-prob gap comes from, in bf16: one JSON line per variant.

    python3 bench/logprob_gap.py [--model models/SmolLM2-135M-Instruct] [--prompts 16] [--samples 2]

The engine (bf16) samples completions of the GSM8K fixture's questions in the model's chat
template; the trainer (bf16 compute) recomputes their log-probs over its packed micro-batches
(its π_old pass); reported per variant are the mean and largest |difference| and the share of
exactly equal tokens, as `logprob_diff/{mean,max,exact_frac}` define them. The variants change one
precision on both sides at once (an experiment, applied here by patching the two code paths):

- default: everything as it runs today (on CUDA the head's bf16 matmul writes fp32 logits,
  `model.fp32_logits`; on the CPU the logits are bf16);
- bf16_logits: `model.fp32_logits` off, so the logits are rounded to bf16 on CUDA too;
- fp32_logits: the output head's matmul takes fp32 inputs as well (both the engine's decode
  logits and the trainer's log-prob head);
- fp32_attention: attention runs on q, k, v cast to fp32, its output cast back;
- both: the two together.

`--device cuda` runs them on the GPU (the engine with its CUDA graphs and compiled halves, the
trainer eager); there, fp32 attention leaves the flash and decode kernels for PyTorch's SDPA,
which changes the kernel as well as the precision.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import model.attention as attention  # noqa: E402
import model.logprob_head as head  # noqa: E402
import model.model as native  # noqa: E402
from bench.provenance import commit  # noqa: E402
from fixtures.hf import FIXTURE  # noqa: E402
from grpo.config import GRPOConfig, OptimizerConfig  # noqa: E402
from grpo.data.tokenizer import load_hf_tokenizer  # noqa: E402
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams  # noqa: E402
from grpo.rollout.generate import episodes_from_completions  # noqa: E402
from grpo.train.trainer import Trainer  # noqa: E402
from model import ModelArgs, batch_invariant  # noqa: E402
from model.hf import from_hf  # noqa: E402


def _fp32_linear(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@contextlib.contextmanager
def variant(name: str):
    """Patch the head's matmul and / or the attention entry points for the duration."""
    saved = []
    saved_setting = False

    def patch(module, attr, value):
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    if name == "bf16_logits":
        batch_invariant.set_fp32_logits(False)
        saved_setting = True
    if name in ("fp32_logits", "both"):
        # The engine's logits come from Transformer.decode, the trainer's from the log-prob head's F.linear.
        def decode(self, tokens, positions, attend, logits_index=None):
            h = self.decode_hidden(tokens, positions, attend)
            return _fp32_linear(h if logits_index is None else h[logits_index], self.output_weight)

        patch(native.Transformer, "decode", decode)
        patch(head, "_logits", _fp32_linear)
    if name in ("fp32_attention", "both"):
        for fn in ("packed_attention", "varlen_prefill", "slot_decode"):
            original = getattr(attention, fn)

            def upcast(q, k, v, *rest, _original=original):
                return _original(q.float(), k.float(), v.float(), *rest).to(q.dtype)

            patch(attention, fn, upcast)
        patch(native, "packed_attention", attention.packed_attention)
        import grpo.engine.cache as cache

        patch(cache, "varlen_prefill", attention.varlen_prefill)
        patch(cache, "slot_decode", attention.slot_decode)
    try:
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)
        if saved_setting:
            batch_invariant.set_fp32_logits(True)


def gap(opts, args: ModelArgs, requests: list[GenerationRequest], eos: list[int]) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(opts.device)
    policy = from_hf(str(opts.model), dtype=torch.float32, device=device)
    sampling = SamplingParams(max_new_tokens=opts.new_tokens, temperature=1.0)
    engine = NativeEngine(args, sampling, eos_ids=eos, seed=1, dtype=torch.bfloat16, device=device,
                          max_batch_size=len(requests))
    engine.update_weights([[(n, (), p.detach().to(torch.bfloat16)) for n, p in policy.named_parameters()]], 0)
    batch = episodes_from_completions(engine.generate(requests), pad_id=0)
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))
    trainer = Trainer(policy, init_device_mesh(device.type, (1,)), device, torch.bfloat16,
                      GRPOConfig(group_size=opts.samples), OptimizerConfig(), total_steps=1,
                      micro_batch_tokens=4096, temperature=1.0, max_new_tokens=opts.new_tokens)
    # The trainer's π_old pass over its packed micro-batches, compared as its logprob_diff metrics do.
    diffs = []
    with torch.no_grad():
        for micro_batches in trainer._micro_batches(batch):
            for mb in micro_batches:
                old = trainer._forward(mb.rows).logprobs
                live = mb.rows.loss_mask.to(device) > 0
                diffs.append((old - mb.rows.gen_logprobs.to(device)).abs()[live])
    diff = torch.cat(diffs)
    return dict(mean=float(diff.mean()), max=float(diff.max()), exact_frac=float((diff == 0).float().mean()),
                tokens=diff.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--variants", default="default,bf16_logits,fp32_logits,fp32_attention,both")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the engine's and trainer's GPU kernels)")
    opts = parser.parse_args()
    if not (opts.model / "config.json").is_file():
        raise SystemExit(f"{opts.model} is not a model folder; build it with: python scripts/get_smollm2.py")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29514")
    dist.init_process_group("nccl" if opts.device == "cuda" else "gloo", rank=0, world_size=1)
    tokenizer = load_hf_tokenizer(opts.model)
    args = ModelArgs.from_hf_dir(opts.model)
    rows = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()][: opts.prompts]
    prompts = [tokenizer.hf.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True)
               for r in rows]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    requests = [GenerationRequest(p, 0, i, s) for i, p in enumerate(prompts) for s in range(opts.samples)]
    base = dict(bench="logprob_gap", commit=commit(), torch=torch.__version__, device=opts.device, model=opts.model.name,
                requests=len(requests), new_tokens=opts.new_tokens)
    for name in opts.variants.split(","):
        with variant(name):
            print(json.dumps(dict(base, variant=name, **gap(opts, args, requests, tokenizer.eos_ids))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
