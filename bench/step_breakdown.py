"""Summarise a run's metrics.jsonl as one JSON line: median step-time breakdown and numerics.

    python bench/step_breakdown.py runs/demo [--skip 5]

Medians skip the first `--skip` steps (start-up, allocator and kernel warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

TIMES = ("time/generate_s", "time/score_s", "time/train_s", "time/weight_sync_s", "time/step_s")


def summarise(run_dir: Path, skip: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step_s" in r]
    if not steps:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no finished steps yet")
    timed = steps[skip:] or steps
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    return {
        "run": str(run_dir),
        "steps": len(steps),
        **{f"median_{key.split('/')[1]}": statistics.median(r[key] for r in timed) for key in TIMES},
        "median_weight_sync_GBps": statistics.median(r["weight_sync/GBps"] for r in timed),
        "logprob_diff_max": max(r["logprob_diff/max"] for r in steps),
        "logprob_diff_mean": statistics.mean(r["logprob_diff/mean"] for r in steps),
        "eval_reward_first": evals[0] if evals else None,
        "eval_reward_last": evals[-1] if evals else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--skip", type=int, default=5)
    opts = parser.parse_args()
    print(json.dumps(summarise(opts.run_dir, opts.skip)))


if __name__ == "__main__":
    main()
