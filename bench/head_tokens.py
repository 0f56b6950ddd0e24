"""The trainer's output head on the loss tokens only against the head on every token, in one run:
forward and backward of the masked log-prob sum through `Transformer.forward`, one JSON line each.

    python3 bench/head_tokens.py                      # SmolLM2-135M width, 6 layers, CPU, fp32
    python3 bench/head_tokens.py --layers 30 --device cuda --dtype bfloat16

A tied 49,152-token head on the SmolLM2-135M block shape (dim 576, 9 / 3 heads, FFN 1536), random
weights; --sequences sequences of --length tokens packed in one row, loss on the last
--loss-share of each (a prompt before it). `head_mask` runs the head on the loss tokens; without
it the head runs on every token and the mask only zeroes the loss. Best of --reps after a warm-up,
the two settings alternating twice. `flop_ratio` is the matmul FLOPs of the first over the second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.args import ModelArgs  # noqa: E402
from model.model import Transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--loss-share", type=float, default=0.65)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    opts = parser.parse_args()
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    args = ModelArgs(arch="llama", vocab_size=49152, dim=576, n_layers=opts.layers, n_heads=9, n_kv_heads=3,
                     head_dim=64, ffn_dim=1536, qk_norm=False, tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(args, dtype=dtype).to(device)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    n, length = opts.sequences, opts.length
    tokens, targets = (torch.randint(args.vocab_size, (1, n * length), device=device) for _ in range(2))
    positions = torch.arange(length, device=device).repeat(n)[None]
    doc_ids = torch.arange(n, device=device).repeat_interleave(length)[None]
    mask = (positions >= round(length * (1 - opts.loss_share)))

    def step(head_mask: torch.Tensor | None) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = model(tokens, positions, doc_ids, targets=targets, head_mask=head_mask)
        (out.logprobs * mask).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    blocks = args.n_layers * (args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
                              + 3 * args.dim * args.ffn_dim)
    head = args.vocab_size * args.dim
    share = float(mask.float().mean())
    for _ in range(2):
        for name, head_mask in (("head_on_every_token", None), ("head_on_loss_tokens", mask.cpu())):
            step(head_mask)
            best = min(step(head_mask) for _ in range(opts.reps))
            print(json.dumps(dict(bench="head_tokens", impl=name, device=opts.device, dtype=opts.dtype,
                                  layers=opts.layers, tokens=n * length, loss_share=round(share, 3),
                                  step_s=round(best, 4),
                                  flop_ratio=round((blocks + head * share) / (blocks + head), 3))), flush=True)


if __name__ == "__main__":
    main()
