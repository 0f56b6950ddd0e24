"""The engine against HF transformers and against itself under every batching it can do.

- Greedy completions equal HF `generate` (one prompt at a time, fp32) for tiny random Qwen3,
  Llama 3 and Qwen2 checkpoints, with prompts of mixed lengths in one engine batch.
- A request's tokens and log-probs do not depend on its company: alone, in a full batch, admitted
  into a refilled slot (more requests than slots), and with prompt-prefill sharing on or off.
- The KV cache never holds more sequences than its budget allows.
"""

from __future__ import annotations

import pytest
import torch

from grpo.engine import GenerationRequest, NativeEngine, SamplingParams
from grpo.engine.cache import slot_bytes
from model import from_hf
from tests.dist_utils import one_thread
from tests.hf_models import ARCHS, make_hf
from tests.test_engine import ARGS, EOS, make_engine, prompts, ref  # noqa: F401 (ref: a fixture)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate(arch, tmp_path):
    hf = make_hf(arch, seed=3)
    hf.save_pretrained(str(tmp_path))
    native = from_hf(str(tmp_path), dtype=torch.float32, device="cpu")
    V = native.args.vocab_size
    g = torch.Generator().manual_seed(7)
    plist = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1, 12)]
    new = 12
    engine = NativeEngine(native.args, SamplingParams(max_new_tokens=new, temperature=0.0), eos_ids=[],
                          seed=0, dtype=torch.float32, device="cpu", max_batch_size=4)
    engine.update_weights([[(n, (), p) for n, p in native.named_parameters()]], version=0)
    out = engine.generate([GenerationRequest(p, 0, i, 0) for i, p in enumerate(plist)])
    with torch.no_grad():
        for p, c in zip(plist, out):
            ids = torch.tensor([p])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert c.tokens == want, (arch, len(p))
            assert c.finish_reason == "length"


def _requests(n_prompts: int, samples: int) -> list[GenerationRequest]:
    return [GenerationRequest(p, 2, i, s) for i, p in enumerate(prompts(n_prompts, seed=11)) for s in range(samples)]


def _same(a, b):
    assert [c.request for c in a] == [c.request for c in b]
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.finish_reason == y.finish_reason
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_does_not_depend_on_its_batch(ref, temperature):
    sampling = SamplingParams(max_new_tokens=10, temperature=temperature)
    reqs = _requests(6, samples=4)
    full = make_engine(ref, sampling, seed=5).generate(reqs)
    # alone: one request per poll
    alone_engine = make_engine(ref, sampling, seed=5)
    _same([alone_engine.generate([r])[0] for r in reqs], full)
    # refilled slots: 3 slots for 24 requests, so most requests start in a slot another just left
    refilled = make_engine(ref, sampling, seed=5, max_batch_size=3)
    _same(refilled.generate(reqs), full)
    assert refilled.peak_active == 3
    # each sample prefilled on its own rather than once per prompt
    _same(make_engine(ref, sampling, seed=5, share_prefix=False).generate(reqs), full)
    # checked every step rather than every 8
    _same(make_engine(ref, sampling, seed=5, sync_every=1).generate(reqs), full)
    # the next steps queued before each check is read (as on a GPU)
    _same(make_engine(ref, sampling, seed=5, overlap_checks=True).generate(reqs), full)


def test_shared_prefill_runs_each_prompt_once(ref):
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
    reqs = _requests(3, samples=5)
    for share, expected in ((True, sum(len(p) for p in prompts(3, seed=11))), (False, sum(len(r.prompt_tokens) for r in reqs))):
        engine = make_engine(ref, sampling, seed=1, share_prefix=share)
        seen = []
        decode = engine.model.decode

        def counting(tokens, positions, attend, logits_index=None):
            if logits_index is not None:  # a prefill
                seen.append(tokens.numel())
            return decode(tokens, positions, attend, logits_index)

        engine.model.decode = counting
        engine.generate(reqs)
        assert sum(seen) == expected


def test_a_prefill_call_counts_each_shared_prompt_once(ref):
    """prefill_tokens bounds the tokens a prefill call computes: with shared prompts, the samples
    of the first two prompts fit one call of their two prompts' tokens, the third prompt another."""
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
    first, second, _ = (len(p) for p in prompts(3, seed=11))
    engine = make_engine(ref, sampling, seed=1, prefill_tokens=first + second)
    calls = []
    decode = engine.model.decode

    def counting(tokens, positions, attend, logits_index=None):
        if logits_index is not None:
            calls.append(tokens.numel())
        return decode(tokens, positions, attend, logits_index)

    engine.model.decode = counting
    engine.generate(_requests(3, samples=5))
    assert calls == [first + second, sum(len(p) for p in prompts(3, seed=11)) - first - second]


def test_kv_budget_is_never_exceeded(ref):
    max_len = 24
    per_slot = slot_bytes(ARGS, max_len, torch.float32)
    budget_gb = 4.5 * per_slot / 1e9  # room for 3 slots and the scratch slot
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    engine = make_engine(ref, sampling, seed=2, max_seq_len=max_len, kv_cache_gb=budget_gb)
    assert engine.cache.num_slots == 3
    assert engine.cache.nbytes <= budget_gb * 1e9
    reqs = _requests(5, samples=2)
    _same(engine.generate(reqs), make_engine(ref, sampling, seed=2).generate(reqs))
    assert engine.peak_active == 3


def test_a_budget_without_room_for_one_sequence_is_refused(ref):
    with pytest.raises(ValueError, match=r"holds no sequence of 64 tokens.*raise generation.kv_cache_gb"):
        make_engine(ref, SamplingParams(max_new_tokens=8), max_seq_len=64, kv_cache_gb=1e-9)


def test_a_request_longer_than_the_slot_is_refused(ref):
    engine = make_engine(ref, SamplingParams(max_new_tokens=8), max_seq_len=12)
    with pytest.raises(ValueError, match=r"prompt of 6 tokens \+ 8 new tokens exceeds the KV slot of 12 tokens"):
        engine.generate([GenerationRequest([1] * 6, 0, 0, 0)])


def test_per_request_budgets_end_each_completion_at_its_own(ref):
    sampling = SamplingParams(max_new_tokens=9, temperature=1.0)
    reqs = [GenerationRequest(p, 0, i, 0, max_new_tokens=1 + i % 9) for i, p in enumerate(prompts(12, seed=3))]
    out = make_engine(ref, sampling, seed=4, eos_ids=()).generate(reqs)
    unstopped = [GenerationRequest(r.prompt_tokens, 0, r.prompt_index, 0) for r in reqs]
    full = make_engine(ref, sampling, seed=4, eos_ids=()).generate(unstopped)
    for c, f, r in zip(out, full, reqs):
        assert len(c.tokens) == r.max_new_tokens and c.finish_reason == "length"
        assert c.tokens == f.tokens[: r.max_new_tokens]


def test_the_host_looks_when_budgets_say_so(ref):
    """Budgets are known on the host: decoding stops at the step the last budget ends (not at the
    next multiple of sync_every), and a waiting request's slot is refilled as soon as budgets free
    a whole admission round."""
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    engine = make_engine(ref, sampling, seed=5, eos_ids=(), max_batch_size=2, sync_every=8)
    runs: list[tuple[int, int]] = []
    run = engine._decode_steps

    def counting(slots, sp, steps):
        runs.append((len(slots), steps))
        run(slots, sp, steps)

    engine._decode_steps = counting
    # Longest first: 11 and 6 start together (2 slots); the two 3s wait for a slot each.
    budgets = [3, 11, 6, 3]
    reqs = [GenerationRequest(p, 0, i, 0, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts(4, seed=6), budgets))]
    out = engine.generate(reqs)
    assert [len(c.tokens) for c in out] == budgets
    # 6 ends after 5 decode steps (its first token is the prefill's) and a 3 takes its slot; that 3
    # ends 2 steps later and the other 3 takes it; then nothing waits, and 11 has 3 steps left.
    assert runs == [(2, 5), (2, 2), (2, 3)]


def test_with_nothing_waiting_the_next_interval_is_queued_before_the_check(ref, monkeypatch):
    """Once every request is admitted, the host queues the next interval of decode steps before it
    reads the last one's check (on a GPU the device decodes while the host collects); while requests
    wait, it reads each check before it admits and decodes again. The completions are those of a
    host that checks after every step."""
    from grpo.engine import native

    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    assert not make_engine(ref, sampling).overlap_checks  # on the CPU, by default, nothing to overlap
    engine = make_engine(ref, sampling, seed=5, eos_ids=(), max_batch_size=2, sync_every=4, overlap_checks=True)
    events: list[str] = []
    run, check = engine._decode_steps, native.finished_completions

    def decoding(slots, sp, steps):
        events.append(f"decode {len(slots)}x{steps}")
        run(slots, sp, steps)

    def checking(*args, **kwargs):
        events.append("check")
        return check(*args, **kwargs)

    engine._decode_steps = decoding
    monkeypatch.setattr(native, "finished_completions", checking)
    budgets = [11, 6, 3]
    reqs = [GenerationRequest(p, 0, i, 0, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts(3, seed=6), budgets))]
    out = engine.generate(reqs)
    # 11 and 6 start together while 3 waits: 4 steps, check, 1 step (6 ends), check. Then 3 takes
    # 6's slot and nothing waits: 4 steps (11 has 5 left), the last step queued, the check (3
    # ended), the check after the queued step (11 ended).
    assert events == ["decode 2x4", "check", "decode 2x1", "check", "decode 2x4", "decode 2x1", "check", "check"]
    every_step = make_engine(ref, sampling, seed=5, eos_ids=(), max_batch_size=2, sync_every=1).generate(reqs)
    _same(out, every_step)


@pytest.mark.parametrize("overlap_checks", [False, True], ids=["checks-read-at-once", "next-steps-queued-first"])
def test_on_finished_hears_of_each_completion_once_as_its_check_finds_it(ref, overlap_checks):
    """Engine.generate's on_finished: every completion exactly once, before generate returns, at the
    check that finds it finished (budgets of 3, 6 and 11, all started together, end at different checks), in that
    check's order; the completions are those of a call without it."""
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    budgets = [11, 3, 6, 3, 11, 6]
    reqs = [GenerationRequest(p, 0, i, 0, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts(6, seed=6), budgets))]
    heard: list[list[int]] = []
    engine = make_engine(ref, sampling, seed=5, eos_ids=(), max_batch_size=6, sync_every=4, overlap_checks=overlap_checks)
    out = engine.generate(reqs, on_finished=lambda done: heard.append([c.request.prompt_index for c in done]))
    assert sorted(i for check in heard for i in check) == list(range(len(reqs)))
    assert len(heard) >= 3
    lengths = [max(budgets[i] for i in check) for check in heard]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    _same(out, make_engine(ref, sampling, seed=5, eos_ids=(), max_batch_size=6, sync_every=4).generate(reqs))


@pytest.mark.parametrize("max_seq_len", [None, 40], ids=["auto-sized", "fixed"])
def test_released_cache_comes_back_with_the_same_slots_and_completions(ref, max_seq_len):
    """release_cache frees the K/V buffers (a colocated trainer gets the memory); the next generation
    re-establishes the same number of slots, and completions equal those of an engine never released."""
    sp = SamplingParams(max_new_tokens=6, temperature=1.0)
    kept = make_engine(ref, sp, max_batch_size=3, max_seq_len=max_seq_len)
    released = make_engine(ref, sp, max_batch_size=3, max_seq_len=max_seq_len)
    _same(released.generate(_requests(4, 2)), kept.generate(_requests(4, 2)))
    cache = released.cache
    released.release_cache()
    assert cache.kv_released and cache.k == [] and cache.v == []
    again = released.generate(_requests(5, 2))
    assert released.cache is cache and not cache.kv_released and len(cache.k) == ARGS.n_layers
    _same(again, kept.generate(_requests(5, 2)))


def test_rows_of_a_group_read_their_prompt_from_one_slot(ref, monkeypatch):
    """With the other members' copies of a shared prompt's K/V made NaN right after the prefill,
    every completion is what it was: decode read the prompt from the group's reader slot only."""
    from grpo.engine.shares import PrefixShares

    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    reqs = _requests(3, samples=4)
    want = make_engine(ref, sampling, seed=3, eos_ids=()).generate(reqs)
    prefilled, poisoned = PrefixShares.prefilled, []

    def poison_followers(shares, slots, prompt_list, shared):
        prefilled(shares, slots, prompt_list, shared)
        c = shares.cache
        for slot in slots:
            reader, length = int(c.share_slot[slot]), int(c.share_len[slot])
            if reader != slot:
                poisoned.append(slot)
                for k, v in zip(c.k, c.v):
                    k[slot, :length] = float("nan")
                    v[slot, :length] = float("nan")

    monkeypatch.setattr(PrefixShares, "prefilled", poison_followers)
    # Equal budgets and no EOS: every sequence ends at once, so no reader leaves its group early.
    _same(make_engine(ref, sampling, seed=3, eos_ids=()).generate(reqs), want)
    assert len(poisoned) == 3 * 3


def test_a_group_moves_to_a_live_slot_when_its_reader_leaves():
    """PrefixShares against hand-worked slot tables: equal prompts prefilled together read the
    lowest slot of their group; when it leaves, the rest read the next one; others read their own."""
    from grpo.engine.cache import SlotCache
    from grpo.engine.shares import PrefixShares

    cache = SlotCache(ARGS, num_slots=8, max_len=16, dtype=torch.float32, device=torch.device("cpu"))
    shares = PrefixShares(cache)
    a, b = [1, 2, 3], [4, 5]
    shares.prefilled([5, 2, 7, 3], [a, a, b, a], shared=True)
    shares.appended([6])
    assert cache.share_slot.tolist() == [0, 1, 2, 2, 4, 2, 6, 7, 8]
    assert cache.share_len.tolist() == [0, 0, 3, 3, 0, 3, 0, 0, 0]
    shares.leave([2, 7])
    assert cache.share_slot[[3, 5, 6]].tolist() == [3, 3, 6]
    assert cache.share_len[[3, 5]].tolist() == [3, 3]
    shares.leave([3])
    assert int(cache.share_slot[5]) == 5
    shares.prefilled([0, 1], [a, a], shared=False)
    assert cache.share_slot[[0, 1]].tolist() == [0, 1] and cache.share_len[[0, 1]].tolist() == [0, 0]
    shares.reset()
    assert cache.share_slot.tolist() == list(range(9)) and not cache.share_len.any()
