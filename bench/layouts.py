"""Rank layouts and schedules of one workload side by side, one `torchrun` launch each: which
split of the GPUs into generators and trainers wins, how it scales, what async buys.

    python3 bench/layouts.py --model qwen3-1.7b colocated:8 split:2+6 split:4+4      # 8 GPUs
    python3 bench/layouts.py --model qwen3-0.6b split:1+1 split:1+1,async=1 split:1+1,async=2
    python3 bench/layouts.py --model qwen3-8b split:4+4,tp=2 split:4+4,tp=4
    python3 bench/layouts.py --model smollm2 colocated:2 colocated:4 colocated:8     # scaling
    python3 bench/layouts.py --model tiny --steps 3 colocated:2 split:1+1 split:1+1,async=1   # CPU smoke test

A variant is `colocated:N` (N ranks that each generate and train) or `split:G+T` (G generator and
T trainer ranks), optionally followed by `,async=K` (training.schedule = "async" with
max_staleness K) and `,tp=K` (parallelism.generator_tp). Models: `qwen3-0.6b`, `qwen3-1.7b`,
`qwen3-8b` (random-weight Qwen3 bodies with the 600-token fixture tokenizer, built once in
--workdir, on bench/rl_step.py's GSM8K-format workload: 64 prompts x 8, 256 new tokens),
`smollm2` (configs/smollm2_sums.toml; scripts/get_smollm2.py first) and `tiny` (2 layers, dim 64).

One JSON line per variant: medians over the steps after --skip of the step time, steps/s,
tokens/s in all and per GPU (prompt + completion tokens trained per second of step), generation,
training, weight-sync and per-role idle times, peak memory, and the per-step reward. For split
sync variants, `ceiling` is (G + T) / max(G, T) from that run's generation and training times:
what a perfectly overlapped async schedule could reach. A last line names the fastest variant
and, for variants of one mode at several GPU counts, the scaling efficiency per GPU against the
smallest count. Extra overrides after `--` go to every run.
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
    QWEN3_8B,
    TINY,
    build_checkpoint,
    build_prompts,
    workload_args,
)

BODIES = {
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-1.7b": {"layers": 28, "dim": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128, "ffn": 6144, "tied": 1},
    "qwen3-8b": QWEN3_8B,
    "tiny": TINY,
}
MEDIANS = ("time/step_s", "time/generate_s", "time/train_s", "time/weight_sync_s", "time/generator_idle_s",
           "time/trainer_idle_s", "throughput/generate_tok_s", "throughput/train_tok_s",
           "memory/generate_peak_gb", "memory/train_peak_gb")


def parse_variant(text: str) -> tuple[int, list[str]]:
    """`colocated:N` / `split:G+T` [`,async=K`] [`,tp=K`] -> (ranks, train_grpo.py overrides)."""
    layout, *options = text.split(",")
    mode, _, count = layout.partition(":")
    if mode == "colocated" and count.isdigit():
        ranks, args = int(count), ["--parallelism.mode=colocated"]
    elif mode == "split" and "+" in count and all(p.isdigit() for p in count.split("+")):
        generators, trainers = (int(p) for p in count.split("+"))
        ranks, args = generators + trainers, ["--parallelism.mode=split", f"--parallelism.generator_ranks={generators}"]
    else:
        raise SystemExit(f"layouts: variant {text!r}: expected colocated:N or split:G+T")
    for option in options:
        key, _, value = option.partition("=")
        if key == "async" and value.isdigit():
            args += ['--training.schedule="async"', f"--training.max_staleness={value}"]
        elif key == "tp" and value.isdigit():
            args.append(f"--parallelism.generator_tp={value}")
        else:
            raise SystemExit(f"layouts: variant {text!r}: unknown option {option!r} (async=K, tp=K)")
    return ranks, args


def workload(model: str, opts) -> list[str]:
    """train_grpo.py arguments of the workload (without layout and output folder)."""
    common = [*MEASURED_RUN, "--eval.num_prompts=16", f"--training.steps={opts.steps}"]
    if model == "smollm2":
        return ["--config", str(REPO / "configs" / "smollm2_sums.toml"), f"--model.path={opts.smollm2}", *common]
    if model not in BODIES:
        raise SystemExit(f"layouts: unknown model {model!r}; one of smollm2, {', '.join(BODIES)}")
    body = BODIES[model]
    ckpt = build_checkpoint(opts.workdir / f"{model}-body", body)
    data = build_prompts(opts.workdir / "prompts.jsonl", opts.steps * 64 + 16)
    return [*workload_args(ckpt, data), *common]


def run(variant: str, opts, base_args: list[str], extra: list[str]) -> dict:
    ranks, layout_args = parse_variant(variant)
    out = opts.workdir / "runs" / variant.replace(":", "_").replace(",", "_").replace("+", "-").replace("=", "")
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "train_grpo.py", *base_args, *layout_args, f"--job.output_dir={out}", *extra]
    # The runs' own output goes to stderr so that stdout carries only the JSON lines.
    result = subprocess.run(command, cwd=REPO, stdout=sys.stderr)
    if result.returncode != 0:
        return dict(bench="layouts", variant=variant, ranks=ranks, error=f"train_grpo.py exited with {result.returncode}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step_s" in r]
    timed = steps[opts.skip :] or steps
    row = dict(bench="layouts", variant=variant, ranks=ranks, steps=len(steps))
    for key in MEDIANS:
        if all(key in r for r in timed):
            row[key.split("/", 1)[1]] = round(statistics.median(r[key] for r in timed), 4)
    row["steps_per_s"] = round(1 / row["step_s"], 4)
    # Tokens trained per step: the trainer's rate over its own time, times that time.
    tokens = statistics.median(r["throughput/train_tok_s"] * r["time/train_s"] for r in timed)
    row["tok_s"] = round(tokens / row["step_s"])
    row["tok_s_per_gpu"] = round(tokens / row["step_s"] / ranks)
    if "split:" in variant and "async" not in variant:
        g, t = row["generate_s"], row["train_s"]
        row["ceiling"] = round((g + t) / max(g, t), 3)
    row["reward"] = [round(r["reward/mean"], 4) for r in steps if "reward/mean" in r]
    return row


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="colocated:N | split:G+T, with ,async=K / ,tp=K")
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the medians (compilation)")
    parser.add_argument("--smollm2", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-layouts"))
    opts = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    for variant in opts.variants:
        parse_variant(variant)  # every variant checked before the first launch
    opts.workdir.mkdir(parents=True, exist_ok=True)
    import torch

    base = dict(model=opts.model, commit=commit(), torch=torch.__version__,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", extra_args=extra)
    base_args = workload(opts.model, opts)
    rows = []
    for variant in opts.variants:
        rows.append(run(variant, opts, base_args, extra))
        print(json.dumps(dict(base, **rows[-1])), flush=True)
    done = [r for r in rows if "error" not in r]
    if not done:
        raise SystemExit("layouts: every variant failed")
    summary = dict(base, bench="layouts_summary", fastest=max(done, key=lambda r: r["steps_per_s"])["variant"])
    by_mode: dict[tuple[str, str], list[dict]] = {}
    for r in done:  # one mode with the same options, at several GPU counts
        by_mode.setdefault((r["variant"].split(":")[0], r["variant"].partition(",")[2]), []).append(r)
    scaling = {}
    for group in by_mode.values():
        smallest = min(group, key=lambda r: r["ranks"])
        for r in group:
            if r["ranks"] != smallest["ranks"]:
                scaling[r["variant"]] = round(r["tok_s_per_gpu"] / smallest["tok_s_per_gpu"], 3)
    if scaling:
        summary["scaling_per_gpu"] = scaling
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
