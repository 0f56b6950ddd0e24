"""The CUDA kernels' logic on the CPU, through Triton's interpreter: the batch-invariant ones, the
sampler's, the SwiGLU one, the decode step's slot-state ones and the shared-prefix merge
(tests/interpreted_kernels.py has the checks), and a whole demo run on the invariant ones: with
the kernels interpreted, the engine's log-probs equal the trainer's at every step.

Triton >= 3.9 is needed (its interpreter: earlier releases fail on NumPy 2's scalar conversion);
the README's test command installs it. On a machine with a GPU these skip: the kernels run for
real there (tests/test_bitwise_gpu.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.test_e2e import REPO, SHORT, command, launch_env, metrics


def _interpreter_problem() -> str | None:
    if torch.cuda.is_available():
        return "a GPU is present: tests/test_bitwise_gpu.py runs the kernels for real"
    if importlib.util.find_spec("triton") is None:
        return "needs triton >= 3.9 (pip install 'triton>=3.9')"
    import triton

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        return f"needs triton >= 3.9 for its interpreter, found {triton.__version__}"
    return None


pytestmark = pytest.mark.skipif(_interpreter_problem() is not None, reason=str(_interpreter_problem()))


def _interpreted_env() -> dict[str, str]:
    return {**launch_env(), "TRITON_INTERPRET": "1"}


# The interpreter is slow: one engine-against-trainer case (tests/test_bitwise.py runs them all on
# the CPU reference) and one demo run, split, where the weights reach the engine over the wire.
CHECKS = ["matmul", "gumbel_sample", "silu_mul", "rms_norm", "attention", "slot_step", "gradients", "prefix_merge",
          "split_decode",
          "pipeline_batch_24"]


@pytest.fixture(scope="module")
def interpreted_checks() -> str:
    """The output of every check, run in one interpreted process."""
    run = subprocess.run([sys.executable, "-m", "tests.interpreted_kernels", *CHECKS], cwd=REPO,
                         env=_interpreted_env(), capture_output=True, text=True, timeout=900)
    return run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_the_interpreter(interpreted_checks, check):
    assert f"{check}: ok" in interpreted_checks.splitlines(), interpreted_checks


def test_demo_on_the_interpreted_kernels_reports_exact_logprobs(tmp_path):
    """Engine and trainer on the kernels (the start-up line says so), weights changing over 3 steps."""
    args = [*SHORT, "--job.bitwise_logprobs=true", "--parallelism.mode=split", f"--job.output_dir={tmp_path}"]
    run = subprocess.run(command(args, 2), cwd=REPO, env=_interpreted_env(), capture_output=True, text=True,
                         timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "numerics: batch-invariant log-probs, invariant Triton kernels under Triton's interpreter" in run.stdout
    steps = [r for r in metrics(tmp_path) if "logprob_diff/max" in r]
    assert len(steps) == 3
    assert all(r["logprob_diff/max"] == 0.0 and r["logprob_diff/exact_frac"] == 1.0 for r in steps)
