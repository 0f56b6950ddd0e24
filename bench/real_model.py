"""A real pretrained model end to end: configs/smollm2_sums.toml (SmolLM2-135M-Instruct on
reasoning-gym sums) through tandem, and optionally the same model, prompts and batch shape through
TRL's `GRPOTrainer` in the same run, one JSON line each.

    python3 bench/real_model.py [--model models/SmolLM2-135M-Instruct] [--steps 25] [--engines native,vllm]
                                [--trl] [--trl-vllm] [--lora-ranks 0,32 [--lora-lr 1e-4]]
    python3 bench/real_model.py --cpu      # the CPU variant, configs/smollm2_sums_cpu.toml

tandem: `train_grpo.py --config configs/smollm2_sums.toml` on one GPU (colocated); reported: held-out
greedy accuracy at step 0 and after the last step, the median seconds per step (steps 2 on), and
`logprob_diff/{mean,max}` over the run. TRL (when `trl` is installed; a peer, not a dependency):
the same training prompts in the same order, 64 prompts x 8 completions per optimizer step
(per-device batch 64, 8 accumulation steps), up to 64 new tokens, temperature 1, lr 1e-5, no KL,
the same `reasoning_gym` reward; held-out greedy accuracy before and after from HF `generate` on the
same 256 held-out prompts. Where the two still differ: TRL's default linear LR decay against
tandem's warmup + cosine, and TRL's default loss normalisation against tandem's `dapo`.
`--trl-vllm` runs TRL as its users run it on one GPU: `use_vllm=True, vllm_mode="colocate"`.
`--lora-ranks 0,32` runs each engine once per rank: 0 is full fine-tuning, R > 0 trains LoRA
adapters of rank R on every projection (alpha = R, a scale of 1) at --lora-lr (LoRA's learning
rate is commonly about 10x full fine-tuning's).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


PEAKS = ("memory/generate_peak_gb", "memory/train_peak_gb")


def config_path(opts) -> Path:
    return REPO / "configs" / ("smollm2_sums_cpu.toml" if opts.cpu else "smollm2_sums.toml")


def tandem(opts, engine: str = "native", lora_rank: int = 0) -> dict:
    config = config_path(opts)
    out = opts.workdir / (f"tandem_{engine}" + (f"_lora{lora_rank}" if lora_rank else ""))
    nproc = 2 if opts.cpu else 1
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / "train_grpo.py"), "--config", str(config), f"--model.path={opts.model}",
               f"--training.steps={opts.steps}", f"--job.output_dir={out}", "--checkpoint.resume=none",
               "--metrics.progress_bar=false", f"--generation.engine={engine}"]
    if lora_rank:
        command += [f"--lora.rank={lora_rank}", f"--lora.alpha={lora_rank}", f"--optimizer.lr={opts.lora_lr}"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, stdout=sys.stderr)
    if result.returncode != 0:
        raise SystemExit(f"train_grpo.py exited with {result.returncode}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "time/step_s" in r]
    return dict(
        impl="tandem", engine=engine, lora_rank=lora_rank, config=config.name, steps=opts.steps,
        wall_s=round(time.perf_counter() - start, 1),
        accuracy_before=evals[0]["eval/accuracy"], accuracy_after=evals[-1]["eval/accuracy"],
        accuracy_curve=[(r["step"], r["eval/accuracy"]) for r in evals],
        reward_curve=[(r["step"], round(r["reward/mean"], 4)) for r in steps],
        step_s_median=round(statistics.median(r["time/step_s"] for r in steps[1:] or steps), 3),
        logprob_diff_mean=float(f"{statistics.mean(r['logprob_diff/mean'] for r in steps):.3g}"),
        logprob_diff_max=float(f"{max(r['logprob_diff/max'] for r in steps):.3g}"),
        trainable_params=rows[0].get("model/trainable_params"),
        **{f"{key.split('/')[1]}_max": max(r[key] for r in steps) for key in PEAKS if all(key in r for r in steps)},
        weight_sync_bytes=steps[-1].get("weight_sync/bytes"),
        weight_sync_s_median=float(f"{statistics.median(r['time/weight_sync_s'] for r in steps):.3g}"),
    )


def held_out_accuracy(model, tokenizer, prompts: list, meta: dict, cfg) -> float:
    """The HF model's greedy accuracy on the held-out prompts, 64 at a time, by the run's reward."""
    import torch

    import rewards

    model.eval()
    correct = 0
    for start in range(0, len(prompts), 64):
        chunk = prompts[start : start + 64]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                               tokenize=False) for p in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=cfg.generation.max_new_tokens, do_sample=False)
        for p, ids in zip(chunk, out[:, batch["input_ids"].shape[1]:]):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            correct += rewards.reasoning_gym("", text, "", meta[p.index]) >= cfg.eval.correct_reward
    model.train()
    return correct / len(prompts)


def trl_peer(opts, use_vllm: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rewards
    from grpo.config import load_config
    from grpo.data.sources import GymSource

    cfg = load_config(["--config", str(config_path(opts)), f"--model.path={opts.model}", f"--training.steps={opts.steps}"],
                      world_size=1)
    task = GymSource(cfg, AutoTokenizer.from_pretrained(str(opts.model)))
    per_step = cfg.data.prompts_per_step
    train = [p for step in range(1, opts.steps + 1) for p in task.train_prompts(step, per_step)]
    meta = {p.index: p.metadata for p in train + task.eval_prompts}

    def reward(completions, index, **_):
        return [rewards.reasoning_gym("", c[0]["content"], "", meta[i]) for c, i in zip(completions, index)]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p.text}], "index": p.index} for p in train])
    tokenizer = AutoTokenizer.from_pretrained(str(opts.model), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(opts.model), dtype=torch.float32)
    G = cfg.grpo.group_size
    args = GRPOConfig(
        output_dir=str(opts.workdir / "trl"), per_device_train_batch_size=per_step, gradient_accumulation_steps=G,
        num_generations=G, max_completion_length=cfg.generation.max_new_tokens, temperature=1.0,
        learning_rate=cfg.optimizer.lr, beta=0.0, max_steps=opts.steps, logging_steps=1, report_to=[],
        bf16=torch.cuda.is_available(), shuffle_dataset=False, save_strategy="no", seed=0,
        # how TRL's users run it on one GPU: vLLM generating in the training process
        **(dict(use_vllm=True, vllm_mode="colocate") if use_vllm else {}),
    )

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.last = [], None

        def on_step_begin(self, *a, **k):
            self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.last)

    timer = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])

    accuracy = functools.partial(held_out_accuracy, trainer.model, tokenizer, task.eval_prompts, meta, cfg)
    before = accuracy()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    curve = [(h["step"], round(h["reward"], 4)) for h in trainer.state.log_history if "reward" in h]
    versions = dict(trl_version=__import__("trl").__version__)
    if use_vllm:
        versions["vllm_version"] = __import__("vllm").__version__
    return dict(impl="trl_vllm" if use_vllm else "trl", **versions, steps=opts.steps, wall_s=round(wall, 1),
                accuracy_before=before, accuracy_after=accuracy(), reward_curve=curve,
                step_s_median=round(statistics.median(timer.times[1:] or timer.times), 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench_real_model")
    parser.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (needs trl installed)")
    parser.add_argument("--trl-vllm", action="store_true",
                        help="also run TRL's GRPOTrainer with use_vllm=True, vllm_mode='colocate' (needs trl and vllm)")
    parser.add_argument("--engines", default="native", help="tandem's generation engines to run, comma-separated")
    parser.add_argument("--cpu", action="store_true", help="the CPU variant (configs/smollm2_sums_cpu.toml)")
    parser.add_argument("--lora-ranks", default="0",
                        help="LoRA ranks to run each engine with, comma-separated (0 = full fine-tuning)")
    parser.add_argument("--lora-lr", type=float, default=1e-4, help="the learning rate of the LoRA runs")
    opts = parser.parse_args()
    if not (opts.model / "config.json").is_file():
        raise SystemExit(f"{opts.model} is not a model folder; build it with: python scripts/get_smollm2.py")
    rows = []
    for engine in opts.engines.split(","):
        for lora_rank in (int(r) for r in opts.lora_ranks.split(",")):
            rows.append(tandem(opts, engine, lora_rank))
            print(json.dumps(rows[-1]), flush=True)
    for wanted, use_vllm in ((opts.trl, False), (opts.trl_vllm, True)):
        if not wanted:
            continue
        peer = trl_peer(opts, use_vllm)
        print(json.dumps(peer), flush=True)
        ratios = {f"tandem_{r['engine']}{'_lora' + str(r['lora_rank']) if r['lora_rank'] else ''}_step_over_{peer['impl']}":
                  round(r["step_s_median"] / peer["step_s_median"], 3) for r in rows}
        print(json.dumps(dict(bench="real_model_ratio", **ratios)), flush=True)


if __name__ == "__main__":
    main()
