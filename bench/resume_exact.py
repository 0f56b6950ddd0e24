"""Exact resume on the machine at hand: an uninterrupted run against one stopped by SIGTERM after
step --stop-after and resumed, same config. Prints one JSON line: where it stopped, whether every
per-step reward/loss figure and every final weight is bitwise equal, and the cost of the stop.

    python bench/resume_exact.py --nproc 2 --mode split [-- extra train_grpo.py options]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def command(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "train_grpo.py"), *args]


def logged_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def series(run_dir: Path) -> dict:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(("reward/", "loss/", "eval/"))}
            for r in logged_steps(run_dir)}


def workers(parent: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    pids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mode", default="split")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stop-after", type=int, default=6)
    parser.add_argument("extra", nargs="*")
    opts = parser.parse_args()
    base = [f"--parallelism.mode={opts.mode}", f"--training.steps={opts.steps}", "--job.deterministic=true",
            "--checkpoint.every=0", *opts.extra]
    with tempfile.TemporaryDirectory() as tmp:
        full, cut = Path(tmp) / "full", Path(tmp) / "cut"
        start = time.perf_counter()
        subprocess.run(command(opts.nproc, [*base, f"--job.output_dir={full}"]), check=True, capture_output=True)
        full_s = time.perf_counter() - start

        proc = subprocess.Popen(command(opts.nproc, [*base, f"--job.output_dir={cut}"]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not any(r.get("step") == opts.stop_after for r in logged_steps(cut)):
            if proc.poll() is not None:
                raise SystemExit(f"run ended before step {opts.stop_after}: {proc.stderr.read()[-2000:]}")
            time.sleep(0.02)
        signalled = time.perf_counter()
        for pid in workers(proc.pid):
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate()
        stop_s = time.perf_counter() - signalled
        stopped = [line for line in out.splitlines() if line.startswith("stopped by")]
        if proc.returncode != 0 or not stopped:
            raise SystemExit(f"the stopped run did not exit cleanly ({proc.returncode}): {err[-2000:]}")
        stopped_at = int(stopped[0].split("after step ")[1].split(":")[0])

        start = time.perf_counter()
        subprocess.run(command(opts.nproc, [*base, f"--job.output_dir={cut}"]), check=True, capture_output=True)
        resume_s = time.perf_counter() - start

        a = load_file(full / "hf" / f"step_{opts.steps}" / "model.safetensors")
        b = load_file(cut / "hf" / f"step_{opts.steps}" / "model.safetensors")
        print(json.dumps({
            "mode": opts.mode,
            "nproc": opts.nproc,
            "steps": opts.steps,
            "stopped_after_step": stopped_at,
            "series_equal": series(full) == series(cut),
            "weights_bitwise_equal": a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a),
            "signal_to_exit_s": round(stop_s, 2),
            "uninterrupted_s": round(full_s, 1),
            "resumed_part_s": round(resume_s, 1),
        }), flush=True)


if __name__ == "__main__":
    main()
