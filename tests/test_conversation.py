"""Multi-turn rollout on the CPU: the episode's tokens are exactly the sampled tokens plus the
environment's, the loss mask marks the sampled ones, the generator's log-probs are the model's
(a full forward over the whole conversation recomputes them), and environment failures are one line."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from grpo.data.digits import CharTokenizer, DigitTask
from grpo.engine import NativeEngine, SamplingParams
from grpo.envs.base import EnvReply
from grpo.envs.calls import EnvCalls
from grpo.envs.relay import DigitRelay
from grpo.rollout.conversation import EnvironmentFailure, generate_conversations
from model import ModelArgs, Transformer
from tests.dist_utils import one_thread

TOKENIZER = CharTokenizer()
ARGS = ModelArgs(vocab_size=TOKENIZER.vocab_size, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS, dtype=torch.float32)
    model.init_weights(std=0.1)
    return model.eval().requires_grad_(False)


class Recording:
    """An engine and an environment that keep what they returned, in order."""

    def __init__(self, engine, env):
        self.engine, self.env, self.completions, self.replies = engine, env, [], []
        self.name, self.max_turns = env.name, env.max_turns

    def generate(self, requests, sampling=None):
        out = self.engine.generate(requests, sampling)
        self.completions.append({(c.request.prompt_index, c.request.sample_index): c for c in out})
        return out

    def reset(self, prompt):
        return self.env.reset(prompt)

    def step(self, state, turn, completion, completion_tokens):
        reply = self.env.step(state, turn, completion, completion_tokens)
        self.replies.append(reply)
        return reply


def _rollout(model, env, max_new=6, max_tokens=32, group_size=3, **options):
    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    engine = NativeEngine(ARGS, sampling, eos_ids=TOKENIZER.eos_ids, seed=0, dtype=torch.float32, device="cpu")
    engine.update_weights([[(n, (), p) for n, p in model.named_parameters()]], version=3)
    prompts = DigitTask("copy_digits", TOKENIZER, 2, 4, seed=0, num_eval=0).train_prompts(1, 4)
    recording = Recording(engine, env)
    with one_thread():
        batch, stats = generate_conversations(recording, recording, prompts, group_size, 1, TOKENIZER,
                                      TOKENIZER.pad_id, sampling, max_tokens, **options)
    return prompts, recording, batch, batch.env_rewards.tolist(), stats


def test_episode_tokens_are_the_sampled_tokens_plus_the_environments_bitwise(model):
    prompts, rec, batch, env_rewards, stats = _rollout(model, DigitRelay(seed=0))
    assert len(batch) == 12 and stats.turns == [2] * 12
    for i in range(len(batch)):
        prompt = prompts[i // 3]
        key = (prompt.index, i % 3)
        first, second = rec.completions[0][key], rec.completions[1][key]
        heard = TOKENIZER.encode(DigitRelay(seed=0).reset(prompt).secret + "=")
        want = prompt.token_ids + first.tokens + heard + second.tokens
        n = len(want)
        assert batch.tokens[i, :n].tolist() == want
        assert batch.loss_mask[i].tolist() == ([False] * len(prompt.token_ids) + [True] * len(first.tokens)
                                               + [False] * len(heard) + [True] * len(second.tokens)
                                               + [False] * (batch.tokens.shape[1] - n))
        sampled = batch.gen_logprobs[i][batch.loss_mask[i]]
        assert torch.equal(sampled, torch.tensor(first.logprobs + second.logprobs))
        # the reward is the environment's: the mean of each turn's positional agreement with its
        # reference (the prompt's digits, then what the environment said)
        match = lambda got, ref: sum(a == b for a, b in zip(got, ref)) / max(len(got), len(ref))  # noqa: E731
        secret = TOKENIZER.decode(heard)[:-1]
        assert len(secret) == len(prompt.answer)
        want_reward = (match(TOKENIZER.decode(first.tokens), prompt.answer) + match(TOKENIZER.decode(second.tokens), secret)) / 2
        assert env_rewards[i] == torch.tensor(want_reward, dtype=torch.float32).item()
    assert batch.version.tolist() == [3] * 12
    # An episode is truncated where its final answer was cut at the turn budget (max_new).
    cut = [rec.completions[1][(prompts[i // 3].index, i % 3)].finish_reason == "length" for i in range(12)]
    assert batch.truncated.tolist() == cut and stats.truncated_by_tokens == sum(cut)


def test_generator_logprobs_of_later_turns_are_the_models_over_the_whole_conversation(model):
    _, _, batch, _, _ = _rollout(model, DigitRelay(seed=1))
    for i in range(len(batch)):
        n = int(batch.seq_lens[i])
        with torch.no_grad():
            logits = model(batch.tokens[i : i + 1, : n - 1])[0].float()
        recomputed = torch.log_softmax(logits, -1).gather(1, batch.tokens[i, 1:n, None])[:, 0]
        mask = batch.loss_mask[i, 1:n]
        torch.testing.assert_close(recomputed[mask], batch.gen_logprobs[i, 1:n][mask], atol=2e-5, rtol=0)


class Talkative:
    """Never ends an episode: says five digits after every turn."""

    name, max_turns = "talkative", 3

    def reset(self, prompt):
        return None

    def step(self, state, turn, completion, completion_tokens):
        return EnvReply(tokens=TOKENIZER.encode("12345"))


def test_turn_and_token_budgets_end_episodes_marked_truncated(model):
    _, _, batch, env_rewards, stats = _rollout(model, Talkative(), max_new=4, max_tokens=64)
    assert stats.turns == [3] * 12 and stats.truncated_by_turns == 12
    assert batch.truncated.all() and batch.turn_limited.all() and batch.env_rewards.isnan().all()
    # 3 model turns, the environment's 5 tokens after the first two only
    assert (batch.completion_lens - batch.sampled_lens).tolist() == [10] * 12
    _, _, batch, _, stats = _rollout(model, Talkative(), max_new=4, max_tokens=12)
    assert stats.truncated_by_tokens == 12 and (batch.completion_lens <= 12).all() and not batch.turn_limited.any()
    # a first turn that runs into the token budget: the episode still carries its policy version
    _, _, batch, _, stats = _rollout(model, Talkative(), max_new=4, max_tokens=3)
    assert stats.truncated_by_tokens == 12 and stats.turns == [1] * 12
    assert (batch.completion_lens <= 3).all() and batch.version.tolist() == [3] * 12


class Broken:
    name, max_turns = "broken", 2

    def reset(self, prompt):
        return None

    def step(self, state, turn, completion, completion_tokens):
        raise KeyError("score")


class Wrong(Broken):
    name = "wrong"

    def step(self, state, turn, completion, completion_tokens):
        return "12="


def test_an_environment_that_raises_or_answers_wrongly_is_one_line(model):
    with pytest.raises(EnvironmentFailure, match=r"environment 'broken' on episode \(prompt \d+, sample 0\), turn 0 "
                                                r"raised KeyError\('score'\)"):
        _rollout(model, Broken())
    with pytest.raises(EnvironmentFailure, match="environment 'wrong' .* returned str, not an EnvReply"):
        _rollout(model, Wrong())


class Sleepy(Broken):
    """Hangs on the first turn of odd prompts; answers like digit_relay otherwise."""

    name = "sleepy"

    def reset(self, prompt):
        return DigitRelay(seed=0).reset(prompt), prompt.index

    def step(self, state, turn, completion, completion_tokens):
        relay_state, index = state
        if index % 2:
            time.sleep(30)
        return DigitRelay(seed=0).step(relay_state, turn, completion, completion_tokens)


def test_a_hung_environment_call_fails_its_episode_in_one_line_not_the_run(model, capsys):
    """env.timeout_s bounds each call: "stop" names the call; "zero" ends those episodes (no reward,
    env_failed), finishes the others, and warns once."""
    with pytest.raises(EnvironmentFailure, match=r"environment 'sleepy' on episode \(prompt \d*[13579], sample \d\), "
                                                r"turn 0 did not return within env.timeout_s = 0.5 s"):
        _rollout(model, Sleepy(), calls=EnvCalls(timeout_s=0.5, workers=4))
    start = time.monotonic()
    prompts, _, batch, env_rewards, stats = _rollout(model, Sleepy(), calls=EnvCalls(timeout_s=0.5, workers=4),
                                                     on_error="zero")
    assert time.monotonic() - start < 10
    odd = torch.tensor([p.index % 2 == 1 for p in prompts]).repeat_interleave(3)
    assert odd.any() and not odd.all()
    assert batch.env_failed.tolist() == odd.tolist()
    assert batch.env_rewards[odd].isnan().all() and not batch.env_rewards[~odd].isnan().any()
    assert (batch.model_turns == torch.where(odd, 1, 2)).all()
    assert len(stats.failures) == int(odd.sum())
    assert capsys.readouterr().err.count("warning: ") == 1


class AsyncRelay(DigitRelay):
    async def step(self, state, turn, completion, completion_tokens):
        await asyncio.sleep(0.01)
        return DigitRelay.step(self, state, turn, completion, completion_tokens)


def test_an_async_environment_is_awaited(model):
    *_, sync_batch, _, _ = _rollout(model, DigitRelay(seed=0))
    *_, async_batch, _, _ = _rollout(model, AsyncRelay(seed=0))
    assert torch.equal(sync_batch.tokens, async_batch.tokens)
    assert torch.equal(sync_batch.env_rewards, async_batch.env_rewards)
    assert (async_batch.env_seconds >= 0.01).all()
