"""Bitwise on-policy log-probs on CUDA (job.bitwise_logprobs, model/invariant_kernels.py).

Each kernel's rows are checked against the same rows computed in other company (other row counts,
other offsets, fused or split weights, prefill or decode), and against the standard kernels'
values within bf16 tolerance. End to end, the engine (CUDA graphs, compiled halves) and a
compiled bf16 trainer must agree on every sampled token's log-prob exactly; without the mode the
same pipeline must not (so the comparison itself can fail).

These need a GPU; on a machine without one every test skips with the reason. GPU runs are
recorded in bench/RESULTS.md.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams
from grpo.rollout.generate import episodes_from_completions
from grpo.train.trainer import Trainer
from model import ModelArgs, Transformer, batch_invariant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")

DEVICE = torch.device("cuda")
# Qwen3's layout at a small width: q/k norms, grouped K/V heads, head_dim 128.
ARGS = ModelArgs(vocab_size=1000, dim=256, n_layers=3, n_heads=8, n_kv_heads=4, head_dim=128, ffn_dim=512)
EOS = ARGS.vocab_size - 1
GROUP = 4


@pytest.fixture(autouse=True)
def _mode_reset():
    yield
    batch_invariant.enable(False)


def _kernels():
    batch_invariant.enable(True)
    from model import invariant_kernels

    return invariant_kernels


def test_matmul_rows_ignore_row_count_offset_and_weight_split():
    kernels = _kernels()
    torch.manual_seed(0)
    x = torch.randn(1500, 576, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, device=DEVICE, dtype=torch.bfloat16) / 24
    full = kernels.matmul(x, w, None, torch.bfloat16)
    torch.testing.assert_close(full.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)
    counts = (1, 7, 64, 129, 800)
    for start, rows in zip((0, 0, 3, 100, 700), counts):
        assert torch.equal(kernels.matmul(x[start : start + rows], w, None, torch.bfloat16), full[start : start + rows])
    # The tile follows the shape (matmul_tiles): the row counts above take more than one, and every
    # tile gives each row the same bits.
    assert len({kernels.matmul_tiles(rows, 1536, DEVICE) for rows in counts}) > 1
    for tiles in kernels.MATMUL_TILES:
        assert torch.equal(kernels.matmul(x, w, None, torch.bfloat16, tiles), full)
    split = torch.cat([kernels.matmul(x, part, None, torch.bfloat16) for part in w.split([1024, 256, 256])], dim=1)
    assert torch.equal(split, full)
    logits = kernels.matmul(x[:9], w, None, torch.float32)
    assert logits.dtype == torch.float32 and torch.equal(logits.to(torch.bfloat16), full[:9])


def test_rms_norm_rows_ignore_their_company():
    kernels = _kernels()
    torch.manual_seed(1)
    x = torch.randn(1000, 1024, device=DEVICE, dtype=torch.bfloat16) * 3
    w = torch.rand(1024, device=DEVICE, dtype=torch.bfloat16) + 0.5
    full = kernels.rms_norm(x, w, 1e-6)
    want = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(full.float(), want.float(), atol=2e-2, rtol=1e-2)
    for start, rows in ((0, 1), (5, 33), (400, 600)):
        assert torch.equal(kernels.rms_norm(x[start : start + rows].contiguous(), w, 1e-6), full[start : start + rows])


def test_attention_is_the_same_prefilled_packed_or_decoded():
    kernels = _kernels()
    torch.manual_seed(2)
    H, Hkv, D = 8, 4, 128
    lengths = [1, 70, 16, 129, 5]
    N = sum(lengths)
    q, k, v = (torch.randn(N, h, D, device=DEVICE, dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    packed = kernels.packed_attention(q, k, v, cu, max(lengths))
    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        one = torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE)
        alone = kernels.packed_attention(q[a:b], k[a:b], v[a:b], one, b - a)
        assert torch.equal(alone, packed[a:b])
        want = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(),
                                              v[a:b].transpose(0, 1).float(), is_causal=True, enable_gqa=True)
        torch.testing.assert_close(packed[a:b].float(), want.transpose(0, 1), atol=2e-2, rtol=2e-2)
    # Decode: every position of every sequence as one query against its slot of a cache.
    L = max(lengths) + 40
    k_cache = torch.randn(len(lengths), L, Hkv, D, device=DEVICE, dtype=torch.bfloat16)  # stale keys past the end
    v_cache = torch.randn_like(k_cache)
    rows, slots, positions = [], [], []
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        k_cache[s, : b - a], v_cache[s, : b - a] = k[a:b], v[a:b]
        rows += range(a, b)
        slots += [s] * (b - a)
        positions += range(b - a)
    slots_t = torch.tensor(slots, device=DEVICE)
    lengths_t = torch.tensor(positions, device=DEVICE, dtype=torch.int32) + 1
    decoded = kernels.slot_attention(q[rows], k_cache, v_cache, slots_t, lengths_t)
    assert torch.equal(decoded, packed[rows])


def test_attention_gradients_are_flash_attentions_from_the_invariant_forward():
    """The bitwise mode's attention backward is flash's, fed the invariant kernel's output and
    log-sum-exp instead of a recomputed flash forward: the log-sum-exp must be flash's own, and the
    gradients those of the default mode's flash attention (within bf16 tolerance)."""
    from model.attention import packed_attention, sequence_layout

    kernels = _kernels()
    torch.manual_seed(5)
    H, Hkv, D = 8, 4, 128
    lengths = [1, 70, 16, 129, 5]
    N = sum(lengths)
    q, k, v = (torch.randn(1, N, h, D, device=DEVICE, dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    upstream = torch.randn(1, N, H, D, device=DEVICE, dtype=torch.bfloat16)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    layout = sequence_layout(doc_ids, (1, N), DEVICE)
    _, lse = kernels.packed_attention(q[0], k[0], v[0], layout.cu_seqlens, layout.max_len, with_lse=True)
    flash_lse = torch.ops.aten._flash_attention_forward(q[0], k[0], v[0], layout.cu_seqlens, layout.cu_seqlens,
                                                        layout.max_len, layout.max_len, 0.0, True, False)[1]
    assert flash_lse.shape == lse.shape
    torch.testing.assert_close(lse, flash_lse, atol=1e-3, rtol=1e-4)
    grads = {}
    for bitwise in (True, False):
        batch_invariant.enable(bitwise)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        (packed_attention(*leaves, layout).float() * upstream.float()).sum().backward()
        grads[bitwise] = [t.grad.float() for t in leaves]
    for name, ours, flash in zip("qkv", grads[True], grads[False]):
        # bf16 gradients from outputs that differ in their last bits: close as a whole, not per element.
        assert float((ours - flash).norm() / flash.norm()) < 1e-2, name


@pytest.fixture(scope="module")
def one_rank_group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = "29543"
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _prompts(n: int) -> list[list[int]]:
    """Lengths 1..150: single tokens, and prompts crossing the 16-query and 64-key blocks."""
    g = torch.Generator().manual_seed(11)
    lengths = [1, 71, 5, 16, 150, 9, 64, 33][:n]
    return [torch.randint(0, EOS, (length,), generator=g).tolist() for length in lengths]


def _pi_old_gap(max_batch_size: int, micro_batch_tokens: int, temperature: float = 1.0) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(3)
    model = Transformer(ARGS, dtype=torch.float32, device=DEVICE)
    model.init_weights(std=0.05)
    sampling = SamplingParams(max_new_tokens=90, temperature=temperature)
    engine = NativeEngine(ARGS, sampling, eos_ids=[EOS], seed=1, dtype=torch.bfloat16, device=DEVICE,
                          max_batch_size=max_batch_size)
    engine.update_weights([[(n, (), p.detach()) for n, p in model.named_parameters()]], version=0)
    requests = [GenerationRequest(p, 0, i, s) for i, p in enumerate(_prompts(8)) for s in range(GROUP)]
    completions = engine.generate(requests)
    engine.close()
    batch = episodes_from_completions(completions, pad_id=0)
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))
    trainer = Trainer(model, init_device_mesh("cuda", (1,)), DEVICE, torch.bfloat16, GRPOConfig(group_size=GROUP),
                      OptimizerConfig(lr=1e-4, warmup_steps=0), total_steps=4, micro_batch_tokens=micro_batch_tokens,
                      temperature=temperature, max_new_tokens=90, compile=True)
    return trainer.train(batch)


# micro_batch_tokens: 256 packs a few episodes per row; 8192 puts the whole batch in one row.
@pytest.mark.parametrize(("max_batch_size", "micro_batch_tokens"), [(32, 256), (5, 8192)])
def test_engine_logprobs_equal_the_compiled_trainers_bitwise(one_rank_group, max_batch_size, micro_batch_tokens):
    batch_invariant.enable(True)
    gap = _pi_old_gap(max_batch_size, micro_batch_tokens)
    assert gap["logprob_diff/max"] == 0.0
    assert gap["logprob_diff/exact_frac"] == 1.0


def test_greedy_engine_logprobs_equal_the_trainers_bitwise(one_rank_group):
    batch_invariant.enable(True)
    gap = _pi_old_gap(32, 256, temperature=0.0)
    assert gap["logprob_diff/max"] == 0.0 and gap["logprob_diff/exact_frac"] == 1.0


def test_without_the_mode_the_gpu_pipeline_is_not_exact(one_rank_group):
    gap = _pi_old_gap(32, 256)
    assert 0.0 < gap["logprob_diff/max"] < 1.0
    assert gap["logprob_diff/exact_frac"] < 1.0
