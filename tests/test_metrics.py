"""grpo/observe/metrics.py (cross-rank reductions, metrics.jsonl / samples.jsonl with resume, TensorBoard,
W&B, the console) and grpo/observe/flops.py (FLOPs per token, device peaks, MFU).

Expected values are written out by hand; TensorBoard output is read back with TensorBoard's own
event reader; the FLOP count checks its parameter part against a real model's named_parameters.
"""

from __future__ import annotations

import io
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from grpo.config import MetricsConfig
from grpo.observe import metrics as metrics_module
from grpo.observe.flops import batch_mfu, flops_per_token, mfu, peak_flops
from grpo.observe.metrics import MetricsBackendError, MetricsLogger, reduce_across, reduction_of
from model import ModelArgs, Transformer
from tests.dist_utils import run_ranks

QUIET = MetricsConfig(console=False)


# ---- cross-rank reduction ----

# Per-rank values and weights (episode counts) of the 2-rank run; rank 1 lists its keys in another order.
_RANK_VALUES = [
    {"reward/mean": 0.2, "loss/ratio_max": 1.5, "time/train_s": 3.0, "grpo/groups_filtered": 2.0,
     "throughput/generate_tok_s": 100.0},
    {"throughput/generate_tok_s": 300.0, "grpo/groups_filtered": 1.0, "time/train_s": 5.0,
     "loss/ratio_max": 1.2, "reward/mean": 0.8},
]
_RANK_WEIGHTS = [1.0, 3.0]


def _reduce_rank(rank: int, world_size: int) -> tuple[dict[str, float], dict[str, float]]:
    weighted = reduce_across(_RANK_VALUES[rank], None, weights=_RANK_WEIGHTS[rank])
    # a rank without episodes: weight 0 and a NaN mean, which must not poison the result
    empty = reduce_across({"episode/length_mean": math.nan if rank == 0 else 7.0}, None, weights=float(rank))
    return weighted, empty


def test_reduce_across_two_gloo_ranks(tmp_path):
    expected = {
        "reward/mean": (0.2 * 1.0 + 0.8 * 3.0) / 4.0,  # episode-weighted mean
        "loss/ratio_max": 1.5,
        "time/train_s": 5.0,  # the slowest rank
        "grpo/groups_filtered": 3.0,
        "throughput/generate_tok_s": 400.0,
    }
    results = run_ranks(_reduce_rank, 2, tmp_path)
    for rank, (weighted, empty) in enumerate(results):
        assert list(weighted) == list(_RANK_VALUES[rank])  # the caller's key order comes back
        assert weighted == pytest.approx(expected, rel=1e-12)
        assert empty == {"episode/length_mean": 7.0}
    assert results[0] == results[1]


def test_reduction_table():
    assert reduction_of("reward/digit_match") == "mean"
    assert reduction_of("loss/entropy") == "mean"
    assert reduction_of("loss/ratio_max") == "max"  # an exact entry beats its prefix
    assert reduction_of("time/generate_s") == "max"
    assert reduction_of("grpo/groups_filtered") == "sum"
    assert reduction_of("throughput/train_tok_s") == "sum"
    assert reduction_of("throughput/mfu") == "mean"
    logged = ["reward/mean", "reward/format", "episode/length_mean", "episode/truncated_frac", "eval/pass@k",
              "loss/policy", "loss/clip_frac", "loss/kl", "loss/grad_norm", "logprob_diff/mean", "logprob_diff/max",
              "tis/mean_weight", "optimizer/lr", "grpo/groups_trained", "grpo/generation_rounds",
              "train/skipped_updates", "time/weight_sync_s", "throughput/generate_tok_s", "weight_sync/GBps"]
    assert {reduction_of(key) for key in logged} == {"mean", "max", "sum"}
    with pytest.raises(KeyError, match="no cross-rank reduction.*REDUCTIONS"):
        reduction_of("mystery/value")
    with pytest.raises(KeyError):
        reduction_of("grpo/unlisted")  # grpo/ has exact entries only


# ---- metrics.jsonl / samples.jsonl ----


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_fresh_run_truncates_and_writes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 9, "old": 1}\n')
    with MetricsLogger(tmp_path, True, QUIET, total_steps=3) as logger:
        logger.log(0, {"eval/reward_mean": 0.25})
        logger.log(1, {"reward/mean": 0.5, "loss/kl": math.nan, "time/step_s": 1.25})
        logger.log_samples(1, [{"prompt": "12=", "completion": "12", "reward": 1.0, "advantage": 0.5, "finish": "stop"}])
    assert _records(tmp_path / "metrics.jsonl") == [
        {"step": 0, "eval/reward_mean": 0.25},
        {"step": 1, "reward/mean": 0.5, "time/step_s": 1.25},  # NaN dropped
    ]
    assert _records(tmp_path / "samples.jsonl") == [
        {"step": 1, "samples": [{"prompt": "12=", "completion": "12", "reward": 1.0, "advantage": 0.5, "finish": "stop"}]}
    ]


def test_jsonl_resume_keeps_steps_up_to_start_and_drops_torn_line(tmp_path):
    lines = [json.dumps({"step": s, "reward/mean": s / 10}) for s in range(6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "rew')
    (tmp_path / "samples.jsonl").write_text(
        "".join(json.dumps({"step": s, "samples": []}) + "\n" for s in (2, 4)) + '{"step": 6, "sa'
    )
    logger = MetricsLogger(tmp_path, True, QUIET, total_steps=10, start_step=3)
    logger.log(4, {"reward/mean": 0.99})
    logger.close()
    assert _records(tmp_path / "metrics.jsonl") == [
        *({"step": s, "reward/mean": s / 10} for s in range(4)),
        {"step": 4, "reward/mean": 0.99},
    ]
    assert _records(tmp_path / "samples.jsonl") == [{"step": 2, "samples": []}]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", False, MetricsConfig(), total_steps=3)
    logger.log(1, {"reward/mean": 0.5})
    logger.log_samples(1, [])
    logger.close()
    assert not (tmp_path / "run").exists()


# ---- TensorBoard ----


def _event_reader(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    reader.Reload()
    return reader


def test_tensorboard_scalars_and_samples_read_back(tmp_path):
    cfg = MetricsConfig(console=False, tensorboard=True)
    steps = {1: {"reward/mean": 0.1, "time/step_s": 2.5}, 2: {"reward/mean": 0.3, "time/step_s": 2.0},
             3: {"reward/mean": 0.7, "time/step_s": 1.5}}
    with MetricsLogger(tmp_path, True, cfg, total_steps=3) as logger:
        for step, values in steps.items():
            logger.log(step, values)
        logger.log_samples(3, [{"prompt": "41=", "completion": "4|1", "reward": 0.5, "advantage": -0.25, "finish": "length"}])
    reader = _event_reader(tmp_path / "tensorboard")
    assert set(reader.Tags()["scalars"]) == {"reward/mean", "time/step_s"}
    for key in ("reward/mean", "time/step_s"):
        events = reader.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3]
        assert [e.value for e in events] == pytest.approx([steps[s][key] for s in (1, 2, 3)], rel=1e-6)
    text = reader.Tensors("samples/text_summary")
    assert [t.step for t in text] == [3]
    table = text[0].tensor_proto.string_val[0].decode()
    assert "| prompt | completion | reward | advantage | finish |" in table
    assert "| 41= | 4\\|1 | +0.500 | -0.250 | length |" in table


def test_tensorboard_resume_purges_steps_after_start(tmp_path):
    cfg = MetricsConfig(console=False, tensorboard=True)
    with MetricsLogger(tmp_path, True, cfg, total_steps=5) as logger:
        for step in range(1, 6):
            logger.log(step, {"reward/mean": float(step)})
    with MetricsLogger(tmp_path, True, cfg, total_steps=5, start_step=3) as logger:
        for step in (4, 5):
            logger.log(step, {"reward/mean": 10.0 * step})
    events = _event_reader(tmp_path / "tensorboard").Scalars("reward/mean")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_missing_tensorboard_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    message = "metrics.tensorboard = true needs the tensorboard package: pip install tensorboard"
    for enabled in (True, False):  # every rank fails alike, not just the writing one
        with pytest.raises(MetricsBackendError) as info:
            MetricsLogger(tmp_path, enabled, MetricsConfig(tensorboard=True), total_steps=3)
        assert str(info.value) == message
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before touching the run folder


# ---- Weights & Biases (a stand-in module recording the calls) ----


def _fake_wandb(calls: list) -> types.ModuleType:
    module = types.ModuleType("wandb")

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    module.init, module.Table = init, Table
    return module


def test_wandb_run_id_kept_on_resume(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    cfg = MetricsConfig(console=False, wandb=True, wandb_project="proj", wandb_mode="offline")
    with MetricsLogger(tmp_path, True, cfg, total_steps=3, run_config={"seed": 1}) as logger:
        logger.log(1, {"reward/mean": 0.5, "loss/kl": math.nan})
        logger.log_samples(1, [{"prompt": "p", "completion": "c", "reward": 1.0, "advantage": 0.0, "finish": "stop"}])
    run_id = (tmp_path / "wandb_id").read_text().strip()
    assert calls[0] == ("init", {"project": "proj", "mode": "offline", "dir": str(tmp_path), "config": {"seed": 1},
                                 "id": run_id, "resume": "allow"})
    assert calls[1] == ("log", {"reward/mean": 0.5}, 1)
    _, table_log, step = calls[2]
    assert step == 1 and table_log["samples"].data == [["p", "c", 1.0, 0.0, "stop"]]
    assert calls[3] == ("finish",)

    calls.clear()
    MetricsLogger(tmp_path, True, MetricsConfig(console=False, wandb=True), total_steps=3, start_step=1).close()
    assert calls[0][1]["id"] == run_id and calls[0][1]["mode"] is None  # "" = W&B's own default
    calls.clear()
    MetricsLogger(tmp_path, True, MetricsConfig(console=False, wandb=True), total_steps=3).close()
    assert calls[0][1]["id"] != run_id  # a fresh run is a new W&B run


def test_missing_wandb_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MetricsBackendError, match="^metrics.wandb = true needs the wandb package: pip install wandb$"):
        MetricsLogger(tmp_path, True, MetricsConfig(wandb=True), total_steps=3)


# ---- console ----


class _Clock:
    """Stands in for the time module: each call to monotonic() is 10 s after the previous one."""

    def __init__(self):
        self.now = -10.0

    def monotonic(self) -> float:
        self.now += 10.0
        return self.now


def test_console_plain_lines_when_not_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(metrics_module, "time", _Clock())
    logger = MetricsLogger(tmp_path, True, MetricsConfig(), total_steps=5)  # progress_bar on, but no tty
    logger.log(0, {"eval/reward_mean": 0.25})
    logger.log(1, {"reward/mean": 0.5, "episode/length_mean": 4.0, "time/step_s": 1.25})
    logger.log(2, {"reward/mean": 0.75, "episode/length_mean": 3.5, "time/step_s": 1.5})
    logger.close()
    assert capsys.readouterr().out.splitlines() == [
        "step    0/5  eval 0.250",
        "step    1/5  reward 0.500  len 4.0  1.25s  eta 40s",  # 10 s per step, 4 to go
        "step    2/5  reward 0.750  len 3.5  1.50s  eta 30s",
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_module, "time", _Clock())
    monkeypatch.setenv("COLUMNS", "200")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    logger = MetricsLogger(tmp_path, True, MetricsConfig(), total_steps=3)
    logger.log(0, {"eval/reward_mean": 0.25})
    logger.log(1, {"reward/mean": 0.5, "throughput/generate_tok_s": 1234.0})
    logger.log(2, {"reward/mean": 0.625, "throughput/generate_tok_s": 2500.0})
    logger.log(3, {"reward/mean": 0.75, "eval/reward_mean": 0.5, "throughput/generate_tok_s": 2500.0})
    logger.close()
    out = terminal.getvalue()
    lines = out.split("\n")
    # eval steps leave a full line in the scroll-back; the bar is redrawn in place with \r
    assert lines[0] == "\rstep    0/3  eval 0.250"
    assert lines[1].startswith("\r")
    assert lines[1].count("\r") == 4  # bar after step 0, redraws at steps 1 and 2, then step 3's eval line
    assert "step 2/3  [" + "#" * 16 + "-" * 8 + "]  67%  eta 10s  reward 0.625  eval 0.250  2.5k tok/s" in lines[1]
    assert "step 1/3  [" + "#" * 8 + "-" * 16 + "]  33%  eta 20s  reward 0.500  eval 0.250  1.2k tok/s" in lines[1]
    assert lines[1].rstrip().endswith("\rstep    3/3  reward 0.750  eval 0.500  eta 0s")
    assert lines[2] == "\rstep 3/3  [" + "#" * 24 + "] 100%  eta 0s  reward 0.750  eval 0.500  2.5k tok/s"
    assert lines[3] == ""  # the run ends on a fresh line


# ---- FLOPs ----


@pytest.mark.parametrize("tied, n_kv_heads", [(True, 2), (False, 4)])
def test_flops_per_token_hand_count(tied, n_kv_heads):
    args = ModelArgs(vocab_size=48, dim=32, n_layers=3, n_heads=4, n_kv_heads=n_kv_heads, head_dim=8, ffn_dim=96,
                     tie_embeddings=tied)
    with torch.device("meta"):
        model = Transformer(args, dtype=torch.float32)
    # matrices that multiply activations: every 2-D weight but the embedding table (a lookup); the
    # LM head multiplies by the table too when tied
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and name != "tok_embeddings.weight")
    if tied:
        matmul += model.tok_embeddings.weight.numel()
    T = 10
    # per layer and sequence, forward: q k^T and p v over the causal half of the T x T score
    # matrix, 2 FLOPs per multiply-add per head dimension and head; training = 3 x forward
    attention = 3 * args.n_layers * 2 * (2 * args.n_heads * args.head_dim * T * T / 2)
    assert flops_per_token(args, T) == pytest.approx(6 * matmul + attention / T, rel=1e-12)
    # the head on a quarter of the tokens: three quarters of its V x dim multiply-adds not done
    head = args.vocab_size * args.dim
    assert flops_per_token(args, T, head_share=0.25) == pytest.approx(6 * (matmul - 0.75 * head) + attention / T, rel=1e-12)


def test_peak_flops_table_and_override(monkeypatch):
    cuda = torch.device("cuda", 0)
    names = {"value": ""}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names["value"])
    expected = [
        ("NVIDIA H200", torch.bfloat16, 989.4e12, "H200 bf16"),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12, "H100 SXM bf16"),
        ("NVIDIA H100 PCIe", torch.float16, 756.5e12, "H100 PCIe fp16"),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12, "A100 bf16"),
        ("NVIDIA H200", torch.float32, 66.9e12, "H200 fp32"),
    ]
    for name, dtype, peak, label in expected:
        names["value"] = name
        value, text = peak_flops(cuda, dtype)
        assert value == pytest.approx(peak) and text.startswith(label), (name, text)
    names["value"] = "NVIDIA H200"
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert peak_flops(cuda, torch.float32)[0] == pytest.approx(494.7e12)  # tf32 tensor cores
    finally:
        torch.set_float32_matmul_precision(precision)
    names["value"] = "NVIDIA GeForce GTX 1080"
    assert peak_flops(cuda, torch.bfloat16) is None
    assert peak_flops(torch.device("cpu"), torch.float32) is None
    assert peak_flops(torch.device("cpu"), torch.float32, override_tflops=123.0) == (123e12, "metrics.peak_tflops = 123")


def test_mfu():
    args = ModelArgs()
    per_token = flops_per_token(args, 16.0)
    # 1000 tokens in 2 s on 2 devices of 1 TFLOP/s each
    assert mfu(1000, 2.0, args, 16.0, 1e12, 2) == pytest.approx(1000 * per_token / 2.0 / 2e12)


def test_batch_mfu_counts_the_head_on_its_tokens_and_attention_at_the_weighted_length():
    args = ModelArgs(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=16)
    blocks = 2 * (8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16)  # q, k, v, o and SwiGLU weights of 2 layers
    head = 100 * 8
    # sequences of 4 and 12 tokens: each token sees its own sequence, so the token-weighted mean
    # length is (4 * 4 + 12 * 12) / 16 = 10; the head runs on 8 of the 16 tokens
    per_token = 6 * (blocks + head * 8 / 16) + 6 * 2 * 2 * 4 * 10
    got = batch_mfu(torch.tensor([4, 12]), 16.0, 8.0, 0.5, args, 1e6)
    assert got == pytest.approx(16 * per_token / 0.5 / 1e6, rel=1e-12)
