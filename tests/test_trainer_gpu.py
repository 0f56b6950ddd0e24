"""The trainer's CUDA-only paths: flash varlen attention over packed sequences (forward and
backward) against a per-sequence fp32 reference, compiled block halves and log-prob head against
eager, and a Trainer step with compile, activation checkpointing and fused AdamW.

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
from grpo.rollout.episode import EpisodeBatch
from grpo.train.packing import pack_episodes
from grpo.train.trainer import Trainer
from model import ModelArgs, Transformer
from model.attention import packed_attention, sequence_layout, set_packed_kernel
from model.fa4 import fa4_problem
from model.parallelize import compile_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash attention, compile)")

ARGS = ModelArgs(vocab_size=512, dim=128, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=64, ffn_dim=256)
DEVICE = torch.device("cuda")


@pytest.fixture(params=["flash", "fa4"])
def train_attention(request):
    """Each kernel of `model.train_attention` in turn; FA4 where it serves this machine."""
    problem = fa4_problem("cuda") if request.param == "fa4" else None
    if problem:
        pytest.skip(f"FlashAttention 4 {problem}")
    set_packed_kernel(request.param)
    yield request.param
    set_packed_kernel("flash")


def test_varlen_training_attention_matches_per_sequence_reference(train_attention):
    torch.manual_seed(0)
    lengths = [7, 1, 130, 64, 2, 300]
    N, H, Hkv, D = sum(lengths), 8, 2, 128
    q = torch.randn(1, N, H, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, N, Hkv, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, N, Hkv, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].to(DEVICE)
    out = packed_attention(q, k, v, sequence_layout(doc_ids, (1, N), DEVICE))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    pieces, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        pieces.append(F.scaled_dot_product_attention(
            qf[0, s].transpose(0, 1), kf[0, s].transpose(0, 1), vf[0, s].transpose(0, 1), is_causal=True,
            enable_gqa=True).transpose(0, 1))
        start += n
    want = torch.cat(pieces)[None]
    want.backward(grad_out.float())
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    for got, ref in ((q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        torch.testing.assert_close(got.float(), ref, atol=5e-2, rtol=5e-2)


def _model() -> Transformer:
    torch.manual_seed(1)
    model = Transformer(ARGS, dtype=torch.float32, device=DEVICE)
    model.init_weights(std=0.05)
    return model.to(torch.bfloat16)


def _packed(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (1, sum(lengths)), generator=g).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].to(DEVICE)
    return tokens, positions, doc_ids


def test_shared_prompts_give_the_plain_layouts_logprobs_and_gradients():
    """training.share_prompts on the flash kernel (keys gathered, causal aligned at each sequence's
    end): 3 prompts x 4 completions of mixed lengths, against the plain packing, in bf16."""
    from tests.test_packing import _episode_batch

    g = torch.Generator().manual_seed(4)
    prompts, completions = [], []
    for p in (7, 130, 40):
        prompt = torch.randint(0, ARGS.vocab_size, (p,), generator=g).tolist()
        for n in (1, 60, 200, 9):
            prompts.append(prompt)
            completions.append(torch.randint(0, ARGS.vocab_size, (n + p % 7,), generator=g).tolist())
    batch = _episode_batch(prompts, completions, [1.0] * len(prompts))
    batch.prompt_index = torch.arange(len(prompts)) // 4
    results = []
    for share in (False, True):
        rows = pack_episodes(batch, share_prompts=share)
        model = _model()
        out = model(rows.tokens.to(DEVICE), positions=rows.positions.to(DEVICE), doc_ids=rows.doc_ids,
                    targets=rows.targets.to(DEVICE), group_ids=rows.group_ids)
        mask = rows.loss_mask.to(DEVICE)
        (out.logprobs * mask).sum().backward()
        per_token = {(d, int(p)): lp for d, p, lp, m in zip(rows.doc_ids[0].tolist(), rows.positions[0],
                                                              out.logprobs[0].float().tolist(), rows.loss_mask[0]) if m}
        results.append((per_token, model.layers[0].attention.wq.weight.grad.float()))
    (plain, plain_grad), (shared, shared_grad) = results
    assert plain.keys() == shared.keys()
    torch.testing.assert_close(torch.tensor([shared[k] for k in plain]), torch.tensor(list(plain.values())),
                               atol=5e-2, rtol=0)
    torch.testing.assert_close(shared_grad, plain_grad, atol=5e-2, rtol=5e-2)


def test_prefix_merge_kernel_equals_plain_torch_in_bf16():
    """model/merge_kernel.py on the GPU against shared_prefix.merge_reference, on bf16 outputs of
    the Qwen3-0.6B heads: within one bf16 rounding, and the own output's bits wherever no prefix
    is continued."""
    from model.merge_kernel import merge
    from model.shared_prefix import merge_reference

    g = torch.Generator().manual_seed(8)
    N, H, D = 3001, 16, 128
    own_out, prefix_out = (torch.randn(N, H, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    own_lse, prefix_lse = ((torch.randn(H, N, generator=g) * 4).to(DEVICE) for _ in range(2))
    continues = (torch.rand(N, generator=g) < 0.8).to(DEVICE)
    out, lse = merge(own_out, own_lse, prefix_out, prefix_lse, continues)
    want_out, want_lse = merge_reference(own_out, own_lse, prefix_out, prefix_lse, continues)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=1e-2)
    assert torch.equal(out[~continues], own_out[~continues])


def test_compiled_halves_and_head_match_eager_for_any_token_count():
    from torch._dynamo.utils import counters

    counters.clear()
    eager, compiled = _model(), _model()
    compile_blocks(compiled)
    for seed, lengths in enumerate(([5, 40, 1, 17], [90, 3], [33] * 5)):  # three token counts, one graph
        tokens, positions, doc_ids = _packed(lengths, seed)
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            out = model(tokens, positions, doc_ids, targets=tokens)
            out.logprobs.mean().backward()
            results.append((out.logprobs.detach(), out.entropy.detach(), model.layers[0].feed_forward.w1.weight.grad))
        (lp_e, ent_e, g_e), (lp_c, ent_c, g_c) = results
        torch.testing.assert_close(lp_c, lp_e, atol=5e-2, rtol=0)
        torch.testing.assert_close(ent_c, ent_e, atol=5e-2, rtol=0)
        torch.testing.assert_close(g_c.float(), g_e.float(), atol=1e-3, rtol=5e-2)
    # Each half is one graph: nothing inside breaks it.
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_fa4_model_forward_and_gradients_agree_with_flash():
    """The whole model on FlashAttention 4 against the same model on aten's FlashAttention 2: the
    kernels differ only in their bf16 rounding."""
    problem = fa4_problem("cuda")
    if problem:
        pytest.skip(f"FlashAttention 4 {problem}")
    model = _model()
    tokens, positions, doc_ids = _packed([5, 200, 1, 77, 130], 3)
    results = []
    try:
        for kernel in ("flash", "fa4"):
            set_packed_kernel(kernel)
            model.zero_grad()
            out = model(tokens, positions, doc_ids, targets=tokens)
            out.logprobs.mean().backward()
            results.append((out.logprobs.detach(), model.layers[0].attention.wq.weight.grad.clone()))
    finally:
        set_packed_kernel("flash")
    (lp_flash, g_flash), (lp_fa4, g_fa4) = results
    torch.testing.assert_close(lp_fa4, lp_flash, atol=5e-2, rtol=0)
    torch.testing.assert_close(g_fa4.float(), g_flash.float(), atol=1e-3, rtol=5e-2)


def test_compiled_halves_keep_their_graphs_across_the_fused_reduction_line():
    """Inductor fuses RMSNorm's two backward reductions only from 5 * 2**20 / dim tokens up; a
    micro-batch on the other side of that line reuses the graphs the first one compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the halves' graphs from earlier tests would serve this model's blocks too
    counters.clear()
    model = _model()
    compile_blocks(model)
    line = 5 * 2**20 // ARGS.dim
    graphs = []
    for seed, lengths in enumerate(([4096] * (line // 4096 + 1), [1000, 2000])):
        tokens, positions, doc_ids = _packed(lengths, seed)
        model(tokens, positions, doc_ids, targets=tokens).logprobs.mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0
    assert graphs[1] == graphs[0], "a micro-batch below the line recompiled the block halves"


@pytest.fixture(scope="module")
def one_rank_group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _episodes(n: int, seed: int) -> EpisodeBatch:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(20, 120, (n,), generator=g)
    prompt = seq // 3
    return EpisodeBatch(
        tokens=torch.randint(0, ARGS.vocab_size, (n, int(seq.max())), generator=g), prompt_lens=prompt,
        completion_lens=seq - prompt, gen_logprobs=-torch.rand(n, int(seq.max()), generator=g),
        truncated=torch.zeros(n, dtype=torch.bool), version=torch.zeros(n, dtype=torch.long),
        prompt_index=torch.arange(n) // 4, sample_index=torch.arange(n) % 4, rewards=torch.zeros(n),
        advantages=torch.randn(n, generator=g),
    )


def test_trainer_step_compiled_with_checkpointing_matches_eager(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    metrics, weights = [], []
    for compile, checkpointing in ((False, False), (True, True)):
        torch.manual_seed(2)
        model = Transformer(ARGS, dtype=torch.float32, device=DEVICE)
        model.init_weights(std=0.05)
        initial = model.layers[1].attention.wq.weight.detach().clone()
        trainer = Trainer(model, init_device_mesh("cuda", (1,)), DEVICE, torch.bfloat16, GRPOConfig(group_size=4),
                          OptimizerConfig(lr=1e-4, warmup_steps=0), total_steps=10, micro_batch_tokens=512,
                          temperature=1.0, max_new_tokens=120, activation_checkpointing=checkpointing, compile=compile)
        assert any(g.get("fused") for g in trainer.optimizer.param_groups)
        metrics.append(trainer.train(_episodes(32, seed=3)))
        # One rank: plain fp32 masters, no FSDP (model/mixed_precision.py).
        assert trainer.one_rank is not None
        weights.append(trainer.model.layers[1].attention.wq.weight.detach().clone())
    eager, compiled = metrics
    assert eager["train/skipped_updates"] == compiled["train/skipped_updates"] == 0.0
    assert compiled["loss/policy"] == pytest.approx(eager["loss/policy"], abs=2e-3)
    assert compiled["loss/grad_norm"] == pytest.approx(eager["loss/grad_norm"], rel=5e-2)
    # AdamW's first step moves each weight by about ±lr: the two runs agree on the direction.
    assert (torch.sign(weights[1] - initial) == torch.sign(weights[0] - initial)).float().mean() > 0.9


@pytest.mark.parametrize("compile", [False, True])
def test_training_passes_never_make_the_host_wait_for_the_device(one_rank_group, compile):
    """A micro-batch's forward and backward, and the KL reference's no-grad forward, only queue work:
    no host-device sync (torch.cuda's sync debug mode raises on one), so the host keeps the lead
    that a device-bound backward gives it into the next micro-batch. A copy of the RoPE frequencies
    from the host at every forward used to wait for the previous micro-batch's backward."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(2)
    model = Transformer(ARGS, dtype=torch.float32, device=DEVICE)
    model.init_weights(std=0.05)
    reference = Transformer(ARGS, dtype=torch.float32, device=DEVICE)
    reference.load_state_dict(model.state_dict())
    trainer = Trainer(model, init_device_mesh("cuda", (1,)), DEVICE, torch.bfloat16,
                      GRPOConfig(group_size=4, kl_coef=0.1), OptimizerConfig(lr=1e-4, warmup_steps=0), total_steps=10,
                      micro_batch_tokens=4096, temperature=1.0, max_new_tokens=120, compile=compile,
                      reference=reference)
    rows = pack_episodes(_episodes(16, seed=5))
    # The first pass compiles and sets up the kernels' libraries; the second is the checked one.
    for mode in ("default", "error"):
        torch.cuda.set_sync_debug_mode(mode)
        try:
            with torch.no_grad():
                reference_out = trainer._forward(rows, trainer.reference)
            out = trainer._forward(rows)
            out.logprobs.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(reference_out.logprobs).all()


def test_triton_head_kernels_match_the_torch_reference():
    from model.head_kernel import chunk_grad_triton, chunk_stats_triton
    from model.logprob_head import chunk_grad, chunk_stats

    torch.manual_seed(4)
    N, V, T = 300, 151936, 0.7
    logits = (torch.randn(N, V, device=DEVICE) * 4).to(torch.bfloat16)
    targets = torch.randint(V, (N,), device=DEVICE)
    want = chunk_stats(logits, targets, T)
    got = chunk_stats_triton(logits, targets, T)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)
    grad_lp, grad_ent = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    want_grad = chunk_grad(logits, targets, want[2], want[1], grad_lp, grad_ent, T)
    got_grad = chunk_grad_triton(logits, targets, want[2], want[1], grad_lp, grad_ent, T)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), atol=1e-3, rtol=1e-2)


def test_fp32_logits_are_the_bf16_matmul_without_its_rounding():
    from model import batch_invariant
    from model.head_kernel import chunk_grad_triton
    from model.logprob_head import chunk_grad, chunk_stats

    torch.manual_seed(5)
    x = torch.randn(257, 576, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(49152, 576, device=DEVICE, dtype=torch.bfloat16) / 24
    exact = x.double() @ w.double().t()
    wide = batch_invariant.head_logits(x, w)
    assert wide.dtype == torch.float32
    bf16_error = (F.linear(x, w).double() - exact).abs().max()
    assert (wide.double() - exact).abs().max() < bf16_error / 20  # fp32 accumulation, no bf16 rounding
    try:
        batch_invariant.set_fp32_logits(False)
        assert batch_invariant.head_logits(x, w).dtype == torch.bfloat16
    finally:
        batch_invariant.set_fp32_logits(True)
    # The head's gradient kernel reads the fp32 logits and writes the matmuls' bf16 directly.
    targets = torch.randint(w.shape[0], (x.shape[0],), device=DEVICE)
    _, entropy, log_z = chunk_stats(wide, targets, 1.0)
    grads = torch.randn(x.shape[0], device=DEVICE), torch.randn(x.shape[0], device=DEVICE)
    want = chunk_grad(wide, targets, log_z, entropy, *grads, 1.0, torch.bfloat16)
    got = chunk_grad_triton(wide, targets, log_z, entropy, *grads, 1.0, torch.bfloat16)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=1e-2)
