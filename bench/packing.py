"""The host's packing work for one training minibatch, plain layout against shared prompts, in one
run: what the trainer does on the CPU before and between its micro-batches, one JSON line each.

    python3 bench/packing.py                       # the realistic step's shape (bench/rl_step.py)
    python3 bench/packing.py --prompts 128 --group 16 --reps 9
    python3 bench/packing.py --threads 0           # with torch's default intra-op threads (one per core)

A hand-made batch shaped like bench/rl_step.py's: --prompts prompts of 80-130 tokens, --group
completions of 60-256 tokens each, the episodes of a prompt starting with the same prompt tokens.
Three phases, each the median of --reps: `plan_ms` splits the episodes into micro-batches of at
most --budget tokens (`micro_batch_episodes`), `pack_ms` packs each one (`pack_episodes` on its
episodes), `layout_ms` lays out each packed row's sequences for attention (`sequence_layout`, the
per-layer call reads its result). `host_ms` is their sum and `vs_plain` that sum over the plain
layout's in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.rollout.episode import EpisodeBatch  # noqa: E402
from grpo.train.packing import micro_batch_episodes, pack_episodes  # noqa: E402
from model.attention import sequence_layout  # noqa: E402


def realistic_batch(prompts: int, group: int, vocab: int = 600, seed: int = 0) -> EpisodeBatch:
    """prompts x group episodes: prompts of 80-130 tokens shared by their group, completions of 60-256."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(80, 131, (prompts,), generator=g).repeat_interleave(group)
    completion_lens = torch.randint(60, 257, (prompts * group,), generator=g)
    width = int((prompt_lens + completion_lens).max())
    tokens = torch.randint(1, vocab, (prompts * group, width), generator=g)
    for p in range(prompts):
        rows = slice(p * group, (p + 1) * group)
        tokens[rows, : int(prompt_lens[p * group])] = tokens[p * group, : int(prompt_lens[p * group])]
    n = prompts * group
    return EpisodeBatch(
        tokens=tokens, prompt_lens=prompt_lens, completion_lens=completion_lens,
        gen_logprobs=-torch.rand(n, width, generator=g), truncated=torch.zeros(n, dtype=torch.bool),
        version=torch.zeros(n, dtype=torch.long), prompt_index=torch.arange(prompts).repeat_interleave(group),
        sample_index=torch.arange(group).repeat(prompts), rewards=torch.zeros(n), advantages=torch.randn(n, generator=g),
    )


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def one_pass(batch: EpisodeBatch, budget: int, share: bool) -> dict[str, float]:
    """The three phases once, in ms, and the packed token count."""
    episodes = torch.arange(len(batch))
    plan_ms, chunks = timed(lambda: micro_batch_episodes(batch, episodes, budget, share))
    pack_ms, rows = timed(lambda: [pack_episodes(batch.select(c), share_prompts=share) for c in chunks])
    layout_ms, _ = timed(lambda: [sequence_layout(r.doc_ids, tuple(r.tokens.shape), torch.device("cpu"), r.group_ids)
                                  for r in rows])
    return dict(plan_ms=plan_ms, pack_ms=pack_ms, layout_ms=layout_ms, micro_batches=len(rows),
                tokens=sum(r.tokens.shape[1] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--budget", type=int, default=16384, help="training.micro_batch_tokens")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op CPU threads (0: torch's default)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    batch = realistic_batch(opts.prompts, opts.group)
    plain_ms = None
    for share in (False, True):
        one_pass(batch, opts.budget, share)
        passes = [one_pass(batch, opts.budget, share) for _ in range(opts.reps)]
        line = {key: round(statistics.median(p[key] for p in passes), 2) for key in ("plan_ms", "pack_ms", "layout_ms")}
        host_ms = sum(line.values())
        plain_ms = plain_ms or host_ms
        print(json.dumps(dict(bench="packing", layout="shared_prompts" if share else "plain",
                              threads=torch.get_num_threads(), episodes=len(batch),
                              tokens=passes[0]["tokens"], micro_batches=passes[0]["micro_batches"], **line,
                              host_ms=round(host_ms, 2), vs_plain=round(host_ms / plain_ms, 2))), flush=True)


if __name__ == "__main__":
    main()
