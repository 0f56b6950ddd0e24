"""LoRA end to end: train_grpo.py in real processes (CPU, gloo)."""

from __future__ import annotations

import math

from tests.test_checkpoint_recovery import small_disk
from tests.test_e2e import SHORT, launch, metrics

# The demo's model starts from random weights, and its tied embedding / output head is most of
# what it must learn: frozen at random, rank-8 adapters alone barely move the held-out reward in
# 25 steps, so the embedding trains too (lora.trainable). LoRA takes a higher learning rate.
LORA_DEMO = ["--training.steps=25", "--lora.rank=8", "--lora.alpha=16", '--lora.trainable=["tok_embeddings.weight"]',
             "--optimizer.lr=1e-2"]


def test_lora_demo_learns_and_split_equals_colocated(tmp_path):
    """Held-out reward rises with LoRA; the split run (adapter-only sync to the generator rank) draws
    exactly the colocated run's rewards, and each step's sync moves only what trains."""
    colocated = launch([*LORA_DEMO, "--parallelism.mode=colocated", f"--job.output_dir={tmp_path / 'colo'}"], nproc=None)
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    assert "trainable parameters: 23,296 of 124,032 (LoRA rank 8" in colocated.stdout
    rows = metrics(tmp_path / "colo")
    first, last = rows[0]["eval/reward_mean"], rows[-1]["eval/reward_mean"]
    assert first <= 0.15 and last >= first + 0.2, (first, last)

    split = launch([*LORA_DEMO, "--parallelism.mode=split", f"--job.output_dir={tmp_path / 'split'}"], nproc=2, timeout=400)
    assert split.returncode == 0, split.stderr[-3000:]
    split_rows = metrics(tmp_path / "split")
    assert [r.get("reward/mean") for r in split_rows] == [r.get("reward/mean") for r in rows]
    assert split_rows[-1]["eval/reward_mean"] == last
    # 2 layers x 7 adapted layers x (A + B) at rank 8, plus the 12 x 64 embedding, in fp32 (CPU's compute dtype)
    adapters = 2 * 8 * sum(i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 256), (64, 256), (256, 64)])
    assert split_rows[1]["weight_sync/bytes"] == (adapters + 12 * 64) * 4
    assert rows[0]["model/trainable_params"] == adapters + 12 * 64 == 23296


def test_lora_logprobs_are_bitwise_the_generators(tmp_path):
    """job.bitwise_logprobs with LoRA in bf16: the trainer's merged-weight forward recomputes the
    engine's log-probs exactly, after the engine merged the adapters of each update."""
    out = tmp_path / "run"
    run = launch([*SHORT, "--lora.rank=4", "--model.dtype=bfloat16", "--job.bitwise_logprobs=true",
                  "--parallelism.mode=colocated", f"--job.output_dir={out}"], nproc=None)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(out)[1:]
    assert len(rows) == 3
    for row in rows:
        assert row["logprob_diff/max"] == 0.0 and row["logprob_diff/exact_frac"] == 1.0
        assert math.isfinite(row["loss/policy"])


def test_a_lora_run_needs_disk_for_its_adapters_not_the_whole_model(tmp_path):
    """On a 1.2 MB disk a LoRA run saves its checkpoint (about 0.14 MB: the adapters and their AdamW
    moments) and its HF export (0.5 MB): the space a checkpoint needs is counted from what trains,
    not from the whole model's 1.5 MB of fp32 weights and moments. Step 0 logs the first sync:
    the whole policy, adapters included."""
    with small_disk(tmp_path / "small", "1200k") as disk:
        run = launch([*SHORT, "--lora.rank=4", "--parallelism.mode=colocated", f"--job.output_dir={disk / 'run'}"],
                     nproc=None)
        assert run.returncode == 0, run.stderr[-3000:]
        assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["step_3"]
        first = metrics(disk / "run")[0]
    adapters = 2 * 4 * sum(i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 256), (64, 256), (256, 64)])
    assert first["weight_sync/full_bytes"] == (124_032 + adapters) * 4
