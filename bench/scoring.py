"""Scoring one step's episodes on the host, by the size of the reward pool, in one run: what the
realistic step (bench/rl_step.py) spends after generation with `rewards.overlap = false`.

    python3 bench/scoring.py                      # 64 prompts x 8, math_accuracy, 1 / 2 / 4 workers
    python3 bench/scoring.py --workers 1,4,8 --reps 5

bench/packing.py's hand-made batch of 64 prompts x 8 episodes (completions of 60-256 tokens), its
tokens drawn at random from the fixture's 600-token BPE (fixtures/hf.py), as a random-weight model
samples them, and the fixture's GSM8K answers. `decode_ms` is `score_inputs` (the completions' text,
in one `decode_batch` call), `score_ms` the `Scorer.score` call that follows, median of --reps after one
warm-up call; `decode_one_by_one_ms` the same texts by one `decode` call per episode, as before
`Tokenizer.decode_batch` (the same run, the same result asserted); `vs_first` is score_ms over the
first pool size's, in this run. Random text often
holds a "####" whose line math_accuracy then hands to math_verify, so these episodes cost more to
score than a trained model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.packing import realistic_batch  # noqa: E402
from fixtures.hf import FIXTURE, build_tokenizer  # noqa: E402
from grpo.data.prompt import Prompt  # noqa: E402
from grpo.data.tokenizer import HFTokenizer  # noqa: E402
from grpo.scoring.scorer import Scorer, score_inputs  # noqa: E402


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--workers", default="1,2,4", help="rewards.num_workers values, comma-separated")
    parser.add_argument("--function", default="math_accuracy", help="a built-in reward function")
    parser.add_argument("--reps", type=int, default=3)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        build_tokenizer(Path(folder))
        tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(folder))
    batch = realistic_batch(opts.prompts, opts.group, vocab=len(tokenizer))
    rows = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
    prompts = {
        i: Prompt(index=i, text=rows[i % len(rows)]["question"], token_ids=[], answer=rows[i % len(rows)]["answer"],
                  metadata={})
        for i in range(opts.prompts)
    }
    one_by_one = lambda id_lists: [tokenizer.decode(ids) for ids in id_lists]  # noqa: E731
    decode_times, one_by_one_times = [], []
    for _ in range(opts.reps):
        start = time.perf_counter()
        inputs = score_inputs(batch, prompts, tokenizer.decode_batch)
        decode_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert score_inputs(batch, prompts, one_by_one) == inputs
        one_by_one_times.append(time.perf_counter() - start)
    decode_ms = round(statistics.median(decode_times) * 1e3, 1)
    one_by_one_ms = round(statistics.median(one_by_one_times) * 1e3, 1)
    first_ms = None
    for workers in (int(w) for w in opts.workers.split(",")):
        scorer = Scorer([opts.function], [1.0], timeout_s=120.0, num_workers=workers)
        try:
            scored = scorer.score(*inputs)
            times = []
            for _ in range(opts.reps):
                start = time.perf_counter()
                scorer.score(*inputs)
                times.append(time.perf_counter() - start)
        finally:
            scorer.close()
        score_ms = statistics.median(times) * 1e3
        first_ms = first_ms or score_ms
        print(json.dumps(dict(bench="scoring", function=opts.function, episodes=len(batch), num_workers=workers,
                              decode_ms=decode_ms, decode_one_by_one_ms=one_by_one_ms,
                              decode_in_rust=tokenizer.batch_in_rust, score_ms=round(score_ms, 1),
                              vs_first=round(score_ms / first_ms, 2), reward_mean=round(float(scored.total.mean()), 3))),
              flush=True)


if __name__ == "__main__":
    main()
