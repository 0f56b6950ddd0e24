"""A run's metrics as one PNG plus a short text summary.

    python -m grpo.observe.report RUN_DIR [--out PNG]      (default: RUN_DIR/report.png)

Reads RUN_DIR/metrics.jsonl, also while the run is still writing it: a line that does not parse
(the one being written, or torn by a crash) is skipped. Panels whose metrics the run does not
log are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.errors import TandemError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# (title, [(metric key, legend label)], kind). Kinds: "train" = a line per step with a rolling mean
# over it, "eval" = markers at the (sparse) eval steps, "twin" = a second y axis for the second
# series (KL is orders of magnitude below entropy), "stack" = stacked areas with the step total.
_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("reward", (("reward/mean", "train"),), "train"),
    ("reward", (("eval/reward_mean", "eval"),), "eval"),
    ("response length (tokens)", (("episode/length_mean", "train"),), "train"),
    ("response length (tokens)", (("eval/length_mean", "eval"),), "eval"),
    ("entropy / KL", (("loss/entropy", "entropy"), ("loss/kl", "KL")), "twin"),
    ("clip fraction", (("loss/clip_frac", "clipped tokens"),), "train"),
    (
        "time per step (s)",
        (
            ("time/generate_s", "generate"),
            ("time/score_s", "score"),
            ("time/train_s", "train"),
            ("time/weight_sync_s", "weight sync"),
        ),
        "stack",
    ),
)
_STEP_TOTAL = "time/step_s"


class ReportError(TandemError):
    """Nothing to report; the message is one line for the user."""


def read_records(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl in step order (the last record of a step wins); lines
    that do not parse are skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry `key`."""
    pairs = [(r["step"], float(r[key])) for r in records if key in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value with up to window - 1 before it (GRPO rewards are noisy step to step)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _draw(ax: Any, records: list[dict[str, Any]], keys: tuple[tuple[str, str], ...], kind: str) -> None:
    if kind == "stack":
        present = [(key, label) for key, label in keys if any(key in r for r in records)]
        rows = [r for r in records if any(key in r for key, _ in present)]
        ax.stackplot([r["step"] for r in rows], *[[r.get(key, 0.0) for r in rows] for key, _ in present],
                     labels=[label for _, label in present], alpha=0.8)
        if any(_STEP_TOTAL in r for r in records):
            ax.plot(*_series(records, _STEP_TOTAL), color="black", linewidth=1, label="whole step")
        ax.legend(fontsize="small", loc="upper left")
        return
    if kind == "twin":
        present = [(key, label) for key, label in keys if any(key in r for r in records)]
        for (key, label), axis, color in zip(present, (ax, ax.twinx()) if len(present) > 1 else (ax,), ("C0", "C3")):
            axis.plot(*_series(records, key), color=color, label=label)
            axis.set_ylabel(label, color=color)
        return
    for key, label in keys:
        steps, values = _series(records, key)
        if kind == "eval":
            ax.plot(steps, values, "o-", color="C1", label=label)
        elif len(values) > 20:
            line, = ax.plot(steps, values, alpha=0.3, label=label)
            window = max(2, len(values) // 20)
            ax.plot(steps, _rolling_mean(values, window), color=line.get_color(), label=f"{label} ({window}-step mean)")
        else:
            ax.plot(steps, values, label=label)
    ax.legend(fontsize="small")


def build_figure(records: list[dict[str, Any]], title: str = "") -> Figure:
    """One axis per panel whose metrics appear in `records` (two columns), against step."""
    # Imported here: a run loads matplotlib (most of a second) only when it draws its report.
    from matplotlib.figure import Figure

    panels: dict[str, list[tuple[tuple[tuple[str, str], ...], str]]] = {}
    for name, keys, kind in _PANELS:
        if any(key in r for r in records for key, _ in keys):
            panels.setdefault(name, []).append((keys, kind))
    cols = 2 if len(panels) > 1 else 1
    rows = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(6 * cols, 3.2 * rows), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax, (name, layers) in zip(axes, panels.items()):
        for keys, kind in layers:
            _draw(ax, records, keys, kind)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        fig.delaxes(ax)
    if title:
        fig.suptitle(title)
    return fig


def _change(records: list[dict[str, Any]], key: str) -> str | None:
    steps, values = _series(records, key)
    if not values:
        return None
    return f"{key}: {values[0]:.3f} (step {steps[0]}) -> {values[-1]:.3f} (step {steps[-1]})"


def summary(records: list[dict[str, Any]]) -> str:
    """A few lines: steps done, train and eval reward first -> last, mean step time."""
    lines = [f"{records[-1]['step']} steps done" if records else "no steps logged"]
    lines += [change for key in ("reward/mean", "eval/reward_mean") if (change := _change(records, key))]
    _, step_times = _series(records, _STEP_TOTAL)
    if step_times:
        lines.append(f"mean step time: {sum(step_times) / len(step_times):.2f} s over {len(step_times)} steps")
    return "\n".join(lines)


def load_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl; ReportError when there are none to report."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"no run folder at {run_dir}")
    path = run_dir / "metrics.jsonl"
    records = read_records(path) if path.is_file() else []
    if not records:
        raise ReportError(f"no steps logged yet in {path}")
    return records


def _save(records: list[dict[str, Any]], run_dir: str | Path, out: str | Path | None) -> Path:
    out = Path(out) if out is not None else Path(run_dir) / "report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    # written beside and renamed, so an image viewer never shows a half-written file
    tmp = out.with_name(f".{out.name}.tmp")
    build_figure(records, title=str(run_dir)).savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out)
    return out


def render_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the PNG of RUN_DIR's metrics (default RUN_DIR/report.png) and return its path;
    ReportError when the run has logged no step yet."""
    return _save(load_run(run_dir), run_dir, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.observe.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run's job.output_dir (holding metrics.jsonl)")
    parser.add_argument("--out", help="PNG to write (default: RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    try:
        records = load_run(args.run_dir)
    except ReportError as e:
        print(e, file=sys.stderr)
        return 1
    print(summary(records))
    print(f"report: {_save(records, args.run_dir, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
