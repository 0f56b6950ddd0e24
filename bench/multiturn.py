"""The cost of turns: a multi-turn workload generated with each conversation's K/V kept in its
engine slot between turns (`env.keep_kv = true`, the default) against re-prefilling the whole
history every turn (`env.keep_kv = false`), in the same run, one JSON line per configuration.

    python3 bench/multiturn.py [--shape 0.6b] [--conversations 256] [--group 4] [--prompt 256]
                               [--turns 4] [--new 128] [--reply 64] [--reps 2] [--quick]

Random bf16 weights of a Qwen3 shape (bench/generate.py's); `conversations / group` prompts of
`prompt` random tokens, each sampled `group` times; `turns` model turns of `new` tokens each (no
EOS), with `reply` environment tokens appended after every model turn but the last. The rollout is
the run's own (`generate_conversations`) with the native engine; tokens/s counts sampled tokens
over the whole rollout (prefill included). Prefilled tokens are counted from the workload: kept
K/V prefill the prompts once and then only what each turn appends (1 + reply tokens); re-prefill
computes every history again, each turn.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generate import model_args, sync  # noqa: E402
from bench.provenance import commit  # noqa: E402
from grpo.data.prompt import Prompt  # noqa: E402
from grpo.engine import NativeEngine, SamplingParams  # noqa: E402
from grpo.envs.base import EnvReply  # noqa: E402
from grpo.rollout.conversation import generate_conversations  # noqa: E402

VOCAB = 151936


class Silent:
    """The rollout decodes each model turn for its environment; this workload's reads no text."""

    pad_id = 0

    def decode(self, ids: list[int]) -> str:
        return ""


class Replies:
    """Appends `reply` fixed random tokens after each model turn, for `turns` model turns."""

    name = "replies"

    def __init__(self, turns: int, reply: int, vocab: int):
        self.max_turns, self.reply = turns, reply
        self.tokens = torch.randint(0, vocab, (turns, reply), generator=torch.Generator().manual_seed(1)).tolist()

    def reset(self, prompt: Prompt) -> None:
        return None

    def step(self, state, turn: int, completion: str, completion_tokens: list[int]) -> EnvReply:
        if turn == self.max_turns - 1:
            return EnvReply(done=True, reward=0.0)
        return EnvReply(tokens=self.tokens[turn])


def prefilled_tokens(opts, keep_kv: bool) -> int:
    """Tokens the engine prefills in one rollout (prompts counted once per conversation)."""
    if keep_kv:
        return opts.conversations * (opts.prompt + (opts.turns - 1) * (1 + opts.reply))
    histories = [opts.prompt + t * (opts.new + opts.reply) for t in range(opts.turns)]
    return opts.conversations * sum(histories)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--reply", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny shape, small vocab, few conversations: a CPU smoke test")
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = 512 if opts.quick else VOCAB
    if opts.quick:
        opts.shape, opts.conversations, opts.prompt, opts.new, opts.reply = "tiny", 8, 16, 8, 4
    args = model_args(opts.shape, vocab)
    after_prompt = opts.turns * opts.new + (opts.turns - 1) * opts.reply
    sampling = SamplingParams(max_new_tokens=opts.new, temperature=1.0)
    engine = NativeEngine(args, sampling, eos_ids=[], seed=0, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                          device=device, max_batch_size=opts.conversations, max_seq_len=opts.prompt + after_prompt)
    torch.manual_seed(0)
    engine.model.init_weights()
    engine.version = 0
    ids = torch.randint(0, vocab, (opts.conversations // opts.group, opts.prompt), generator=torch.Generator().manual_seed(0))
    batch_prompts = [Prompt(index=i, text="", token_ids=row, answer="") for i, row in enumerate(ids.tolist())]
    env = Replies(opts.turns, opts.reply, vocab)

    def rollout(keep_kv: bool):
        return generate_conversations(engine, env, batch_prompts, opts.group, 0, Silent(), 0, sampling, after_prompt,
                                      keep_kv=keep_kv)

    base = dict(bench="multiturn", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__, commit=commit(), shape=opts.shape, conversations=opts.conversations,
                group=opts.group, prompt=opts.prompt, turns=opts.turns, new_tokens=opts.new, reply=opts.reply)
    results = {}
    for keep_kv in (True, False):
        batch, stats = rollout(keep_kv)  # warm-up: compile, graph capture
        best = math.inf
        for _ in range(opts.reps):
            sync(device)
            start = time.perf_counter()
            batch, stats = rollout(keep_kv)
            sync(device)
            best = min(best, time.perf_counter() - start)
        sampled = int(batch.loss_mask.sum())
        assert stats.turns == [opts.turns] * opts.conversations and sampled == opts.conversations * opts.turns * opts.new
        results[keep_kv] = sampled / best
        print(json.dumps(dict(base, keep_kv=keep_kv, seconds=round(best, 3), sampled_tokens=sampled,
                              prefilled_tokens=prefilled_tokens(opts, keep_kv), tok_s=round(sampled / best))), flush=True)
    print(json.dumps(dict(base, kept_over_re_prefill=round(results[True] / results[False], 3))), flush=True)


if __name__ == "__main__":
    main()
