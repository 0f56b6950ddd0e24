"""A conversation's K/V kept in its engine slot between turns (grpo/engine/kept.py): the next turn
prefills only the tokens appended since, and everything it produces is what re-prefilling the whole
history produces. In `job.bitwise_logprobs` mode (the CPU reference) that is exact, bit for bit,
and equal to the trainer's recomputation of the whole conversation."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.engine import GenerationRequest, NativeEngine, SamplingParams
from grpo.engine import native as native_module
from grpo.envs.base import EnvReply
from grpo.rollout.conversation import generate_conversations
from grpo.train.trainer import Trainer
from model import ModelArgs, Transformer, batch_invariant
from model.batch_invariant import BLOCK
from tests.dist_utils import one_thread, single_process_group

V = 48
ARGS = ModelArgs(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
EOS = V - 1
GROUP = 2
TURNS = 3
SAMPLING = SamplingParams(max_new_tokens=10, temperature=1.0)


@pytest.fixture(autouse=True)
def _one_thread_and_mode_reset():
    with one_thread():
        yield
    batch_invariant.enable(False)


class Tokens:
    """The rollout decodes each model turn for the environment; these environments read tokens only."""

    pad_id = 0

    def decode(self, ids: list[int]) -> str:
        return ""

    def encode(self, text: str) -> list[int]:
        return []


class Appends:
    """Answers each model turn with a few tokens that depend on the prompt, the turn and the model's
    last token (so a wrong history shows), until TURNS model turns are done."""

    name, max_turns = "appends", TURNS

    def reset(self, prompt):
        return prompt.index

    def step(self, state, turn, completion, completion_tokens):
        if turn == TURNS - 1:
            return EnvReply(done=True, reward=0.0)
        length = 3 + (state + turn) % 5
        return EnvReply(tokens=[(completion_tokens[-1] + 7 * turn + j) % EOS for j in range(length)])


def policy() -> Transformer:
    torch.manual_seed(3)
    model = Transformer(ARGS, dtype=torch.float32)
    model.init_weights(std=0.1)
    return model


def prompts(n: int):
    from grpo.data.prompt import Prompt

    g = torch.Generator().manual_seed(11)
    lengths = [1, BLOCK + 7, 5, BLOCK - 2, 9][:n]  # one that crosses a key block, one that ends near one
    return [Prompt(index=i, text="", token_ids=torch.randint(0, EOS, (n_,), generator=g).tolist(), answer="")
            for i, n_ in enumerate(lengths)]


def engine_for(model: Transformer, max_batch_size: int = 64, overlap_checks: bool = False) -> NativeEngine:
    engine = NativeEngine(ARGS, SAMPLING, eos_ids=[EOS], seed=1, dtype=torch.float32, device="cpu",
                          max_batch_size=max_batch_size, max_seq_len=160, overlap_checks=overlap_checks)
    engine.update_weights([[(n, (), p.detach()) for n, p in model.named_parameters()]], version=0)
    return engine


@pytest.fixture
def prefilled(monkeypatch):
    """Tokens the engine prefilled, whole prompts and appended tokens apart."""
    counts = {"whole": 0, "appended": 0}
    whole, appended = native_module.prefill_prompts, native_module.prefill_appended

    def count_whole(model, cache, requests, slots, share_prefix):
        counts["whole"] += sum(len(r.prompt_tokens) for r in requests)
        return whole(model, cache, requests, slots, share_prefix)

    def count_appended(model, cache, requests, slots, cached):
        counts["appended"] += sum(len(r.prompt_tokens) - n for r, n in zip(requests, cached))
        return appended(model, cache, requests, slots, cached)

    monkeypatch.setattr(native_module, "prefill_prompts", count_whole)
    monkeypatch.setattr(native_module, "prefill_appended", count_appended)
    return counts


def rollout(engine: NativeEngine, keep_kv: bool, n_prompts: int = 5):
    batch, stats = generate_conversations(engine, Appends(), prompts(n_prompts), GROUP, 1, Tokens(), 0, SAMPLING,
                                          max_tokens=100, keep_kv=keep_kv)
    return batch, stats


@pytest.mark.parametrize("overlap_checks", [False, True], ids=["checks-read-at-once", "next-steps-queued-first"])
@pytest.mark.parametrize("max_batch_size", [64, 4, 1])
def test_kept_kv_gives_the_conversations_of_re_prefilling_bitwise(max_batch_size, overlap_checks, prefilled):
    """Fewer slots than conversations (4, 1) make turns take kept slots from finished ones. With the
    next steps queued before each check is read, finished rows go on through an interval (writing
    their last token's K/V into the slot again) before the next turn takes the slot back."""
    batch_invariant.enable(True)
    model = policy()
    kept, stats = rollout(engine_for(model, max_batch_size, overlap_checks), keep_kv=True)
    kept_counts = dict(prefilled)
    prefilled.update(whole=0, appended=0)
    again, _ = rollout(engine_for(model, max_batch_size), keep_kv=False)
    assert stats.turns == [TURNS] * 10
    assert torch.equal(kept.tokens, again.tokens) and torch.equal(kept.loss_mask, again.loss_mask)
    assert torch.equal(kept.gen_logprobs, again.gen_logprobs)  # bitwise: same numbers, not close ones
    lengths = kept.prompt_lens + kept.completion_lens
    first_prompts = int(kept.prompt_lens.sum())
    assert prefilled == {"whole": prefilled["whole"], "appended": 0}
    if max_batch_size == 64:
        # Turn 0 prefills the prompts; decode steps compute each sampled token but a turn's last;
        # later turns prefill only what follows the slot's kept K/V. So every token of a
        # conversation is computed once, except its very last.
        assert kept_counts["whole"] == first_prompts
        decoded = int(kept.loss_mask.sum()) - TURNS * 10
        assert kept_counts["whole"] + decoded + kept_counts["appended"] == int(lengths.sum()) - 10
        assert prefilled["whole"] > 2 * kept_counts["whole"] + kept_counts["appended"]
    else:
        assert kept_counts["whole"] + kept_counts["appended"] < prefilled["whole"]


def test_kept_kv_log_probs_equal_the_trainers_recomputation_bitwise():
    batch_invariant.enable(True)
    model = policy()
    batch, _ = rollout(engine_for(model), keep_kv=True)
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))
    with single_process_group():
        trainer = Trainer(model, init_device_mesh("cpu", (1,)), torch.device("cpu"), torch.float32,
                          GRPOConfig(group_size=GROUP), OptimizerConfig(lr=1e-3, warmup_steps=0), total_steps=4,
                          micro_batch_tokens=256, temperature=1.0, max_new_tokens=100)
        gap = trainer.train(batch)
    assert gap["logprob_diff/max"] == 0.0 and gap["logprob_diff/exact_frac"] == 1.0


def test_without_the_mode_kept_kv_matches_re_prefilling_closely():
    model = policy()
    kept, _ = rollout(engine_for(model), keep_kv=True)
    again, _ = rollout(engine_for(model), keep_kv=False)
    assert torch.equal(kept.tokens, again.tokens)
    assert torch.allclose(kept.gen_logprobs, again.gen_logprobs, atol=1e-5, rtol=0)


def test_a_weight_update_or_a_changed_history_drops_the_kept_kv(prefilled):
    model = policy()
    engine = engine_for(model)
    prompt = prompts(1)[0].token_ids
    first = engine.generate([GenerationRequest(prompt, 1, 0, 0, keep_kv=True)])[0]
    follow = prompt + first.tokens + [5, 6]
    engine.generate([GenerationRequest(follow, 1, 0, 0, keep_kv=True)])
    assert prefilled["appended"] == 3  # the last sampled token and the two appended ones
    engine.update_weights([[(n, (), p.detach()) for n, p in model.named_parameters()]], version=1)
    prefilled.update(whole=0, appended=0)
    engine.generate([GenerationRequest(follow + [7], 1, 0, 0, keep_kv=True)])
    assert prefilled == {"whole": len(follow) + 1, "appended": 0}
    # A history that differs from what the slot holds (here: its first token) is prefilled whole.
    prefilled.update(whole=0, appended=0)
    engine.generate([GenerationRequest([prompt[0] + 1] + follow[1:] + [7, 8], 1, 0, 0, keep_kv=True)])
    assert prefilled == {"whole": len(follow) + 2, "appended": 0}
