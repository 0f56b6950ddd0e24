"""Step metrics: one JSON object per step in <output_dir>/metrics.jsonl, and a console line on rank 0."""

from __future__ import annotations

import json
import math
from pathlib import Path

# Keys shown on the console line, in order, with their format.
_CONSOLE_KEYS = (
    ("reward/mean", "reward {:.3f}"),
    ("eval/reward_mean", "eval {:.3f}"),
    ("episode/length_mean", "len {:.1f}"),
    ("loss/policy", "loss {:+.4f}"),
    ("loss/entropy", "ent {:.3f}"),
    ("logprob_diff/max", "lp_diff {:.1e}"),
    ("time/step_s", "{:.2f}s"),
)


class MetricsLogger:
    """Appends each step's metrics to metrics.jsonl; only the writing rank (rank 0) does anything."""

    def __init__(self, output_dir: str | Path, enabled: bool, console: bool, total_steps: int):
        self.enabled, self.console, self.total_steps = enabled, console, total_steps
        self.path = Path(output_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if not math.isnan(v)}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.console:
            parts = [fmt.format(metrics[key]) for key, fmt in _CONSOLE_KEYS if key in metrics]
            print(f"step {step:>4}/{self.total_steps}  " + "  ".join(parts), flush=True)
