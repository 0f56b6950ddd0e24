"""The log-prob head (model/logprob_head.py): log-probs, entropy and gradients against the full
logits' plain formulas, and the memory its chunks bound."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import model.logprob_head as logprob_head
from model import ModelArgs, Transformer
from tests.native_models import native_model, pack, random_tokens, randomize_


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_full_logits(temperature, monkeypatch):
    monkeypatch.setattr(logprob_head, "LOGPROB_CHUNK_TOKENS", 5)
    model = native_model(seed=1, tie_embeddings=True)
    V = model.args.vocab_size
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(V, (n,), generator=gen) for n in (6, 10)]
    tokens, positions, doc_ids = (t[None] for t in pack(seqs, 19))  # 3 padding tokens at the end
    targets = torch.randint(V, tokens.shape, generator=gen)
    with torch.no_grad():
        out = model(tokens, positions, doc_ids, targets=targets, temperature=temperature)
        logits = model(tokens, positions, doc_ids).double() / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    expected_lp = log_p.gather(-1, targets[..., None]).squeeze(-1)
    expected_entropy = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(out.logprobs.double(), expected_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), expected_entropy, atol=1e-5, rtol=0)
    assert expected_entropy.min() > 0.1  # distributions are not degenerate


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_gradient_matches_autograd_of_the_plain_formula(temperature, monkeypatch):
    """The head's closed-form backward (model/logprob_head.py) against autograd through full
    logits and log_softmax, float64, for a loss that uses both log-probs and entropy."""
    monkeypatch.setattr(logprob_head, "LOGPROB_CHUNK_TOKENS", 5)  # chunks straddle rows
    gen = torch.Generator().manual_seed(9)
    B, T, D, V = 2, 7, 6, 11
    hidden = torch.randn(B, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(V, (B, T), generator=gen)
    a, b = torch.randn(B, T, generator=gen, dtype=torch.float64), torch.randn(B, T, generator=gen, dtype=torch.float64)

    lp, ent = logprob_head.target_logprobs(hidden, weight, targets, temperature)
    ((lp * a).sum() + (ent * b).sum()).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    log_p = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    want_lp = log_p.gather(-1, targets[..., None]).squeeze(-1)
    want_ent = -(log_p.exp() * log_p).sum(-1)
    ((want_lp * a).sum() + (want_ent * b).sum()).backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-12, rtol=0)
    torch.testing.assert_close(got[0], hidden.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(got[1], weight.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_head_on_masked_tokens_gives_their_logprobs_and_gradients(invariant, monkeypatch):
    """head_mask: the output head runs on the masked tokens only. Their log-probs and entropies are
    those of the whole-row call (bitwise with batch-invariant numerics), every other token gets 0,
    and the gradients of a masked loss are those of the whole-row call's."""
    monkeypatch.setattr(logprob_head, "LOGPROB_CHUNK_TOKENS", 5)
    model = native_model(seed=3, tie_embeddings=False)
    V = model.args.vocab_size
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(V, (n,), generator=gen) for n in (9, 12)]
    tokens, positions, doc_ids = (t[None] for t in pack(seqs, 24))
    targets = torch.randint(V, tokens.shape, generator=gen)
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    mask[0, 4:9] = mask[0, 13:21] = True
    weights = torch.randn(tokens.shape, generator=gen)

    def run(head_mask):
        model.zero_grad()
        out = model(tokens, positions, doc_ids, targets=targets, head_mask=head_mask)
        ((out.logprobs + out.entropy) * weights * mask).sum().backward()
        return out, {name: p.grad.clone() for name, p in model.named_parameters()}

    from model import batch_invariant

    batch_invariant.enable(invariant)
    try:
        (full, full_grads), (part, part_grads) = run(None), run(mask)
    finally:
        batch_invariant.enable(False)
    assert torch.equal(part.logprobs[~mask], torch.zeros((~mask).sum().item()))
    assert torch.equal(part.entropy[~mask], torch.zeros((~mask).sum().item()))
    if invariant:
        assert torch.equal(part.logprobs[mask], full.logprobs[mask])
        assert torch.equal(part.entropy[mask], full.entropy[mask])
    torch.testing.assert_close(part.logprobs[mask], full.logprobs[mask], atol=1e-6, rtol=0)
    torch.testing.assert_close(part.entropy[mask], full.entropy[mask], atol=1e-6, rtol=0)
    assert part_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(part_grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_head_with_no_masked_token_still_gives_the_weight_a_gradient():
    """A micro-batch without loss tokens: all log-probs 0, and the output weight's gradient is
    zeros rather than missing (FSDP reduces the same gradients on every rank)."""
    model = native_model(seed=3, tie_embeddings=False)
    tokens = torch.randint(model.args.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    out = model(tokens, targets=tokens, head_mask=torch.zeros(1, 6, dtype=torch.bool))
    assert torch.equal(out.logprobs, torch.zeros(1, 6)) and torch.equal(out.entropy, torch.zeros(1, 6))
    out.logprobs.sum().backward()
    assert model.output.weight.grad is not None and not model.output.weight.grad.any()


@pytest.mark.parametrize("kept_chunks", [1, 3, 4])
def test_kept_logits_give_the_recomputed_outputs_and_gradients_bitwise(kept_chunks, monkeypatch):
    """The head's backward reads the forward's logits for as many chunks as keep_budget holds and
    recomputes the others, with exactly the outputs and gradients of recomputing every chunk; a
    call without a backward to come keeps nothing."""
    monkeypatch.setattr(logprob_head, "LOGPROB_CHUNK_TOKENS", 5)
    gen = torch.Generator().manual_seed(11)
    N, D, V = 20, 6, 13  # 4 chunks
    hidden = torch.randn(1, N, D, generator=gen, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, requires_grad=True)
    targets = torch.randint(V, (1, N), generator=gen)
    a, b = torch.randn(1, N, generator=gen), torch.randn(1, N, generator=gen)
    computed = []
    plain_logits = logprob_head._logits

    def counted_logits(h, w):
        computed.append(h.shape[0])
        return plain_logits(h, w)

    monkeypatch.setattr(logprob_head, "_logits", counted_logits)

    def run(budget):
        monkeypatch.setattr(logprob_head, "keep_budget", lambda device: budget)
        hidden.grad = weight.grad = None
        lp, ent = logprob_head.target_logprobs(hidden, weight, targets, 0.7)
        computed.clear()
        ((lp * a).sum() + (ent * b).sum()).backward()
        return (lp, ent, hidden.grad, weight.grad), len(computed)

    want, recomputed = run(0)
    assert recomputed == 4
    chunk_bytes = 5 * V * 4
    got, recomputed = run(kept_chunks * chunk_bytes + chunk_bytes // 2)
    assert recomputed == 4 - kept_chunks
    for name, g, w in zip(("logprobs", "entropy", "hidden grad", "weight grad"), got, want):
        assert torch.equal(g, w), name

    def no_budget(device):
        raise AssertionError("a call without a backward asked for a budget")

    monkeypatch.setattr(logprob_head, "keep_budget", no_budget)
    with torch.no_grad():
        logprob_head.target_logprobs(hidden, weight, targets, 0.7)


class LargestOutput(TorchDispatchMode):
    """Records the largest storage any aten op produces (bytes), i.e. the largest single allocation."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.largest_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                size = t.untyped_storage().nbytes()
                if size > self.largest:
                    self.largest, self.largest_op = size, str(func)
        return out


def test_chunked_logprobs_memory_bound(monkeypatch):
    monkeypatch.setattr(logprob_head, "LOGPROB_CHUNK_TOKENS", 1024)  # 4 chunks
    T, V = 4096, 32768
    args = ModelArgs(arch="llama", vocab_size=V, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                     ffn_dim=32, qk_norm=False, tie_embeddings=False)
    torch.manual_seed(0)
    model = randomize_(Transformer(args, dtype=torch.float32), seed=0, std=0.3)
    tokens = random_tokens(1, T, V, seed=7)
    targets = random_tokens(1, T, V, seed=8)
    naive_bytes = T * V * 4

    chunked = LargestOutput()
    with chunked:
        out = model(tokens, targets=targets)
        out.logprobs.sum().backward()
    assert model.output.weight.grad is not None and model.tok_embeddings.weight.grad.abs().sum() > 0
    assert chunked.largest < naive_bytes / 2, (chunked.largest, chunked.largest_op)

    # the naive path (full logits, then log_softmax) does create a [T, V] fp32 tensor: the probe can fail
    naive = LargestOutput()
    with torch.no_grad(), naive:
        logits = model(tokens)
    assert logits.dtype == torch.float32 and naive.largest >= naive_bytes
    # and the chunked values are right (checked on a slice, to keep the test quick)
    some = slice(T - 700, T)
    naive_lp = torch.log_softmax(logits[0, some], dim=-1).gather(-1, targets[0, some, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs[0, some].detach(), naive_lp, atol=1e-5, rtol=0)
