"""The trainer's packed causal attention: the model's call on aten's flash ops (`model/attention.py`)
against `torch.nn.attention.varlen.varlen_attn`, which runs the same kernels, in the same run. One
JSON line per implementation, then one line comparing their results.

    python3 bench/training_attention.py [--tokens 16384] [--reps 200] [--lengths 100,600]
                                        [--impls tandem,varlen_attn,expanded_kv,flex,fa4,cudnn]

`--impls` adds alternatives: `expanded_kv`, the same aten ops with K/V repeated for every query
head (aten then has no grouped heads to sum in the backward), `flex`, FlexAttention (compiled)
with a causal document mask, `fa4`, FlashAttention 4's varlen kernels as the model calls them with
`model.train_attention = "fa4"` (model/fa4.py; the `flash-attn-4` package), and `cudnn`, cuDNN's
fused attention on the packed axis (aten's `_cudnn_attention_forward` with cumulative sequence
lengths, grouped K/V heads read as they are; its backward is aten's autograd formula). On torch
2.11 that path built a cuDNN graph at every call and its gradients were wrong (bench/RESULTS.md): the
comparison lines say whether a later torch mends it.

Qwen3-0.6B attention shape (16 query heads, 8 K/V heads, head_dim 128), bf16, sequences of 100-600
tokens packed back to back. Per call, three modes: a forward without gradients, a forward that
records for backward, and forward + backward. `host_us` is the time until the host has queued the
call (what a host-bound training step pays), `wall_us` until the device has run it, `device_us`
the kernels' own time (from the profiler). The comparison
line says whether the output and each gradient are bitwise equal; the query gradient's atomic sums
make it vary between two runs of either, which a second run of each shows.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model import fa4  # noqa: E402
from model.attention import SequenceLayout, _varlen_causal  # noqa: E402

H, HKV, D = 16, 8, 128


def packed_layout(tokens: int, device: torch.device, shortest: int = 100, longest: int = 600) -> SequenceLayout:
    """Sequences of shortest..longest tokens filling `tokens`, the last one cut to fit."""
    g = torch.Generator().manual_seed(0)
    bounds = [0]
    while bounds[-1] < tokens:
        bounds.append(min(tokens, bounds[-1] + int(torch.randint(shortest, longest + 1, (1,), generator=g))))
    max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return SequenceLayout(torch.tensor(bounds, dtype=torch.int32, device=device), bounds, max_len)


def varlen_call(layout: SequenceLayout):
    """varlen_attn with the keywords the installed release takes for causal, grouped heads."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = dict(window_size=(-1, 0)) if "window_size" in params else dict(is_causal=True)
    gqa = dict(enable_gqa=True) if "enable_gqa" in params else {}
    cu, n = layout.cu_seqlens, layout.max_len
    return lambda q, k, v: varlen_attn(q, k, v, cu, cu, n, n, **causal, **gqa)


class _ExpandedKV(torch.autograd.Function):
    """aten's flash ops on K/V repeated for every query head; the backward folds each group's
    K/V gradients back by adding them."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens: torch.Tensor, max_len: int):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng, unused)
        ctx.max_len, ctx.groups = max_len, groups
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        n = ctx.max_len
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, n, n, 0.0, True, rng, unused
        )
        # Added pairwise: aten's own sum over the group dimension is the kernel this avoids.
        fold = lambda t: functools.reduce(torch.add, t.unflatten(1, (-1, ctx.groups)).unbind(2))  # noqa: E731
        return dq, fold(dk), fold(dv), None, None


def flex_call(layout: SequenceLayout, tokens: int):
    """FlexAttention over the packed axis with a causal mask within each sequence."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths = layout.cu_seqlens.diff().long()
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    mask = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), 1, 1, tokens, tokens,
                             device=lengths.device)
    attend = torch.compile(flex_attention)
    heads_first = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    return lambda q, k, v: attend(heads_first(q), heads_first(k), heads_first(v), block_mask=mask,
                                  enable_gqa=True)[0].transpose(0, 1)


def cudnn_call(layout: SequenceLayout):
    """cuDNN's fused attention over the packed axis: q [N, H, D], k/v [N, Hkv, D] -> [N, H, D]."""
    cu, n = layout.cu_seqlens, layout.max_len

    def attend(q, k, v):
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, n, n, True, 0.0, True)[0]

    return attend


def timed(fn, q, k, v, grad, mode: str, reps: int) -> tuple[float, float]:
    """(host µs, wall µs) per call of `mode`: nograd, grad or fwdbwd."""
    with torch.no_grad() if mode == "nograd" else torch.enable_grad():
        for _ in range(3):
            out = fn(q, k, v)
            if mode == "fwdbwd":
                out.backward(grad)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(q, k, v)
            if mode == "fwdbwd":
                out.backward(grad)
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return host / reps * 1e6, wall / reps * 1e6


def device_time(fn, q, k, v, grad, mode: str, reps: int = 20) -> float:
    """µs of kernels per call of `mode`, from the profiler: what the call costs where the host keeps
    ahead (a host-bound call's wall time hides it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad() if mode == "nograd" else torch.enable_grad():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                out = fn(q, k, v)
                if mode == "fwdbwd":
                    out.backward(grad)
            torch.cuda.synchronize()
    kernels = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
    return kernels / reps


def results(fn, q, k, v, grad) -> list[torch.Tensor]:
    """Output and the q, k, v gradients of one forward + backward."""
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(grad)
    return [out.detach().clone()] + [t.grad.clone() for t in (q, k, v)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--lengths", default="100,600", help="shortest,longest sequence")
    parser.add_argument("--impls", default="tandem,varlen_attn",
                        help="comma list of tandem, varlen_attn, expanded_kv, flex, fa4, cudnn")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/training_attention.py: needs a CUDA device (both implementations run flash attention)")
    device = torch.device("cuda")
    layout = packed_layout(opts.tokens, device, *(int(n) for n in opts.lengths.split(",")))
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (
        torch.randn(opts.tokens, heads, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        for heads in (H, HKV, HKV)
    )
    grad = torch.randn(opts.tokens, H, D, device=device, dtype=torch.bfloat16, generator=g)
    known = {
        "tandem": lambda: lambda q, k, v: _varlen_causal(q, k, v, layout),
        "varlen_attn": lambda: varlen_call(layout),
        "expanded_kv": lambda: lambda q, k, v: _ExpandedKV.apply(q, k, v, layout.cu_seqlens, layout.max_len),
        "flex": lambda: flex_call(layout, opts.tokens),
        "fa4": lambda: lambda q, k, v: fa4.packed_causal(q, k, v, layout.cu_seqlens, layout.max_len),
        "cudnn": lambda: cudnn_call(layout),
    }
    impls = {name: known[name]() for name in opts.impls.split(",")}
    runs = {}
    for name, fn in impls.items():
        line = dict(bench="training_attention", impl=name, tokens=opts.tokens, sequences=len(layout.bounds) - 1,
                    device=torch.cuda.get_device_name(), torch=torch.__version__)
        for mode in ("nograd", "grad", "fwdbwd"):
            host, wall = timed(fn, q, k, v, grad, mode, opts.reps)
            line[f"{mode}_host_us"], line[f"{mode}_wall_us"] = round(host, 1), round(wall, 1)
            line[f"{mode}_device_us"] = round(device_time(fn, q, k, v, grad, mode), 1)
        print(json.dumps(line), flush=True)
        runs[name] = results(fn, q, k, v, grad)
        runs[f"{name}_again"] = results(fn, q, k, v, grad)
    names = ("out", "dq", "dk", "dv")
    first = next(iter(impls))
    pairs = [(first, other) for other in impls if other != first] + [(name, f"{name}_again") for name in impls]
    for a, b in pairs:
        equal = {n: torch.equal(x, y) for n, x, y in zip(names, runs[a], runs[b])}
        max_diff = {n: (x.float() - y.float()).abs().max().item() for n, x, y in zip(names, runs[a], runs[b])}
        print(json.dumps(dict(bench="training_attention", compare=[a, b], bitwise_equal=equal, max_abs_diff=max_diff)),
              flush=True)


if __name__ == "__main__":
    main()
