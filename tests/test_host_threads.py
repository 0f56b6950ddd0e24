"""A GPU rank does its CPU tensor work in one thread unless OMP_NUM_THREADS is set (train_grpo.py
one_host_thread; measured in bench/RESULTS.md); a CPU rank, whose model runs on those threads,
keeps torch's default."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import train_grpo
from tests.test_e2e import REPO


def test_one_thread_unless_the_environment_says_otherwise(monkeypatch):
    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        train_grpo.one_host_thread()
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
        monkeypatch.delenv("OMP_NUM_THREADS")
        train_grpo.one_host_thread()
        assert torch.get_num_threads() == 1
        # Processes the rank starts later (reward workers) inherit it.
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(threads)


def test_a_cpu_run_keeps_torchs_threads(tmp_path):
    """The CPU demo's model trains on torch's intra-op threads: a CPU rank leaves them as they are."""
    script = (
        "import torch, train_grpo; from grpo.config import load_config; "
        "before = torch.get_num_threads(); "
        "train_grpo.init_distributed(load_config(['--parallelism.mode=colocated', '--job.device=cpu'], 1)); "
        "print(before, torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    assert after == before
