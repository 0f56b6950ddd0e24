"""Step metrics on the leader rank: metrics.jsonl, samples.jsonl, the console (a progress bar on a
terminal, plain lines otherwise), and optionally TensorBoard and Weights & Biases.

Also the cross-rank side: `REDUCTIONS` says how every metric key combines over ranks, and
`reduce_across` applies it to a dict of per-rank values in one collective.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from grpo.config import MetricsConfig
from grpo.errors import TandemError

# How each metric combines across ranks. A key is looked up exactly first, then by its prefix up to
# and including the first "/".
#   "mean": weighted by each rank's `weights` (its episode or token count), so the result equals the
#           value computed over the pooled episodes of all ranks;
#   "max":  the largest rank value (times: the slowest rank sets the pace; maxima stay maxima;
#           values identical on every rank come back exactly);
#   "sum":  counts and rates of ranks working side by side.
REDUCTIONS: dict[str, str] = {
    "reward/": "mean",  # episode means: the mean reward, and per reward function
    "episode/": "mean",  # episode means: completion length, truncated fraction, model turns
    "env/": "mean",  # episode means: time in environment calls, failed fraction
    "eval/": "mean",  # means over held-out completions
    "loss/": "mean",  # token means of the loss terms (clip fraction, entropy, KL, ratio)
    "loss/ratio_max": "max",
    "logprob_diff/mean": "mean",
    "logprob_diff/max": "max",
    "logprob_diff/exact_frac": "mean",
    "tis/": "mean",  # token means of the importance weights
    "staleness/": "mean",  # episode means: updates between an episode's policy and the one it trains
    "staleness/max": "max",
    "optimizer/": "max",  # the learning rate: the same on every rank
    "grpo/groups_filtered": "sum",
    "grpo/groups_trained": "sum",
    "grpo/generation_rounds": "max",  # every rank runs the same rounds
    "train/skipped_updates": "max",  # an update skipped on one rank is skipped on all
    "train/loss_tokens": "max",  # summed over the trainer ranks already: the same on every rank
    "time/": "max",  # the slowest rank
    "throughput/": "sum",  # tokens per second of ranks running in parallel
    "throughput/mfu": "mean",  # a fraction of each rank's own peak
    "weight_sync/": "sum",  # bandwidth of transfers running in parallel
    "memory/": "max",  # the rank closest to running out
    "model/": "max",  # parameter counts: the same on every rank
}

# Keys shown on a plain console line, in order, with their format.
_CONSOLE_KEYS = (
    ("reward/mean", "reward {:.3f}"),
    ("eval/reward_mean", "eval {:.3f}"),
    ("episode/length_mean", "len {:.1f}"),
    ("loss/policy", "loss {:+.4f}"),
    ("loss/entropy", "ent {:.3f}"),
    ("logprob_diff/max", "lp_diff {:.1e}"),
    ("time/step_s", "{:.2f}s"),
)
_BAR_WIDTH = 24
# The fields of one sample record, in table order.
_SAMPLE_COLUMNS = ("prompt", "completion", "reward", "advantage", "finish")


class MetricsBackendError(TandemError, RuntimeError):
    """A metrics backend is switched on but its package is missing; the message is one line."""


def reduction_of(key: str) -> str:
    """How `key` combines across ranks: "mean" | "max" | "sum" (see REDUCTIONS)."""
    if key in REDUCTIONS:
        return REDUCTIONS[key]
    prefix = key.split("/", 1)[0] + "/"
    if "/" in key and prefix in REDUCTIONS:
        return REDUCTIONS[prefix]
    raise KeyError(f"metric {key!r} has no cross-rank reduction: add it or its prefix to grpo.observe.metrics.REDUCTIONS")


def reduce_across(
    values: dict[str, float], group: dist.ProcessGroup | None, weights: float = 1.0
) -> dict[str, float]:
    """All-reduce per-rank metric values over `group`, each key by its REDUCTIONS entry.

    Every rank must pass the same keys (in any order). "mean" keys are averaged with this rank's
    `weights` (e.g. its episode count); a rank with weight 0 contributes nothing even if its values
    are NaN, and a key whose total weight is 0 comes back NaN (the logger drops NaN). One all_gather
    of a float64 [K + 1] vector; every rank then reduces the same [world, K + 1] table in the same
    order, so all ranks get bitwise-identical results.
    """
    keys = sorted(values)
    kinds = [reduction_of(key) for key in keys]
    local = torch.tensor([float(values[key]) for key in keys] + [float(weights)], dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered)  # [world, K + 1]
    rank_values, rank_weights = table[:, :-1], table[:, -1:]
    total_weight = float(rank_weights.sum())
    weighted = torch.where(rank_weights > 0, rank_values * rank_weights, torch.zeros_like(rank_values))
    reduced = {
        "mean": weighted.sum(0) / total_weight if total_weight > 0 else torch.full((len(keys),), math.nan),
        "max": rank_values.amax(0),
        "sum": rank_values.sum(0),
    }
    out = {key: float(reduced[kind][i]) for i, (key, kind) in enumerate(zip(keys, kinds))}
    return {key: out[key] for key in values}


def _backend(module: str, flag: str, package: str, load: bool) -> ModuleType | None:
    """Import `module` for a backend switched on by metrics.`flag`. Ranks that do not write
    (`load` False) only check that `package` is installed, so every rank fails alike without paying
    for the import."""
    try:
        if load:
            return importlib.import_module(module)
        if importlib.util.find_spec(package) is None:
            raise ImportError(package)
        return None
    except ImportError:
        raise MetricsBackendError(f"metrics.{flag} = true needs the {package} package: pip install {package}") from None


def _keep_until(path: Path, step: int) -> None:
    """Keep the JSONL records of `path` with step <= `step` and drop the rest, a line torn by a crash
    mid-write included; step 0 starts the file afresh. Rewritten through a temporary file so a crash
    here loses nothing."""
    kept = []
    if step > 0 and path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("step", math.inf) <= step:
                kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _rate(per_second: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_second >= scale:
            return f"{per_second / scale:.1f}{suffix}"
    return f"{per_second:.0f}"


def _markdown_table(samples: list[dict[str, Any]]) -> str:
    """Samples as a markdown table (TensorBoard's text plugin renders markdown)."""

    def cell(value: Any) -> str:
        text = f"{value:+.3f}" if isinstance(value, float) else str(value)
        # a "|" or a newline would end the cell or the row
        return text.replace("|", "\\|").replace("\n", "\\n")

    rows = ["| " + " | ".join(_SAMPLE_COLUMNS) + " |", "|" + " --- |" * len(_SAMPLE_COLUMNS)]
    rows += ["| " + " | ".join(cell(s.get(c, "")) for c in _SAMPLE_COLUMNS) + " |" for s in samples]
    return "\n".join(rows)


class _Console:
    """Per-step progress on stdout: a self-redrawing bar on a terminal, one plain line per step
    otherwise. The ETA is the mean wall time per step since the first logged step of this process
    (so a resumed run does not count the time before the resume) times the steps left."""

    def __init__(self, total_steps: int, bar: bool):
        self.total_steps, self.bar = total_steps, bar
        self.first: tuple[float, int] | None = None  # (time, step) of the first log
        self.drawn = 0  # length of the bar line on screen; 0 = none
        self.last_eval: float | None = None  # the bar keeps showing it between evaluations

    def show(self, step: int, metrics: dict[str, float]) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = (now, step)
        t0, step0 = self.first
        eta = (now - t0) / (step - step0) * (self.total_steps - step) if step > step0 else None
        line = self._plain(step, metrics, eta)
        if not self.bar:
            print(line, flush=True)
            return
        out = sys.stdout
        if "eval/reward_mean" in metrics:
            # a full line that stays in the scroll-back, under it the bar again
            out.write("\r" + line.ljust(self.drawn) + "\n")
            self.drawn = 0
        bar = self._bar(step, metrics, eta)[: shutil.get_terminal_size().columns - 1]  # a wrapped line cannot be redrawn
        out.write("\r" + bar.ljust(self.drawn))
        self.drawn = len(bar)
        if step >= self.total_steps:
            self.end_line()
        out.flush()

    def end_line(self) -> None:
        if self.drawn:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.drawn = 0

    def say(self, line: str, file=None) -> None:
        """Print a line of its own (to stdout, or `file`): the bar's line is ended first."""
        self.end_line()
        print(line, file=file or sys.stdout, flush=True)

    def _plain(self, step: int, metrics: dict[str, float], eta: float | None) -> str:
        parts = [fmt.format(metrics[key]) for key, fmt in _CONSOLE_KEYS if key in metrics]
        if eta is not None:
            parts.append(f"eta {_duration(eta)}")
        return f"step {step:>4}/{self.total_steps}  " + "  ".join(parts)

    def _bar(self, step: int, metrics: dict[str, float], eta: float | None) -> str:
        done = min(max(step, 0), self.total_steps)
        filled = done * _BAR_WIDTH // max(self.total_steps, 1)
        parts = [
            f"step {step}/{self.total_steps}",
            "[" + "#" * filled + "-" * (_BAR_WIDTH - filled) + f"] {done / max(self.total_steps, 1):4.0%}",
            f"eta {_duration(eta) if eta is not None else '?'}",
        ]
        if "reward/mean" in metrics:
            parts.append(f"reward {metrics['reward/mean']:.3f}")
        self.last_eval = metrics.get("eval/reward_mean", self.last_eval)
        if self.last_eval is not None:
            parts.append(f"eval {self.last_eval:.3f}")
        if "throughput/generate_tok_s" in metrics:
            parts.append(f"{_rate(metrics['throughput/generate_tok_s'])} tok/s")
        return "  ".join(parts)


class MetricsLogger:
    """Writes each step's metrics; only the leader rank (`enabled`) writes anything.

    <output_dir>/metrics.jsonl gets one JSON object per step (`step` plus the metrics, NaN dropped),
    <output_dir>/samples.jsonl one per `log_samples`. With `start_step` > 0 (a resumed run) both
    keep their records up to start_step and drop later ones, which are about to be redone; with 0
    both start empty. metrics.tensorboard and metrics.wandb add those backends; a backend switched
    on without its package raises MetricsBackendError here, on every rank.
    """

    def __init__(
        self,
        output_dir: str | Path,
        enabled: bool,
        cfg: MetricsConfig,
        total_steps: int,
        start_step: int = 0,
        run_config: dict[str, Any] | None = None,
    ):
        self.enabled, self.cfg = enabled, cfg
        self.dir = Path(output_dir)
        self.path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        tensorboard = _backend("torch.utils.tensorboard", "tensorboard", "tensorboard", enabled) if cfg.tensorboard else None
        wandb = _backend("wandb", "wandb", "wandb", enabled) if cfg.wandb else None
        self._tensorboard = self._wandb = self._console = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        _keep_until(self.path, start_step)
        _keep_until(self.samples_path, start_step)
        if tensorboard is not None:
            # purge_step hides events a crashed run wrote past the resume point
            self._tensorboard = tensorboard.SummaryWriter(
                log_dir=str(self.dir / "tensorboard"), purge_step=start_step + 1 if start_step > 0 else None
            )
        if wandb is not None:
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                mode=cfg.wandb_mode or None,
                dir=str(self.dir),
                config=run_config,
                id=self._wandb_id(resumed=start_step > 0),
                resume="allow",
            )
            self._wandb_module = wandb
        if cfg.console:
            self._console = _Console(total_steps, bar=cfg.progress_bar and sys.stdout.isatty())

    def _wandb_id(self, resumed: bool) -> str:
        """The W&B run id in <output_dir>/wandb_id: kept by a resumed run, so it continues the same
        W&B run; new for a fresh one."""
        path = self.dir / "wandb_id"
        if resumed and path.exists():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:12]
        path.write_text(run_id + "\n")
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics everywhere that is switched on."""
        if not self.enabled:
            return
        values = {key: float(value) for key, value in metrics.items() if not math.isnan(value)}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()  # a live TensorBoard shows the step now, not minutes later
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._console is not None:
            self._console.show(step, metrics)

    def say(self, line: str, file=None) -> None:
        """A message line of the run (to stdout, or `file`), never glued onto the progress bar."""
        if self._console is not None:
            self._console.say(line, file)
        else:
            print(line, file=file or sys.stdout, flush=True)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Record example episodes, each {"prompt", "completion", "reward", "advantage", "finish"}."""
        if not self.enabled:
            return
        with self.samples_path.open("a") as f:
            f.write(json.dumps({"step": step, "samples": samples}) + "\n")
        if self._tensorboard is not None:
            self._tensorboard.add_text("samples", _markdown_table(samples), step)
            self._tensorboard.flush()
        if self._wandb is not None:
            columns = list(_SAMPLE_COLUMNS)
            table = self._wandb_module.Table(columns=columns, data=[[s.get(c) for c in columns] for s in samples])
            self._wandb.log({"samples": table}, step=step)

    def close(self) -> None:
        """Flush and close the backends; safe to call twice."""
        if self._console is not None:
            self._console.end_line()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
