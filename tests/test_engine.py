"""NativeEngine (grpo/engine/) against a reference Transformer holding the same weights, run with
plain full forwards (`model(tokens)`, no KV cache, one sequence at a time)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.engine import GenerationRequest, NativeEngine, SamplingParams
from model import ModelArgs, Transformer
from tests.dist_utils import one_thread

V = 48
ARGS = ModelArgs(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
EOS = V - 1


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def ref() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS, dtype=torch.float32)
    # std 0.1 (not 0.02) so that the next-token distributions are far from uniform
    model.init_weights(std=0.1)
    return model.eval().requires_grad_(False)


def make_engine(ref: Transformer, sampling: SamplingParams, seed: int = 0, eos_ids=(EOS,), version: int = 1, **kw):
    engine = NativeEngine(ARGS, sampling, eos_ids=list(eos_ids), seed=seed, dtype=torch.float32, device="cpu", **kw)
    engine.update_weights([[(n, (), p) for n, p in ref.named_parameters()]], version=version)
    return engine


def prompts(n: int, seed: int = 1, lo: int = 2, hi: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(torch.randint(0, V - 1, (length,), generator=g).tolist())  # no EOS in prompts
    return out


def requests(prompt_list, samples: int = 1, step: int = 0) -> list[GenerationRequest]:
    return [GenerationRequest(p, step, i, s) for i, p in enumerate(prompt_list) for s in range(samples)]


@torch.no_grad()
def step_logits(ref: Transformer, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), V] fp32 logits of the reference full forward that predicted each completion token."""
    seq = prompt + completion
    logits = ref(torch.tensor([seq[:-1]]))[0].float()
    return logits[len(prompt) - 1 :]


@torch.no_grad()
def greedy_reference(ref: Transformer, prompt: list[int], max_new: int, eos_ids=(EOS,)):
    """Manual greedy loop on full forwards: (tokens, logprobs at temperature 1, stopped by eos)."""
    seq, toks, lps = list(prompt), [], []
    for _ in range(max_new):
        logits = ref(torch.tensor([seq]))[0, -1].float()
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) > 1e-4, "near-tie in the reference: greedy is ill-posed here"
        tok = int(logits.argmax())
        toks.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        seq.append(tok)
        if tok in eos_ids:
            return toks, lps, True
    return toks, lps, False


# --------------------------------------------------------------------------------------- greedy / logprobs


def test_greedy_matches_full_forward_argmax(ref):
    plist = prompts(6)
    assert len({len(p) for p in plist}) > 2  # right-padded batch of different prompt lengths
    engine = make_engine(ref, SamplingParams(max_new_tokens=10, temperature=0.0))
    out = engine.generate(requests(plist))
    assert [c.request.prompt_tokens for c in out] == plist
    for p, c in zip(plist, out):
        toks, lps, stopped = greedy_reference(ref, p, 10)
        assert c.tokens == toks
        # greedy scores at temperature 1
        assert c.logprobs == pytest.approx(lps, abs=1e-5)
        assert c.finish_reason == ("eos" if stopped else "length")
        assert c.version == 1


def test_sampled_logprobs_are_full_vocab_log_softmax_at_temperature(ref):
    plist = prompts(8, seed=2)
    for sampling in (
        SamplingParams(max_new_tokens=8, temperature=0.7),
        SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5),
        SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.5),
    ):
        engine = make_engine(ref, sampling, seed=3)
        out = engine.generate(requests(plist, samples=2))
        for c in out:
            assert len(c.tokens) == len(c.logprobs) >= 1
            logits = step_logits(ref, c.request.prompt_tokens, c.tokens)
            # log softmax(logits / T) over the full vocabulary, not the truncated distribution
            expected = [float(torch.log_softmax(logits[j] / 0.7, -1)[t]) for j, t in enumerate(c.tokens)]
            assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) <= 1e-5


def _sample_steps(ref, sampling: SamplingParams, n_requests: int = 64, seed: int = 0):
    """(logits, token) for every generated step of n_requests requests (4 prompts x 16 samples)."""
    engine = make_engine(ref, sampling, seed=seed)
    plist = prompts(n_requests // 16, seed=4)
    out = engine.generate(requests(plist, samples=16))
    steps = []
    for c in out:
        logits = step_logits(ref, c.request.prompt_tokens, c.tokens)
        steps.extend((logits[j] / sampling.temperature, t) for j, t in enumerate(c.tokens))
    return steps


def test_top_k_never_emits_outside_top_k(ref):
    k = 4
    steps = _sample_steps(ref, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=k))
    assert len(steps) > 200
    non_argmax = kth_drawn = 0
    expected_top1, var, expected_kth = 0.0, 0.0, 0.0
    for scaled, tok in steps:
        vals = scaled.tolist()
        order = sorted(range(V), key=lambda i: -vals[i])
        assert tok in order[:k], (tok, order[:k])
        non_argmax += tok != order[0]
        kth_drawn += tok == order[k - 1]
        # probabilities of the top and the k-th token under the renormalised top-k distribution
        mass = [math.exp(vals[i]) for i in order[:k]]
        p1 = mass[0] / sum(mass)
        expected_top1 += p1
        var += p1 * (1 - p1)
        expected_kth += mass[-1] / sum(mass)
    assert non_argmax > 0  # really sampled, not greedy
    assert expected_kth > 8 and kth_drawn > 0  # the k-th token is in the set (no off-by-one)
    top1 = sum(tok == int(s.argmax()) for s, tok in steps)
    # the draw follows the renormalised distribution (5 sigma)
    assert abs(top1 - expected_top1) < 5 * math.sqrt(var)


def _nucleus(vals: list[float], p: float, slack: float = 0.0) -> set[int]:
    """Smallest set of most likely tokens whose probability reaches p (slack widens the cut a hair)."""
    z = sum(math.exp(v) for v in vals)
    allowed, cum = set(), 0.0
    for i in sorted(range(len(vals)), key=lambda i: -vals[i]):
        if cum >= p + slack:
            break
        allowed.add(i)
        cum += math.exp(vals[i]) / z
    return allowed


def test_top_p_never_emits_outside_nucleus(ref):
    p = 0.6
    steps = _sample_steps(ref, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=p), seed=1)
    assert len(steps) > 200
    sizes = []
    crossing_drawn, expected_crossing = 0, 0.0
    for scaled, tok in steps:
        vals = scaled.tolist()
        nucleus = _nucleus(vals, p, slack=1e-6)
        assert tok in nucleus, (tok, sorted(nucleus))
        strict = _nucleus(vals, p)
        sizes.append(len(strict))
        # the token whose mass takes the nucleus past p belongs to it
        crossing = min(strict, key=lambda i: vals[i])
        crossing_drawn += tok == crossing
        z = sum(math.exp(vals[i]) for i in strict)
        expected_crossing += math.exp(vals[crossing]) / z
    # the filter really excludes tokens, and the nucleus is not a single token
    assert max(sizes) < V and sum(sizes) / len(sizes) > 1.5
    assert expected_crossing > 8 and crossing_drawn > 0  # P(miss) ~ exp(-expected)
    assert len({tok for _, tok in steps}) > 2


def test_unfiltered_sampling_follows_the_distribution(ref):
    steps = _sample_steps(ref, SamplingParams(max_new_tokens=8, temperature=1.0), seed=2)
    observed = expected = var = 0.0
    for scaled, tok in steps:
        probs = torch.softmax(scaled.double(), -1)
        top = int(probs.argmax())
        observed += tok == top
        expected += float(probs[top])
        var += float(probs[top] * (1 - probs[top]))
    assert abs(observed - expected) < 5 * math.sqrt(var)


def test_top_k_1_equals_greedy(ref):
    plist = prompts(8, seed=5)
    greedy = make_engine(ref, SamplingParams(max_new_tokens=8, temperature=0.0)).generate(requests(plist))
    top1 = make_engine(ref, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1), seed=9).generate(
        requests(plist)
    )
    for g, t in zip(greedy, top1):
        assert t.tokens == g.tokens
        assert t.logprobs == pytest.approx(g.logprobs, abs=1e-6)  # both at temperature 1


# --------------------------------------------------------------------------------------- determinism


def _key(c):
    r = c.request
    return (r.step, r.prompt_index, r.sample_index)


def test_batch_size_invariance(ref):
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
    reqs = requests(prompts(4, seed=6), samples=4, step=3)
    assert len(reqs) == 16
    whole = {_key(c): c for c in make_engine(ref, sampling, max_batch_size=256).generate(reqs)}
    # shuffled order: the draw is keyed by the request, not its batch slot
    shuffled = [reqs[i] for i in torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()]
    by_three = make_engine(ref, sampling, max_batch_size=3).generate(shuffled)
    assert [c.request for c in by_three] == shuffled  # poll returns them in submission order
    engine = make_engine(ref, sampling)
    alone = [engine.generate([r])[0] for r in reqs]
    for variant in (by_three, alone):
        for c in variant:
            w = whole[_key(c)]
            assert c.tokens == w.tokens
            assert c.logprobs == pytest.approx(w.logprobs, abs=1e-5)
            assert c.finish_reason == w.finish_reason
    # different sample indices of one prompt give different completions
    for prompt_index in range(4):
        samples = {tuple(whole[(3, prompt_index, s)].tokens) for s in range(4)}
        assert len(samples) > 1


def test_seed_determines_samples(ref):
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
    reqs = requests(prompts(4, seed=7), samples=4)
    a = make_engine(ref, sampling, seed=11).generate(reqs)
    b = make_engine(ref, sampling, seed=11).generate(reqs)
    c = make_engine(ref, sampling, seed=12).generate(reqs)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert sum(x.tokens != y.tokens for x, y in zip(a, c)) >= 4
    # the step is part of the key too
    d = make_engine(ref, sampling, seed=11).generate(requests(prompts(4, seed=7), samples=4, step=1))
    assert sum(x.tokens != y.tokens for x, y in zip(a, d)) >= 4


def test_padding_does_not_leak_into_completions(ref):
    # one long and several short prompts, greedy and sampled: batched == alone
    plist = [list(range(1, 15)), [5], [7, 8], list(range(20, 26))]
    for sampling in (SamplingParams(max_new_tokens=6, temperature=0.0), SamplingParams(max_new_tokens=6, temperature=0.8)):
        engine = make_engine(ref, sampling, seed=4)
        batched = engine.generate(requests(plist, samples=2))
        for c in batched:
            alone = engine.generate([c.request])[0]
            assert c.tokens == alone.tokens
            assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        if sampling.temperature == 0.0:
            for c in batched:
                assert c.tokens == greedy_reference(ref, c.request.prompt_tokens, 6)[0]


def test_mixed_sampling_params_in_one_poll(ref):
    plist = prompts(3, seed=8)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    engine = make_engine(ref, SamplingParams(max_new_tokens=5, temperature=1.0), seed=2)
    engine.submit(requests(plist)[:2])
    engine.submit(requests(plist)[2:], greedy)
    engine.submit(requests(plist)[:1], greedy)
    out = engine.poll()
    assert len(out) == 4
    alone_sampled = make_engine(ref, SamplingParams(max_new_tokens=5, temperature=1.0), seed=2).generate(requests(plist)[:2])
    assert [c.tokens for c in out[:2]] == [c.tokens for c in alone_sampled]
    assert out[2].tokens == greedy_reference(ref, plist[2], 5)[0]
    assert out[3].tokens == greedy_reference(ref, plist[0], 5)[0]
    assert engine.poll() == []


# --------------------------------------------------------------------------------------- stopping


def _first_new(tokens: list[int], start: int) -> int:
    """Index k >= start of the first token that did not appear before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_eos_stops_and_is_kept_length_otherwise(ref):
    plist = prompts(6, seed=9)
    free_runs = [greedy_reference(ref, p, 10, eos_ids=())[0] for p in plist]
    k = _first_new(free_runs[0], 2)
    eos = free_runs[0][k]
    engine = make_engine(ref, SamplingParams(max_new_tokens=10, temperature=0.0), eos_ids=(eos, EOS))
    out = engine.generate(requests(plist))
    reasons = set()
    for c, run in zip(out, free_runs):
        stop = next((j for j, t in enumerate(run) if t in (eos, EOS)), None)
        if stop is None:
            assert c.finish_reason == "length"
            assert c.tokens == run and len(c.tokens) == 10
        else:
            assert c.finish_reason == "eos"
            assert c.tokens == run[: stop + 1]  # EOS kept as the last token, nothing after it
            assert c.tokens[-1] in (eos, EOS)
        assert len(c.logprobs) == len(c.tokens)
        reasons.add(c.finish_reason)
    assert out[0].tokens == free_runs[0][: k + 1] and out[0].finish_reason == "eos"
    assert reasons == {"eos", "length"}


def _decode(ids: list[int]) -> str:
    return "".join(chr(ord("A") + i) for i in ids)


@pytest.mark.parametrize("overlap_checks", [False, True], ids=["checks-read-at-once", "next-steps-queued-first"])
def test_stop_string_ends_completion(ref, overlap_checks):
    """With the next steps queued before a check is read, a row its stop string ended goes on
    decoding for an interval; its completion still ends at the stop string."""
    plist = prompts(4, seed=10)
    free_runs = [greedy_reference(ref, p, 12, eos_ids=())[0] for p in plist]
    run = free_runs[0]
    # a 2-character stop string whose first occurrence ends at token k >= 3
    k = next(k for k in range(3, len(run)) if _decode(run[k - 1 : k + 1]) not in _decode(run[:k]))
    stop = _decode(run[k - 1 : k + 1])
    engine = make_engine(
        ref, SamplingParams(max_new_tokens=12, temperature=0.0), eos_ids=(EOS,), stop_strings=[stop], decode_text=_decode,
        overlap_checks=overlap_checks, sync_every=2,
    )
    out = engine.generate(requests(plist))
    c = out[0]
    assert c.finish_reason == "stop"
    assert c.tokens == run[: k + 1]
    text = _decode(c.tokens)
    assert text.endswith(stop) and stop not in text[:-1]  # nothing generated after the stop string
    for c, run in zip(out[1:], free_runs[1:]):
        text = _decode(run)
        if stop not in text and EOS not in run:
            assert c.finish_reason == "length" and c.tokens == run


def test_stop_strings_need_decode_text():
    with pytest.raises(ValueError, match="decode_text"):
        NativeEngine(ARGS, SamplingParams(4), eos_ids=[EOS], seed=0, dtype=torch.float32, device="cpu", stop_strings=["x"])


# --------------------------------------------------------------------------------------- weights


def test_update_weights_unknown_name_raises(ref):
    engine = make_engine(ref, SamplingParams(4))
    with pytest.raises(KeyError, match="layers.0.no_such.weight"):
        engine.update_weights([[("layers.0.no_such.weight", (), torch.zeros(3))]], version=2)


def test_update_weights_copies_into_own_storage(ref):
    engine = NativeEngine(ARGS, SamplingParams(4), eos_ids=[EOS], seed=0, dtype=torch.float32, device="cpu")
    before = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    source = {n: p.detach().clone() for n, p in ref.named_parameters()}
    names = list(source)
    # several buckets, whole parameters (empty index)
    engine.update_weights([[(n, (), source[n]) for n in names[:3]], [(n, (), source[n]) for n in names[3:]]], version=7)
    assert engine.version == 7
    after = dict(engine.model.named_parameters())
    assert set(after) == set(source)
    for n, p in after.items():
        assert p.data_ptr() == before[n], n  # written in place
        assert p.data_ptr() != source[n].data_ptr(), n
        assert torch.equal(p, source[n]), n
    # no aliasing: changing the source afterwards leaves the engine untouched
    for t in source.values():
        t.add_(1.0)
    for n, p in after.items():
        assert torch.equal(p + 1.0, source[n]), n
    out = engine.generate(requests(prompts(1)))
    assert out[0].version == 7


def test_update_weights_by_slices(ref):
    """Pieces of a parameter (index = tuple of slices) land where the index says, in any bucket order."""
    engine = make_engine(ref, SamplingParams(4))
    name = "layers.1.feed_forward.w1.weight"  # [ffn_dim, dim] = [64, 32]
    param = dict(engine.model.named_parameters())[name]
    ptr = param.data_ptr()
    new = torch.arange(64 * 32, dtype=torch.float32).view(64, 32) / 1000
    pieces = [
        (name, (slice(40, 64),), new[40:]),
        (name, (slice(0, 40), slice(0, 10)), new[:40, :10]),
        (name, (slice(0, 40), slice(10, 32)), new[:40, 10:]),
    ]
    engine.update_weights([pieces[:1], pieces[1:]], version=3)
    assert param.data_ptr() == ptr
    assert torch.equal(param, new)
    # other parameters untouched
    for n, p in engine.model.named_parameters():
        if n != name:
            assert torch.equal(p, dict(ref.named_parameters())[n]), n


def test_update_weights_refuses_a_wrong_shape():
    engine = NativeEngine(ARGS, SamplingParams(max_new_tokens=2), eos_ids=[0], seed=0, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="'norm.weight' has shape \\[1\\], the engine holds \\[32\\]"):
        engine.update_weights([[("norm.weight", (), torch.ones(1))]], version=1)
