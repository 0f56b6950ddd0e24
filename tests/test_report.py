"""grpo/observe/report.py: the PNG and text summary of a run's metrics.jsonl, and the command line's
answers for a run folder with nothing to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.observe.report import build_figure, main, read_records, render_report, summary

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_run(run_dir: Path, steps: int = 30) -> None:
    """metrics.jsonl as a run writes it: step 0 is the first evaluation, eval every 10 steps, and
    a last line torn mid-write."""
    records = [{"step": 0, "eval/reward_mean": 0.05, "eval/length_mean": 4.0}]
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "reward/mean": step / 100 + 0.09,
            "reward/digit_match": step / 100 + 0.09,
            "episode/length_mean": 4.0 - step / 30,
            "loss/policy": 0.01,
            "loss/entropy": 2.0 - step / 30,
            "loss/kl": step / 1000,
            "loss/clip_frac": 0.02,
            "time/generate_s": 0.3,
            "time/score_s": 0.05,
            "time/train_s": 0.2,
            "time/weight_sync_s": 0.01,
            "time/step_s": 0.5 + (step % 2) * 0.1,
        }
        if step % 10 == 0:
            record.update({"eval/reward_mean": step / 40, "eval/length_mean": 4.0})
        records.append(record)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 31, "rew')


def test_read_records_skips_torn_line(tmp_path):
    _synthetic_run(tmp_path)
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(31))


def test_figure_has_a_panel_per_metric_group(tmp_path):
    _synthetic_run(tmp_path)
    fig = build_figure(read_records(tmp_path / "metrics.jsonl"))
    titles = {ax.get_title() for ax in fig.axes}
    assert titles >= {"reward", "response length (tokens)", "entropy / KL", "clip fraction", "time per step (s)"}
    assert len(fig.axes) >= 5
    # only the metrics a run logs get a panel
    only_reward = build_figure([{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.7}])
    assert [ax.get_title() for ax in only_reward.axes] == ["reward"]


def test_render_report_writes_a_png(tmp_path):
    _synthetic_run(tmp_path)
    path = render_report(tmp_path)
    assert path == tmp_path / "report.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_summary_lines(tmp_path):
    _synthetic_run(tmp_path)
    text = summary(read_records(tmp_path / "metrics.jsonl"))
    assert text.splitlines() == [
        "30 steps done",
        "reward/mean: 0.100 (step 1) -> 0.390 (step 30)",
        "eval/reward_mean: 0.050 (step 0) -> 0.750 (step 30)",
        "mean step time: 0.55 s over 30 steps",  # 15 steps of 0.5 s and 15 of 0.6 s
    ]


def test_command_line_writes_png_and_prints_summary(tmp_path, capsys):
    _synthetic_run(tmp_path / "run")
    out = tmp_path / "plots" / "r.png"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("30 steps done\n") and printed.endswith(f"report: {out}\n")
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("case", ["empty folder", "torn line only", "missing folder"])
def test_command_line_nothing_to_report(tmp_path, case):
    run_dir = tmp_path / "run"
    if case != "missing folder":
        run_dir.mkdir()
    if case == "torn line only":
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "rew')
    result = subprocess.run(
        [sys.executable, "-m", "grpo.observe.report", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    expected = f"no run folder at {run_dir}" if case == "missing folder" else f"no steps logged yet in {run_dir}/metrics.jsonl"
    assert (result.returncode, result.stderr, result.stdout) == (1, expected + "\n", "")
    assert not (run_dir / "report.png").exists()
