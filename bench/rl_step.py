"""The realistic colocated RL step: a Qwen3-0.6B body on GSM8K-format prompts, one GPU.

    python3 bench/rl_step.py [--steps N] [--skip K] [--body 0.6b|8b] [-- extra train_grpo.py overrides]
    python3 bench/rl_step.py --body 8b -- --lora.rank=32 --lora.alpha=32 --model.activation_checkpointing=true   # 8B, LoRA
    python3 bench/rl_step.py --tiny --steps 2 -- --data.prompts_per_step=4 --generation.max_new_tokens=8   # CPU smoke test
    python3 bench/rl_step.py -- --training.schedule=async   # generation of step n + 1 beside the training of step n

Builds (once, in --workdir) a random-weight bf16 HF checkpoint with the Qwen3-0.6B body (28 layers,
hidden 1024, 16 / 8 heads, head_dim 128, FFN 3072, tied embeddings) and the 600-token BPE tokenizer
of fixtures/hf.py, so the step is the real model's compute without the 152k-token vocab; `--body 8b`
is the Qwen3-8B body instead (36 layers, hidden 4096, 32 / 8 heads, FFN 12288, untied embeddings),
which one GPU trains only with LoRA.
Then runs `train_grpo.py` colocated on one rank: 64 prompts x 8 samples, 256 new tokens, math
rewards, lr 1e-6. Prints one JSON line per step (time split, throughput, engine vs trainer
log-prob gap) and a summary line with medians over the steps after the first --skip (and, with
`--training.schedule=async`, before the last max_staleness, which generate nothing ahead).
Extra overrides after `--` come last, so they win over the defaults here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.provenance import commit  # noqa: E402
from fixtures.hf import FIXTURE, SYSTEM, build_tokenizer  # noqa: E402

QWEN3_0_6B = {"layers": 28, "dim": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "ffn": 3072, "tied": 1}
QWEN3_8B = {"layers": 36, "dim": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "ffn": 12288, "tied": 0}
TINY = {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "tied": 1}
BODIES = {"0.6b": QWEN3_0_6B, "8b": QWEN3_8B}
PER_STEP = (
    "time/step_s", "time/generate_s", "time/score_s", "time/train_s", "time/weight_sync_s", "time/gc_s",
    "throughput/generate_tok_s", "throughput/train_tok_s", "throughput/mfu",
    "episode/length_mean", "episode/truncated_frac", "logprob_diff/mean", "logprob_diff/max",
    "memory/generate_peak_gb", "memory/train_peak_gb", "time/generation_wait_s",
)
# train/tokens_computed: present only where prompts are shared (training.share_prompts).
MEDIANS = PER_STEP[:9] + ("episode/length_mean", "episode/truncated_frac", "memory/generate_peak_gb", "memory/train_peak_gb",
                          "time/generation_wait_s", "train/loss_tokens", "train/tokens_computed")
# Step 0's row: the whole policy's first sync and the trainable share.
FIRST = ("weight_sync/full_s", "weight_sync/full_bytes", "model/trainable_params", "model/params")


def build_checkpoint(folder: Path, body: dict[str, int]) -> Path:
    """Random bf16 Qwen3 with the given body, sized to the fixture BPE; reused if already there.
    Initialised on the GPU when there is one (the 8B body takes minutes on the CPU)."""
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=body["dim"], intermediate_size=body["ffn"],
        num_hidden_layers=body["layers"], num_attention_heads=body["heads"], num_key_value_heads=body["kv_heads"],
        head_dim=body["head_dim"], tie_word_embeddings=bool(body["tied"]), rope_theta=1e6, max_position_embeddings=4096,
        dtype="bfloat16", eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(folder))
    # The run that follows is another process: hand the GPU memory back.
    del model
    torch.cuda.empty_cache()
    return folder


def build_prompts(path: Path, count: int) -> Path:
    """`count` distinct prompts: the fixture rows repeated, each copy's question numbered so that
    held-out and training prompts never collide."""
    rows = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
    with path.open("w", encoding="utf-8") as f:
        for k in range(count):
            row = rows[k % len(rows)]
            f.write(json.dumps({"question": f"Problem {k}: {row['question']}", "answer": row["answer"]}) + "\n")
    return path


# The workload's batch shape. The fixture's prompts render to 75-95 tokens, inside the 256-token cap;
# the engine's KV slots hold the longest of them plus the 256 new tokens.
WORKLOAD = {"data.prompts_per_step": "64", "grpo.group_size": "8", "generation.max_new_tokens": "256",
            "data.max_prompt_tokens": "256"}


# A run that is measured: no checkpoints, no resume, no samples or progress bar. Eval can only be
# made rare: it runs at step 0 and after the last step, outside time/step_s.
MEASURED_RUN = ["--eval.every=0", "--checkpoint.every=0", "--checkpoint.resume=none", "--metrics.samples_every=0",
                "--metrics.progress_bar=false"]


def workload_args(ckpt: Path, data: Path) -> list[str]:
    """train_grpo.py arguments of the workload on a built checkpoint and prompt file: WORKLOAD's
    batch shape, the fixture's system prompt, math rewards, lr 1e-6 (the benches that run it
    add the layout, the steps and the output folder)."""
    return [f"--{key}={value}" for key, value in WORKLOAD.items()] + [
        f"--model.path={ckpt}", f"--data.path={data}", f"--data.system_prompt={SYSTEM}", "--data.enable_thinking=off",
        '--rewards.functions=["math_accuracy"]', "--rewards.weights=[1.0]", "--optimizer.lr=1e-6",
    ]


def override(extra: list[str], key: str, default: int | str) -> int | str:
    """The value train_grpo.py will see for an int or str key: the last of `--key=v` / `--key v` in
    `extra`, of the default's type."""
    value = default
    for i, arg in enumerate(extra):
        if arg.startswith(f"--{key}="):
            value = type(default)(arg.split("=", 1)[1])
        elif arg == f"--{key}" and i + 1 < len(extra):
            value = type(default)(extra[i + 1])
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-rl-step"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=1, help="steps left out of the medians (warm-up)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts (evaluated outside the step)")
    parser.add_argument("--body", choices=sorted(BODIES), default="0.6b", help="the model body (random weights)")
    parser.add_argument("--tiny", action="store_true", help="2-layer, dim-64 body for a CPU smoke test")
    return parser.parse_args(argv)


def run_workload(opts: argparse.Namespace, extra: list[str], body: dict) -> Path:
    """train_grpo.py on the workload, one colocated rank, `extra` forwarded; returns its folder."""
    opts.workdir.mkdir(parents=True, exist_ok=True)
    # One folder per body, so a --tiny run never leaves a checkpoint the full run would reuse.
    ckpt = build_checkpoint(opts.workdir / f"qwen3-{body['layers']}L-{body['dim']}d", body)

    defaults = {"parallelism.mode": "colocated", "training.steps": str(opts.steps), "eval.num_prompts": str(opts.eval_prompts)}
    # Size the prompt file from what the run will actually use, forwarded overrides included.
    steps = override(extra, "training.steps", opts.steps)
    needed = steps * override(extra, "data.prompts_per_step", 64) + override(extra, "eval.num_prompts", opts.eval_prompts)
    data = build_prompts(opts.workdir / "prompts.jsonl", needed)

    # The run's folder, where its metrics are read back: a forwarded --job.output_dir moves it.
    run_dir = Path(override(extra, "job.output_dir", str(opts.workdir / "run")))
    # A leftover run would be resumed (checkpoint.resume = "auto") with nothing left to do: the
    # bench's own folder is cleared, a folder the caller named must be new.
    if run_dir == opts.workdir / "run":
        shutil.rmtree(run_dir, ignore_errors=True)
    elif run_dir.exists():
        raise SystemExit(f"--job.output_dir={run_dir} exists; name a new folder (its run would be resumed)")
    args = [f"--{key}={value}" for key, value in defaults.items()] + workload_args(ckpt, data) + [
        *MEASURED_RUN, f"--job.output_dir={run_dir}",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py"]
    # The run's own output goes to stderr so that stdout carries only the JSON lines.
    result = subprocess.run([*command, *args, *extra], cwd=REPO, stdout=sys.stderr)
    if result.returncode != 0:
        raise SystemExit(f"train_grpo.py exited with {result.returncode}")
    return run_dir


def summarise(run_dir: Path, opts: argparse.Namespace, extra: list[str], body: dict) -> dict:
    """Prints each step's line from the run's metrics; returns the medians' line."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "time/step_s" in r]
    first = next((r for r in rows if r["step"] == 0), {})
    if not step_rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no finished steps")
    for r in step_rows:
        print(json.dumps({"step": r["step"], **{k: r[k] for k in PER_STEP if k in r}}))
    # The async schedule's last max_staleness steps have nothing left to generate beside their
    # training: they are the run's drain, not its steady state, so the medians leave them out.
    drain = override(extra, "training.max_staleness", 1) if override(extra, "training.schedule", "sync") == "async" else 0
    timed = step_rows[opts.skip : len(step_rows) - drain] or step_rows
    return {
        "bench": "rl_step",
        "steps": len(step_rows),
        "median_over_steps": [r["step"] for r in timed],
        **{f"median_{k.split('/')[1]}": statistics.median(r[k] for r in timed) for k in MEDIANS if all(k in r for r in timed)},
        "weight_sync_bytes": step_rows[-1].get("weight_sync/bytes"),
        **{k.replace("/", "_"): first[k] for k in FIRST if k in first},
        "logprob_diff_max": max(r["logprob_diff/max"] for r in step_rows),
        "logprob_diff_mean": statistics.mean(r["logprob_diff/mean"] for r in step_rows),
        "body": body,
        "prompts_per_step": override(extra, "data.prompts_per_step", 64),
        "group_size": override(extra, "grpo.group_size", 8),
        "max_new_tokens": override(extra, "generation.max_new_tokens", 256),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": commit(),
        "extra_args": extra,
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    opts = parse(argv[: argv.index("--")] if "--" in argv else argv)
    body = dict(TINY if opts.tiny else BODIES[opts.body])
    body["layers"] = opts.layers or body["layers"]
    run_dir = run_workload(opts, extra, body)
    print(json.dumps(summarise(run_dir, opts, extra, body)))

if __name__ == "__main__":
    main()
