"""Sync against async schedules on the same config: steps/s, tokens/s, and the ceiling they set.

    python3 bench/schedule.py [--mode split|colocated] [--nproc 2] [--steps 60] [--skip 5] [--lags 1,2]
                              [-- extra train_grpo.py args]

Runs train_grpo.py (split roles, 1 generator rank, the rest trainers; or `--mode colocated`, every
rank both, generating in a background thread on the async schedule; the embedded demo unless the
extra arguments say otherwise) once with `training.schedule = "sync"` and once per lag k with
`"async"`, and prints one JSON line per run: the median step time over steps skip + 1 .. steps,
steps/s, completion tokens/s, and the median generation time G and scoring + training time T of
the step. Then one line per async run against the sync run of the same invocation: its speedup and
the fraction of the ceiling (G + T) / max(G, T) it reaches, G and T taken from the sync run (the
step cannot beat the slower role when the other hides behind it completely).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(schedule: str, lag: int, opts, extra: list[str], workdir: Path) -> dict:
    out = workdir / f"{schedule}_k{lag}"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={opts.nproc}",
        str(REPO / "train_grpo.py"), f"--parallelism.mode={opts.mode}", f"--training.schedule={schedule}",
        f"--training.max_staleness={max(lag, 1)}", f"--training.steps={opts.steps}", f"--job.output_dir={out}",
        "--checkpoint.resume=none", "--metrics.progress_bar=false", *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{schedule} k={lag} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step_s" in r and r["step"] > opts.skip]
    step_s = statistics.median(r["time/step_s"] for r in steps)
    tokens = statistics.median(r["episode/length_mean"] for r in steps) * rows_per_step(out)
    return dict(
        bench="schedule", mode=opts.mode, schedule=schedule, max_staleness=lag, steps=opts.steps, skip=opts.skip,
        nproc=opts.nproc, step_s=round(step_s, 4), steps_per_s=round(1 / step_s, 2),
        completion_tok_s=round(tokens / step_s, 1),
        generate_s=round(statistics.median(r["time/generate_s"] for r in steps), 4),
        score_train_s=round(statistics.median(r["time/score_s"] + r["time/train_s"] for r in steps), 4),
        weight_sync_s=round(statistics.median(r["time/weight_sync_s"] for r in steps), 4),
        staleness_max=max(r.get("staleness/max", 0.0) for r in steps),
        eval_accuracy_last=next((r["eval/accuracy"] for r in reversed(rows) if "eval/accuracy" in r), None),
    )


def rows_per_step(out: Path) -> int:
    """Episodes per step from the run's resolved config."""
    import tomllib

    cfg = tomllib.loads((out / "config.toml").read_text())
    return cfg["data"]["prompts_per_step"] * cfg["grpo"]["group_size"]


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["split", "colocated"], default="split", help="parallelism.mode of every run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians (warm-up)")
    parser.add_argument("--lags", default="1,2", help="async max_staleness values to run")
    opts = parser.parse_args(own)
    with tempfile.TemporaryDirectory(prefix="tandem-schedule-") as tmp:
        sync = run("sync", 0, opts, extra, Path(tmp))
        print(json.dumps(sync), flush=True)
        G, T = sync["generate_s"], sync["score_train_s"]
        ceiling = (G + T) / max(G, T)
        for lag in (int(k) for k in opts.lags.split(",")):
            result = run("async", lag, opts, extra, Path(tmp))
            print(json.dumps(result), flush=True)
            speedup = sync["step_s"] / result["step_s"]
            print(json.dumps(dict(bench="schedule_ratio", max_staleness=lag, speedup_over_sync=round(speedup, 3),
                                  ceiling=round(ceiling, 3), fraction_of_ceiling=round(speedup / ceiling, 3))),
                  flush=True)


if __name__ == "__main__":
    main()
