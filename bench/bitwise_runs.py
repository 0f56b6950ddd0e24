"""Whole training runs with and without batch-invariant numerics (`job.bitwise_logprobs`), one
GPU, colocated: the engine-vs-trainer log-prob gap at every step and what the mode costs, side by
side in one process tree. One JSON line per (model, mode), then one cost line per model.

    python3 bench/bitwise_runs.py [--models smollm2,qwen3] [--steps 12] [--skip 2] [-- extra overrides]

- smollm2: configs/smollm2_sums.toml (SmolLM2-135M-Instruct on reasoning-gym sums; build the model
  folder first with scripts/get_smollm2.py): 64 prompts x 8, up to 64 new tokens, lr 1e-5.
- qwen3: bench/rl_step.py's workload (a random-weight Qwen3-0.6B body, GSM8K-format prompts of
  75-95 tokens): 64 prompts x 8, up to 256 new tokens, lr 1e-6.

Each line: `logprob_diff/max` over all steps (weights change every step), the mean of
`logprob_diff/mean`, the smallest `logprob_diff/exact_frac`, and the median decode
(`throughput/generate_tok_s`) and training (`throughput/train_tok_s`) rates over the steps after
the first --skip (compilation). The cost line divides default by bitwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.provenance import commit  # noqa: E402
from bench.rl_step import (  # noqa: E402
    MEASURED_RUN,
    QWEN3_0_6B,
    build_checkpoint,
    build_prompts,
    workload_args,
)

COMMON = ["--parallelism.mode=colocated", *MEASURED_RUN, "--eval.num_prompts=16"]


def workload(name: str, opts) -> list[str]:
    """train_grpo.py arguments of one workload (without the mode and the output folder)."""
    if name == "smollm2":
        return ["--config", str(REPO / "configs" / "smollm2_sums.toml"), f"--model.path={opts.smollm2}"]
    ckpt = build_checkpoint(opts.workdir / "qwen3-0.6b-body", QWEN3_0_6B)
    data = build_prompts(opts.workdir / "prompts.jsonl", opts.steps * 64 + 16)
    return workload_args(ckpt, data)


def run(name: str, mode: str, opts, extra: list[str]) -> dict:
    out = opts.workdir / f"{name}-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py",
               *workload(name, opts), *COMMON, f"--training.steps={opts.steps}", f"--job.output_dir={out}",
               f"--job.bitwise_logprobs={'true' if mode == 'bitwise' else 'false'}", *extra]
    # The run's own output goes to stderr so that stdout carries only the JSON lines.
    result = subprocess.run(command, cwd=REPO, stdout=sys.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{name} {mode}: train_grpo.py exited with {result.returncode}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "logprob_diff/max" in r]
    timed = steps[opts.skip :] or steps
    return dict(
        bench="bitwise_runs", model=name, mode=mode, steps=len(steps),
        logprob_diff_max=max(r["logprob_diff/max"] for r in steps),
        logprob_diff_mean=statistics.mean(r["logprob_diff/mean"] for r in steps),
        exact_frac_min=min(r["logprob_diff/exact_frac"] for r in steps),
        completion_len_mean=statistics.mean(r["episode/length_mean"] for r in steps),
        decode_tok_s=round(statistics.median(r["throughput/generate_tok_s"] for r in timed)),
        train_tok_s=round(statistics.median(r["throughput/train_tok_s"] for r in timed)),
        step_s=round(statistics.median(r["time/step_s"] for r in timed), 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,qwen3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the medians (compilation)")
    parser.add_argument("--smollm2", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-bitwise-runs"))
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    opts = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    opts.workdir.mkdir(parents=True, exist_ok=True)
    import torch

    base = dict(commit=commit(), torch=torch.__version__,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    for name in opts.models.split(","):
        rows = {mode: run(name, mode, opts, extra) for mode in ("default", "bitwise")}
        for row in rows.values():
            print(json.dumps(dict(base, **row)), flush=True)
        d, b = rows["default"], rows["bitwise"]
        print(json.dumps(dict(base, bench="bitwise_cost", model=name,
                              decode_slowdown=round(d["decode_tok_s"] / b["decode_tok_s"], 2),
                              train_slowdown=round(d["train_tok_s"] / b["train_tok_s"], 2),
                              step_slowdown=round(b["step_s"] / d["step_s"], 2))), flush=True)


if __name__ == "__main__":
    main()
