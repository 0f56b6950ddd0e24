"""Checks of the batch-invariant kernels (model/invariant_kernels.py) and the sampler's kernel run on the CPU through
Triton's interpreter; tests/test_invariant_kernels.py runs each in a process of its own with
TRITON_INTERPRET=1 (it must be set before the kernels are defined).

    TRITON_INTERPRET=1 python -m tests.interpreted_kernels CHECK [CHECK ...]   (names: CHECKS below)

Each check compares a kernel with plain PyTorch, and each row of its output with the same row
computed in other company: other row counts and offsets, fused or split weights, a sequence
packed with others or alone, prefilled or decoded from a cache holding stale values. The
interpreter runs the kernels' own index arithmetic, masks and block order in numpy, so these check
the logic that invariance rests on; the hardware's part is tests/test_bitwise_gpu.py's. Inputs are
fp32: the interpreter's `tl.dot` does not compute bf16 inputs correctly (Triton 3.9).
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.nn.functional as F

from model import invariant_kernels as kernels
from model import invariant_ops


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def check_matmul() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 80, generator=g)
    w = torch.randn(200, 80, generator=g)
    bias = torch.randn(200, generator=g)
    full = kernels.matmul(x, w, bias, torch.float32)
    close(full, F.linear(x, w, bias))
    for start, rows in ((0, 1), (3, 7), (128, 129), (37, 263)):
        assert torch.equal(kernels.matmul(x[start : start + rows], w, bias, torch.float32), full[start : start + rows])
    for tiles in kernels.MATMUL_TILES:  # each tile's index arithmetic and masks, at a width none divides
        assert torch.equal(kernels.matmul(x, w, bias, torch.float32, tiles), full)
    parts = [kernels.matmul(x, part, b, torch.float32) for part, b in zip(w.split([120, 50, 30]), bias.split([120, 50, 30]))]
    assert torch.equal(torch.cat(parts, dim=1), full)
    assert kernels.matmul(x[:0], w, None, torch.float32).shape == (0, 200)


def check_rms_norm() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 48, generator=g) * 3
    w = torch.rand(48, generator=g) + 0.5
    full = kernels.rms_norm(x, w, 1e-6)
    close(full, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
    for start, rows in ((0, 1), (5, 33)):
        assert torch.equal(kernels.rms_norm(x[start : start + rows].contiguous(), w, 1e-6), full[start : start + rows])


def check_attention() -> None:
    """The packed kernel against SDPA, alone and packed with others; the slot kernel against it."""
    g = torch.Generator().manual_seed(2)
    H, Hkv, D = 4, 2, 16
    lengths = [1, 70, 16, 5]
    q, k, v = (torch.randn(sum(lengths), h, D, generator=g) for h in (H, Hkv, Hkv))
    bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
    packed, lse = kernels.packed_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32), max(lengths), with_lse=True)
    L = max(lengths) + 9
    # The cache past each sequence's end holds stale values; NaNs among them must not leak in.
    k_cache = torch.full((len(lengths), L, Hkv, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    rows, slots, positions = [], [], []
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        want = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                              is_causal=True, enable_gqa=True).transpose(0, 1)
        close(packed[a:b], want)
        scores = q[a:b].transpose(0, 1) @ k[a:b].repeat_interleave(H // Hkv, 1).permute(1, 2, 0) * D**-0.5
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        close(lse[:, a:b], scores.masked_fill(~causal, float("-inf")).logsumexp(-1))
        alone = kernels.packed_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a], dtype=torch.int32), b - a)
        assert torch.equal(alone, packed[a:b])
        k_cache[s, : b - a], v_cache[s, : b - a] = k[a:b], v[a:b]
        rows += range(a, b)
        slots += [s] * (b - a)
        positions += range(b - a)
    decoded = kernels.slot_attention(q[rows], k_cache, v_cache, torch.tensor(slots),
                                     torch.tensor(positions, dtype=torch.int32) + 1)
    assert torch.equal(decoded, packed[rows])
    _check_shared_prompt(q, k_cache, v_cache, packed, bounds[1], bounds[2])
    _check_new_kv_stored(q, k, v, k_cache, v_cache, packed, lengths, [b - 1 for b in bounds[1:]])
    _check_attended_keys(q, k, v, k_cache, v_cache, packed, bounds[1], bounds[2])


def _check_shared_prompt(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, packed: torch.Tensor, a: int,
                         b: int) -> None:
    """Sequence 1 (tokens a:b, slot 1) again from a slot whose first 40 keys are NaN, which reads
    those from a reader slot whose other keys are NaN (a shared prompt; the boundary falls inside a
    key block)."""
    reader, own = k_cache.shape[0], k_cache.shape[0] + 1
    k_two, v_two = (torch.cat([c, c[1:2], c[1:2]]) for c in (k_cache, v_cache))
    for c in (k_two, v_two):
        c[reader, 40:], c[own, :40] = float("nan"), float("nan")
    n = b - a
    shared = kernels.slot_attention(q[a:b], k_two, v_two, torch.full((n,), own), torch.arange(1, n + 1, dtype=torch.int32),
                                    torch.full((n,), reader), torch.full((n,), 40, dtype=torch.int32))
    assert torch.equal(shared, packed[a:b])


def _check_new_kv_stored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, packed: torch.Tensor, lengths: list[int], last: list[int]) -> None:
    """Each sequence's last token (at `last`) decoded with its own key and value handed to the
    kernel, which stores them in the slot (where the cache holds NaN) before attending: the same
    bits again."""
    k_new, v_new = k_cache.clone(), v_cache.clone()
    for s, length in enumerate(lengths):
        k_new[s, length - 1], v_new[s, length - 1] = float("nan"), float("nan")
    # Q and V handed over as views into wider rows, as the fused projection's output holds them, so
    # their strides differ from K's.
    wide = torch.cat([torch.full_like(v[last], float("nan")), v[last]], dim=1)
    new_v = wide[:, k.shape[1]:]
    q_view = torch.cat([q[last], k[last]], dim=1)[:, :q.shape[1]]
    assert new_v.stride() != k[last].stride() and not q_view.is_contiguous()
    stored = kernels.slot_attention(q_view, k_new, v_new, torch.arange(len(lengths)),
                                    torch.tensor(lengths, dtype=torch.int32), new_k=k[last], new_v=new_v)
    assert torch.equal(stored, packed[last])
    assert torch.equal(k_new.nan_to_num(7.0), k_cache.nan_to_num(7.0))
    assert torch.equal(v_new.nan_to_num(7.0), v_cache.nan_to_num(7.0))


def _check_attended_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, packed: torch.Tensor, a: int, b: int) -> None:
    """Sequence 1's (tokens a:b, slot 1) last token attending only to its slot's first `count`
    keys (a finished row attends to one), with NaN from there on: one key, inside a key block, a
    block's edge, all."""
    n = b - a
    counts = [1, 33, kernels.ATTENTION_BLOCK_N, kernels.ATTENTION_BLOCK_N + 1, n]
    k_head, v_head = (c[1:2].repeat(len(counts), 1, 1, 1) for c in (k_cache, v_cache))
    for row, count in enumerate(counts):
        k_head[row, count:], v_head[row, count:] = float("nan"), float("nan")
    head = kernels.slot_attention(q[b - 1 : b].repeat(len(counts), 1, 1), k_head, v_head, torch.arange(len(counts)),
                                  torch.full((len(counts),), n, dtype=torch.int32),
                                  attended=torch.tensor(counts, dtype=torch.int32))
    for row, count in enumerate(counts):
        want = F.scaled_dot_product_attention(q[b - 1 : b].transpose(0, 1), k[a : a + count].transpose(0, 1),
                                              v[a : a + count].transpose(0, 1), enable_gqa=True).transpose(0, 1)
        close(head[row : row + 1], want)
    assert torch.equal(head[-1], packed[b - 1]) and torch.equal(head[0, :2], v[a].repeat_interleave(2, 0)[:2])


def check_gradients() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 80, generator=g)
    w = torch.randn(50, 80, generator=g)
    bias = torch.randn(50, generator=g)
    ours = [t.clone().requires_grad_() for t in (x, w, bias)]
    theirs = [t.clone().requires_grad_() for t in (x, w, bias)]
    invariant_ops.invariant_linear(*ours, True).square().sum().backward()
    F.linear(*theirs).square().sum().backward()
    for a, b in zip(ours, theirs):
        close(a.grad, b.grad, 1e-3)

    x = torch.randn(4, 6, 48, generator=g) * 2
    w = torch.rand(48, generator=g) + 0.5
    upstream = torch.randn(4, 6, 48, generator=g)
    ours = [t.clone().requires_grad_() for t in (x, w)]
    theirs = [t.clone().requires_grad_() for t in (x, w)]
    (invariant_ops.invariant_rms_norm(*ours, 1e-6) * upstream).sum().backward()
    xt, wt = theirs
    ((wt * (xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + 1e-6))) * upstream).sum().backward()
    for a, b in zip(ours, theirs):
        close(a.grad, b.grad)

    # Packed attention through the model's path (its backward recomputes the reference's forward
    # on the CPU) against SDPA's gradients, sequence by sequence.
    from model import batch_invariant
    from model.attention import packed_attention, sequence_layout

    batch_invariant.enable(True)
    lengths, H, Hkv, D = [3, 70, 1], 4, 2, 16
    q, k, v = (torch.randn(1, sum(lengths), h, D, generator=g) for h in (H, Hkv, Hkv))
    upstream = torch.randn(1, sum(lengths), H, D, generator=g)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    layout = sequence_layout(doc_ids, (1, sum(lengths)), q.device)
    (packed_attention(*ours, layout) * upstream).sum().backward()
    batch_invariant.enable(False)
    start = 0
    for n in lengths:
        part = [t[0, start : start + n].transpose(0, 1).clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True)
        (out * upstream[0, start : start + n].transpose(0, 1)).sum().backward()
        for mine, theirs in zip(ours, part):
            close(mine.grad[0, start : start + n], theirs.grad.transpose(0, 1))
        start += n


def check_pipeline(max_batch_size: int, micro_batch_tokens: int, prompts: int) -> None:
    """One of tests/test_bitwise.py's engine-against-trainer cases on the interpreted kernels
    instead of the CPU reference (the interpreter is slow; the reference runs them all)."""
    from model import batch_invariant
    from tests.dist_utils import one_thread
    from tests.test_bitwise import pi_old_gap

    batch_invariant.enable(True)
    assert batch_invariant.uses_kernels(torch.empty(1)), "TRITON_INTERPRET=1 must route CPU work to the kernels"
    with one_thread():
        gap = pi_old_gap(max_batch_size, micro_batch_tokens, prompts=prompts)
    assert gap["logprob_diff/max"] == 0.0 and gap["logprob_diff/exact_frac"] == 1.0, gap


def check_gumbel_sample() -> None:
    """The sampler's kernel (grpo/engine/sampling_kernel.py) draws the reference's tokens with its
    log-probs: the same hash, noise and first-index argmax, over chunks of a vocabulary that is no
    multiple of the chunk."""
    from grpo.engine import sampling
    from grpo.engine.sampling_kernel import CHUNK, gumbel_sample
    from grpo.engine.types import SamplingParams

    g = torch.Generator().manual_seed(3)
    B, V = 9, 2 * CHUNK + 808
    logits = torch.randn(B, V, generator=g) * 3
    keys = torch.randint(0, 2**32, (B,), generator=g)
    positions = torch.randint(0, 4000, (B,), generator=g)
    token_hash = sampling.vocab_hash(V, logits.device)
    row_hash = sampling.combine(keys, positions)
    for temperature in (1.0, 0.7):
        want, want_lp = sampling.sample(logits, keys, positions, token_hash, SamplingParams(1, temperature=temperature))
        got, got_lp = gumbel_sample(logits, row_hash, temperature)
        assert torch.equal(got, want), (temperature, (got != want).nonzero())
        close(got_lp, want_lp, tol=1e-5)
        alone, _ = gumbel_sample(logits[5:6], row_hash[5:6], temperature)
        assert torch.equal(alone, got[5:6])
    # The drawn token is always among the columns that exist, even when the last block's are masked.
    assert int(gumbel_sample(torch.full((1, V), -1e30), row_hash[:1], 1.0)[0]) < V


def check_silu_mul() -> None:
    """The engine's SwiGLU kernel (model/swiglu_kernel.py) against plain PyTorch, on a width that is
    no multiple of its block, with leading dimensions."""
    from model.swiglu_kernel import silu_mul

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 9, 2 * 1500, generator=g) * 4
    gate, up = x.chunk(2, dim=-1)
    close(silu_mul(x), F.silu(gate) * up, tol=1e-5)
    assert silu_mul(x[:, :0]).shape == (1, 0, 1500)


def check_prefix_merge() -> None:
    """The shared-prefix merge's kernel (model/merge_kernel.py) against shared_prefix.py's plain
    torch: tokens that continue a prefix and tokens that do not (their own output's bits kept),
    a token with no prefix keys (its prefix log-sum-exp +inf), a head size no power of two, more
    rows than one program's block."""
    from model.merge_kernel import merge
    from model.shared_prefix import merge_reference

    g = torch.Generator().manual_seed(6)
    N, H, D = 53, 3, 40
    own_out, prefix_out = torch.randn(N, H, D, generator=g), torch.randn(N, H, D, generator=g)
    own_lse, prefix_lse = torch.randn(H, N, generator=g) * 3, torch.randn(H, N, generator=g) * 3
    continues = torch.rand(N, generator=g) < 0.7
    prefix_lse[:, 5], continues[5] = float("inf"), False
    out, lse = merge(own_out, own_lse, prefix_out, prefix_lse, continues)
    want_out, want_lse = merge_reference(own_out, own_lse, prefix_out, prefix_lse, continues)
    close(out, want_out, tol=1e-5)
    close(lse, want_lse, tol=1e-5)
    assert torch.equal(out[~continues], own_out[~continues]) and torch.equal(lse[:, ~continues], own_lse[:, ~continues])
    assert (out[continues] != own_out[continues]).all()


def check_split_decode() -> None:
    """The split decode kernel (model/decode_kernel.py) against the plain torch decode path
    (attention.slot_decode on the CPU): rows of 1 to 200 live keys, each storing its own new key
    and value first, one reading a shared prompt from another slot, a finished row attending to
    one key; 1 to 8 splits (more ranges than a short row has key blocks); a second launch on the
    same arrival counters gives the same bits."""
    from model.attention import slot_decode
    from model.decode_kernel import split_slot_attention

    g = torch.Generator().manual_seed(7)
    H, Hkv, D, L = 4, 2, 16, 210
    lengths = torch.tensor([1, 5, 64, 65, 200, 130], dtype=torch.int32)
    B = len(lengths)
    k_cache, v_cache = torch.randn(B + 1, L, Hkv, D, generator=g), torch.randn(B + 1, L, Hkv, D, generator=g)
    slots, share_slots, share_lens = torch.arange(B), torch.arange(B), lengths.clone()
    # Row 5 reads its first 70 keys from slot B, whose copy of them is the only one.
    share_slots[5], share_lens[5] = B, 70
    for cache in (k_cache, v_cache):
        cache[B, :70] = cache[5, :70]
        cache[5, :70] = float("nan")
    attended = lengths.clone()
    attended[4] = 1
    q, new_k, new_v = torch.randn(B, H, D, generator=g), torch.randn(B, Hkv, D, generator=g), torch.randn(B, Hkv, D, generator=g)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = slot_decode(q, want_k, want_v, slots, lengths, share_slots, share_lens, new_k, new_v, attended)
    assert not want.isnan().any()
    for splits in (1, 2, 3, 8):
        got_k, got_v = k_cache.clone(), v_cache.clone()
        got = split_slot_attention(q, got_k, got_v, slots, lengths, share_slots, share_lens, new_k, new_v, attended, splits)
        close(got, want, tol=1e-5)
        assert torch.equal(got_k.nan_to_num(7.0), want_k.nan_to_num(7.0))
        assert torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0))
        again = split_slot_attention(q, got_k, got_v, slots, lengths, share_slots, share_lens, new_k, new_v, attended,
                                     splits)
        assert torch.equal(again, got), splits


def check_slot_step() -> None:
    """The decode step's slot-state kernels (grpo/engine/slot_kernels.py) against slot_step.py's
    plain torch: rows that go on, finish on EOS or at their budget, a finished row, and padding
    rows on the scratch slot; more rows than one program's block."""
    from types import SimpleNamespace

    from grpo.engine import slot_kernels, slot_step

    g = torch.Generator().manual_seed(5)
    n_slots, max_len, eos_ids = 300, 40, torch.tensor([7, 11])
    scratch = n_slots
    state = SimpleNamespace(
        last_token=torch.randint(0, 50, (n_slots + 1,), generator=g),
        position=torch.randint(0, 30, (n_slots + 1,), generator=g),
        key=torch.randint(0, 2**32, (n_slots + 1,), generator=g),
        budget=torch.randint(2, max_len, (n_slots + 1,), generator=g),
        generated=torch.randint(0, 2, (n_slots + 1,), generator=g),
        done=torch.rand(n_slots + 1, generator=g) < 0.1,
        eos=torch.zeros(n_slots + 1, dtype=torch.bool),
        out_tokens=torch.randint(0, 50, (n_slots + 1, max_len), generator=g),
        out_logprobs=torch.randn(n_slots + 1, max_len, generator=g),
        share_slot=torch.randint(0, n_slots, (n_slots + 1,), generator=g),
        share_len=torch.randint(0, 20, (n_slots + 1,), dtype=torch.int32, generator=g),
    )
    state.done[scratch], state.budget[:5] = True, state.generated[:5] + 1  # rows 0-4 end at their budget
    rows = torch.cat([torch.randperm(n_slots, generator=g)[:270], torch.full((20,), scratch)])
    new = torch.randint(0, 50, (len(rows),), generator=g)
    new[:40:4] = 7  # some rows draw EOS
    logprob = torch.randn(len(rows), generator=g)

    want = slot_step.read_slots(state, rows)
    got = slot_kernels.read_slots(state, rows)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    after = SimpleNamespace(**{k: v.clone() for k, v in vars(state).items()})
    slot_step.advance_slots(state, rows, new, logprob, eos_ids)
    slot_kernels.advance_slots(after, rows, new, logprob, eos_ids)
    for name, value in vars(state).items():
        assert torch.equal(value, getattr(after, name)), name
    # The batch drew EOS on a row still going, and left a row that was already finished as it was.
    assert state.eos.any() and state.done[rows[:270]].sum() > 0


CHECKS = {"matmul": check_matmul, "gumbel_sample": check_gumbel_sample, "silu_mul": check_silu_mul,
          "rms_norm": check_rms_norm, "attention": check_attention, "slot_step": check_slot_step,
          "gradients": check_gradients, "prefix_merge": check_prefix_merge, "split_decode": check_split_decode,
          # an engine batch of 24 with a few episodes packed per training row
          "pipeline_batch_24": lambda: check_pipeline(24, 64, prompts=8)}

if __name__ == "__main__":
    # Several checks in one process (each process spends seconds importing torch and Triton); each
    # prints "<check>: ok" or its traceback, and the exit status counts the failures.
    failed = 0
    for name in sys.argv[1:]:
        try:
            CHECKS[name]()
        except Exception:
            failed += 1
            print(f"{name}: failed\n{traceback.format_exc()}", flush=True)
        else:
            print(f"{name}: ok", flush=True)
    sys.exit(failed)
