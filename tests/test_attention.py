"""Attention over packed sequences and from the engine's slots, and the model over packed rows: each
against every sequence run alone or a plain SDPA reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import model.logprob_head as logprob_head
from model import TokenLogprobs
from model.attention import packed_attention, sequence_layout
from tests.native_models import native_model, pack


@pytest.mark.parametrize("chunk_tokens", [1024, 7])  # 7: chunks straddle sequence and row boundaries
def test_packed_rows_match_separate_sequences(chunk_tokens, monkeypatch):
    monkeypatch.setattr(logprob_head, "LOGPROB_CHUNK_TOKENS", chunk_tokens)
    model = native_model()
    V = model.args.vocab_size
    gen = torch.Generator().manual_seed(3)
    lengths = [[5, 1, 9, 3, 7], [11, 6]]  # a sequence of length 1; row 1 ends in 8 padding tokens
    row_len = 25
    seqs = [[torch.randint(V, (n,), generator=gen) for n in row] for row in lengths]
    seq_targets = [[torch.randint(V, (n,), generator=gen) for n in row] for row in lengths]

    packed = [pack(row, row_len) for row in seqs]
    tokens = torch.stack([p[0] for p in packed])
    positions = torch.stack([p[1] for p in packed])
    doc_ids = torch.stack([p[2] for p in packed])
    targets = torch.zeros_like(tokens)
    real = torch.zeros_like(tokens, dtype=torch.bool)
    for r, row in enumerate(seq_targets):
        flat = torch.cat(row)
        targets[r, : len(flat)] = flat
        real[r, : len(flat)] = True
    assert not real[1].all()  # padding is really there

    # packed: one forward, loss = sum of log-probs over real tokens (divided by their count, as a
    # training loss is: keeps fp32 gradients O(1) so that 1e-5 is a tight absolute tolerance)
    n_real = int(real.sum())
    out = model(tokens, positions, doc_ids, targets=targets)
    assert isinstance(out, TokenLogprobs)
    assert out.logprobs.shape == out.entropy.shape == tokens.shape
    assert out.logprobs.dtype == out.entropy.dtype == torch.float32
    ((out.logprobs * real).sum() / n_real).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # reference: every sequence alone, default positions, plain causal attention
    for r, row in enumerate(seqs):
        start = 0
        for seq, tgt in zip(row, seq_targets[r]):
            alone = model(seq[None], targets=tgt[None])
            (alone.logprobs.sum() / n_real).backward()
            end = start + len(seq)
            torch.testing.assert_close(out.logprobs[r, start:end], alone.logprobs[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(out.entropy[r, start:end], alone.entropy[0], atol=1e-5, rtol=0)
            start = end
    for name, param in model.named_parameters():
        assert param.grad.abs().max() > 0, name
        torch.testing.assert_close(packed_grads[name], param.grad, atol=1e-5, rtol=0, msg=name)


def test_sequence_layout_reads_runs_of_equal_doc_ids_per_row():
    doc_ids = torch.tensor([[0, 0, 1, 2, 2, 2], [2, 2, 3, -1, -1, -1]])  # row 1 starts a new sequence
    layout = sequence_layout(doc_ids, (2, 6), torch.device("cpu"))
    assert layout.bounds == [0, 2, 3, 6, 8, 9, 12] and layout.max_len == 3
    assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens.tolist() == layout.bounds
    assert sequence_layout(None, (2, 6), torch.device("cpu")).bounds == [0, 6, 12]


def test_sequence_layout_cuts_a_segment_per_group_from_its_prefix():
    """group_ids: group 0's prefix (doc id -1, tokens 0-1) is continued by its sequences 5 and 6
    (tokens 2-3, 4); sequence 2 (tokens 5-7) is in no group; group 1's prefix (tokens 8-10) is
    continued by sequence 7 (tokens 11-12)."""
    doc_ids = torch.tensor([[-1, -1, 5, 5, 6, 2, 2, 2, -1, -1, -1, 7, 7]])
    group_ids = torch.tensor([[0, 0, 0, 0, 0, -1, -1, -1, 1, 1, 1, 1, 1]])
    layout = sequence_layout(doc_ids, (1, 13), torch.device("cpu"), group_ids)
    assert layout.bounds == [0, 2, 4, 5, 8, 11, 13]
    shared = layout.shared
    assert shared.segment_bounds == [0, 8, 13] and shared.cu_segments.tolist() == [0, 8, 13] and shared.max_segment == 8
    assert shared.prefix_index.tolist() == [0, 1, 8, 9, 10]
    assert shared.prefix_bounds == [0, 2, 5] and shared.cu_prefix.tolist() == [0, 2, 5] and shared.max_prefix == 3
    assert shared.continues.tolist() == [False, False, True, True, True, False, False, False, False, False, False,
                                         True, True]
    assert sequence_layout(doc_ids, (1, 13), torch.device("cpu"), torch.full((1, 13), -1)).shared is None
    with pytest.raises(ValueError, match="group 3 has no prefix run"):
        sequence_layout(torch.tensor([[4, 4]]), (1, 2), torch.device("cpu"), torch.tensor([[3, 3]]))
    with pytest.raises(ValueError, match="group 0 \\(tokens 5:6\\) lies outside its group's segment"):
        sequence_layout(torch.tensor([[-1, 4, -1, -1, 5, 6]]), (1, 6), torch.device("cpu"),
                        torch.tensor([[0, 0, 1, 1, 1, 0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_attention_equals_each_sequence_after_its_prefix(dtype):
    """Two groups (prefixes of 3 and 1 tokens) and a lone sequence, GQA, forward and gradients,
    against one causal SDPA per sequence over its prefix's keys then its own, in float64."""
    gen = torch.Generator().manual_seed(6)
    doc_ids = torch.tensor([[9, 9, -1, -1, -1, 0, 0, 1, 1, 1, 1, 2, -1, 3, 3, 3]])
    group_ids = torch.tensor([[-1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    N, H, Hkv, D = 16, 4, 2, 8
    q, k, v = (torch.randn(1, N, h, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv))
    grad = torch.randn(1, N, H, D, generator=gen, dtype=torch.float64)
    layout = sequence_layout(doc_ids, (1, N), torch.device("cpu"), group_ids)
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    packed_attention(*inputs, layout).backward(grad.to(dtype))

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    # (own tokens, prefix tokens) of each sequence
    sequences = [(range(0, 2), range(0)), (range(2, 5), range(0)), (range(5, 7), range(2, 5)),
                 (range(7, 11), range(2, 5)), (range(11, 12), range(2, 5)), (range(12, 13), range(0)),
                 (range(13, 16), range(12, 13))]
    out = torch.zeros(N, H, D, dtype=torch.float64)
    for own, prefix in sequences:
        keys = list(prefix) + list(own)
        visible = torch.arange(len(keys))[None, :] <= torch.arange(len(prefix), len(keys))[:, None]
        out[list(own)] = F.scaled_dot_product_attention(
            ref[0][0, list(own)].transpose(0, 1), ref[1][0, keys].transpose(0, 1), ref[2][0, keys].transpose(0, 1),
            attn_mask=visible, enable_gqa=True).transpose(0, 1)
    out.backward(grad[0])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in zip(inputs, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(packed_attention(*(t.to(dtype) for t in (q, k, v)), layout)[0].double(), out.detach(),
                               atol=tol, rtol=tol)


def test_packed_attention_equals_each_sequence_alone():
    """Mixed lengths, 1 included, against one plain causal SDPA per sequence (fp32, GQA)."""
    gen = torch.Generator().manual_seed(5)
    lengths = [4, 1, 9, 2]
    N, H, Hkv, D = sum(lengths), 4, 2, 8
    q = torch.randn(1, N, H, D, generator=gen)
    k, v = torch.randn(1, N, Hkv, D, generator=gen), torch.randn(1, N, Hkv, D, generator=gen)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    out = packed_attention(q, k, v, sequence_layout(doc_ids, (1, N), torch.device("cpu")))
    start = 0
    for n in lengths:
        qs, ks, vs = (t[0, start : start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(H // Hkv, 0), vs.repeat_interleave(H // Hkv, 0)
        scores = (qs @ ks.transpose(1, 2)) / D**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want = (scores.softmax(-1) @ vs).transpose(0, 1)
        torch.testing.assert_close(out[0, start : start + n], want, atol=1e-5, rtol=0)
        start += n


@pytest.mark.parametrize("invariant", [False, True])
def test_slot_decode_attends_to_each_rows_first_keys(invariant):
    """slot_decode with attended: row b attends to its first attended[b] keys only (the keys after
    them hold huge values), against plain softmax attention over those keys; attended = lengths is
    the whole slot."""
    from model import batch_invariant
    from model.attention import slot_decode

    gen = torch.Generator().manual_seed(6)
    H, Hkv, D, L = 4, 2, 8, 50
    lengths, counts = [50, 40, 7, 33], [50, 1, 3, 17]
    k_cache, v_cache = torch.randn(4, L, Hkv, D, generator=gen), torch.randn(4, L, Hkv, D, generator=gen)
    q = torch.randn(4, H, D, generator=gen)
    whole = slot_decode(q, k_cache, v_cache, torch.arange(4), torch.tensor(lengths, dtype=torch.int32))
    for b, count in enumerate(counts):
        # Values that would dominate any row that attended to them (NaN would leak through the plain
        # path's zero weights even where it does not attend).
        k_cache[b, count:], v_cache[b, count:] = 1e4, 1e4
    batch_invariant.enable(invariant)
    try:
        out = slot_decode(q, k_cache, v_cache, torch.arange(4), torch.tensor(lengths, dtype=torch.int32),
                          attended=torch.tensor(counts, dtype=torch.int32))
    finally:
        batch_invariant.enable(False)
    for b, count in enumerate(counts):
        keys = k_cache[b, :count].repeat_interleave(H // Hkv, 1).transpose(0, 1)  # [H, n, D]
        values = v_cache[b, :count].repeat_interleave(H // Hkv, 1).transpose(0, 1)
        weights = ((q[b, :, None] @ keys.transpose(1, 2)) / D**0.5).softmax(-1)
        torch.testing.assert_close(out[b], (weights @ values)[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[0], whole[0], atol=1e-6, rtol=0)


def test_packed_attention_runs_the_chosen_cuda_kernel(monkeypatch):
    """model.train_attention's choice reaches the packed attention: with the fast kernels serving,
    "fa4" calls FlashAttention 4 and "flash" aten's ops, each on the flat [N, H, D] token axis and the
    layout's bounds (the kernels are recorded here; the GPU tests run them)."""
    import model.attention as attention

    calls = []

    def recorder(name):
        def kernel(q, k, v, cu_seqlens, max_len):
            calls.append((name, tuple(q.shape), tuple(k.shape), cu_seqlens.tolist(), max_len))
            return attention._by_length(q, k, v, cu_seqlens.tolist())
        return kernel

    monkeypatch.setattr(attention, "uses_flash", lambda t: True)
    monkeypatch.setattr(attention.fa4, "packed_causal", recorder("fa4"))
    monkeypatch.setattr(attention, "_varlen_causal", lambda q, k, v, layout: recorder("flash")(
        q, k, v, layout.cu_seqlens, layout.max_len))
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 4, 8, generator=gen)
    k, v = torch.randn(1, 8, 2, 8, generator=gen), torch.randn(1, 8, 2, 8, generator=gen)
    layout = sequence_layout(torch.tensor([[0] * 3 + [1] * 5]), (1, 8), torch.device("cpu"))
    want = attention._by_length(q[0], k[0], v[0], [0, 3, 8])
    try:
        for name in ("fa4", "flash"):
            attention.set_packed_kernel(name)
            out = packed_attention(q, k, v, layout)
            torch.testing.assert_close(out[0], want)
    finally:
        attention.set_packed_kernel("flash")
    assert calls == [(name, (8, 4, 8), (8, 2, 8), [0, 3, 8], 5) for name in ("fa4", "flash")]
    with pytest.raises(ValueError, match="expected one of"):
        attention.set_packed_kernel("fa3")


def test_decode_splits_give_rows_more_programs_only_where_they_leave_the_device_idle():
    """decode_splits, by hand: rows × K/V heads below the SM count (132, an H100's or H200's)
    get ranges enough for 3 programs an SM (396)."""
    from model.decode_kernel import decode_splits

    sms = 132
    assert decode_splits(256, 8, 384, sms) == 1  # 2,048 programs already
    assert decode_splits(17, 8, 384, sms) == 1  # 136: every SM has one
    assert decode_splits(16, 8, 384, sms) == 4  # 128 -> 512
    assert decode_splits(8, 8, 4096, sms) == 7  # 64 -> 448
    assert decode_splits(1, 8, 4096, sms) == 8  # at most 8 ranges
    assert decode_splits(1, 8, 100, sms) == 2  # at most one range per 64-key block of the slot
