"""Run configuration: dataclasses, TOML file + CLI overrides, validation.

The dataclass defaults are the single source of truth; config.toml in the repo root
mirrors them with a comment per key. `load_config` reads a TOML file, applies
`--section.key=value` overrides and validates everything, the rank layout included,
so a bad setting fails on every rank with the same one-line message before any
collective is issued.
"""

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo.gym import check_gym_config, is_gym_path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# Beside train_grpo.py, so runs behave the same from any working directory.
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.toml"


class ConfigError(ValueError):
    """A bad setting; the message is a single line meant for the user."""


@dataclass
class JobConfig:
    # where metrics.jsonl, the resolved config.toml and exports go
    output_dir: str = "runs/demo"
    # seeds data order, model init and sampling
    seed: int = 0
    # "auto" (cuda if available else cpu) | "cpu" | "cuda"
    device: str = "auto"
    # bitwise-reproducible kernels (torch.use_deterministic_algorithms)
    deterministic: bool = False


@dataclass
class ModelConfig:
    # HF checkpoint folder to train from (with data.path); "" builds the tiny model below from scratch
    path: str = ""
    # compute dtype: "auto" (bfloat16 on cuda, float32 on cpu) | "bfloat16" | "float32"; master weights are always float32
    dtype: str = "auto"
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
    # CUDA only: torch.compile each layer's norms, projections, RoPE and SwiGLU for training (a slower first step, then faster ones; CPU runs eagerly)
    compile: bool = True


@dataclass
class DataConfig:
    # built-in task on random digit strings: "copy_digits" (answer = the digits) | "reverse_digits" (their reversal)
    task: str = "copy_digits"
    # prompts in one RL step (each sampled grpo.group_size times)
    prompts_per_step: int = 32
    # shortest digit string of the built-in task
    digits_min: int = 4
    # longest digit string of the built-in task
    digits_max: int = 4
    # JSONL / Parquet file or folder of prompts, or "reasoning_gym:NAME" for a reasoning-gym dataset (needs model.path for the tokenizer); "" = the built-in task
    path: str = ""
    # with data.path = "reasoning_gym:NAME": that dataset's config keys, e.g. {min_digits = 1, max_digits = 2}
    reasoning_gym: dict = field(default_factory=dict)
    # record field holding the prompt text
    prompt_field: str = "question"
    # record field holding the reference answer (passed to the reward functions)
    answer_field: str = "answer"
    # system message put before each prompt ("" = none)
    system_prompt: str = ""
    # prompt layout with a {prompt} placeholder (and {system}); "" = the tokenizer's chat template
    prompt_template: str = ""
    # chat templates with a thinking switch (Qwen3): "default" leaves it alone, "on" / "off" set it
    enable_thinking: str = "default"
    # longest prompt in tokens after rendering
    max_prompt_tokens: int = 512
    # what to do with longer prompts: "skip" (count them) | "error"
    too_long: str = "skip"


@dataclass
class GenerationConfig:
    # completion length cap; longer completions are cut with finish reason "length"
    max_new_tokens: int = 4
    # sampling temperature; 0 = greedy
    temperature: float = 1.0
    # nucleus sampling mass; 1.0 = off
    top_p: float = 1.0
    # sample among the k most likely tokens; 0 = off
    top_k: int = 0
    # stop strings, in addition to EOS
    stop: list[str] = field(default_factory=list)
    # most sequences decoded at once; a finished sequence's KV slot goes to the next waiting request
    max_batch_size: int = 512
    # KV slot capacity in tokens (prompt + completion); 0 = the longest prompt the data allows + max_new_tokens
    max_seq_len: int = 0
    # KV cache size per generator in GB; 0 = room for max_batch_size sequences (on CUDA at most kv_cache_fraction of free memory)
    kv_cache_gb: float = 0.0
    # with kv_cache_gb = 0 on CUDA: the largest share of the free device memory the KV cache may take
    kv_cache_fraction: float = 0.4
    # prefill each prompt once for all of its samples (they start from the same prompt K/V)
    share_prefix: bool = True
    # CUDA only: replay decode steps from CUDA graphs captured per batch-size bucket (CPU runs eagerly)
    cuda_graphs: bool = True
    # CUDA only: torch.compile each layer's norms, RoPE and SwiGLU and the sampler (CPU runs eagerly)
    compile: bool = True
    # decode steps between the host's checks for finished sequences (EOS and budget are detected on the device)
    sync_every: int = 8


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
    loss_type: str = "dapo"
    # dual clip for negative advantages: the per-token loss is capped at -clip_ratio_c * A (0 = off; > 1 when on)
    clip_ratio_c: float = 0.0
    # gspo only: the sequence ratio is clipped below at 1 - gspo_clip_eps_low
    gspo_clip_eps_low: float = 3e-4
    # gspo only: the sequence ratio is clipped above at 1 + gspo_clip_eps_high
    gspo_clip_eps_high: float = 4e-4
    # weight of the KL penalty to the frozen reference policy (the initial weights); 0 = no reference model
    kl_coef: float = 0.0
    # KL estimator per token: "k1" | "k2" | "k3"
    kl_estimator: str = "k3"
    # advantage baseline: "mean" (group mean) | "leave_one_out" (RLOO: mean of the other G - 1)
    baseline: str = "mean"
    # advantage scale: "group" (group std) | "batch" (std over the whole batch) | "none"
    scale_rewards: str = "group"
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
    # truncated importance sampling on pi_old / pi_gen: weights capped at tis_cap (0 = off)
    tis_cap: float = 0.0
    # TIS weight per "token" or per "sequence" (product of its tokens' ratios)
    tis_level: str = "token"
    # "truncate" caps the weight; "mask" drops tokens (or sequences) whose weight exceeds the cap
    tis_mode: str = "truncate"


@dataclass
class RewardsConfig:
    # built-in names or "module:function"
    functions: list[str] = field(default_factory=lambda: ["digit_match"])
    # one per function
    weights: list[float] = field(default_factory=lambda: [1.0])
    # per call; a reward call past this stops the run with an error naming the function
    timeout_s: float = 10.0
    # reward process pool size
    num_workers: int = 1
    # a reward call that raises, hangs or returns a non-number: "stop" the run | "zero" (score 0, warn, go on)
    on_error: str = "stop"
    # the regex format_reward checks the whole completion against ("" = <think>...</think> <answer>...</answer>)
    format_pattern: str = ""


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
    # tokens (prompt + completion) per forward/backward on each trainer rank, episodes packed back to back; at least the longest episode (data.max_prompt_tokens + generation.max_new_tokens)
    micro_batch_tokens: int = 16384
    # consecutive steps with a skipped update (non-finite loss or gradient norm) before the run stops, saving its state
    max_bad_steps: int = 3


@dataclass
class ParallelismConfig:
    # "split" (generator ranks + trainer ranks) | "colocated" (every rank generates, then trains)
    mode: str = "split"
    # split mode: number of generator ranks; the rest train
    generator_ranks: int = 1
    # split mode: size of one weight-sync bucket (MiB); no rank holds more than one beyond its own shard
    weight_bucket_mb: int = 256
    # seconds any collective or transfer may wait for other ranks before the job stops, naming whom it waited on
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
    # write the policy as an HF folder (safetensors + config.json) to <job.output_dir>/hf/step_N every N steps; 0 = only at the end
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
    wandb_mode: str = ""
    # write a few prompts with their completions, rewards and advantages to samples.jsonl every N steps; 0 = never
    samples_every: int = 10
    # prompts (whole groups) per samples record
    samples_prompts: int = 2
    # peak accelerator TFLOP/s per rank for MFU; 0 = the built-in table for the device (no MFU where it has no entry)
    peak_tflops: float = 0.0


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


# section name -> section dataclass, in file order
_SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
# section name -> {key: type}
_TYPES: dict[str, dict[str, Any]] = {
    name: {f.name: f.type for f in dataclasses.fields(cls)} for name, cls in _SECTIONS.items()
}
_ALL_KEYS = [f"{section}.{key}" for section, keys in _TYPES.items() for key in keys]

_CHOICES = {
    "job.device": ("auto", "cpu", "cuda"),
    "model.dtype": ("auto", "bfloat16", "float32"),
    "data.task": ("copy_digits", "reverse_digits"),
    "data.enable_thinking": ("default", "on", "off"),
    "data.too_long": ("skip", "error"),
    "rewards.on_error": ("stop", "zero"),
    "parallelism.mode": ("split", "colocated"),
    "grpo.loss_type": ("grpo", "dapo", "dr_grpo", "bnpo", "gspo"),
    "grpo.kl_estimator": ("k1", "k2", "k3"),
    "grpo.baseline": ("mean", "leave_one_out"),
    "grpo.scale_rewards": ("group", "batch", "none"),
    "grpo.tis_level": ("token", "sequence"),
    "grpo.tis_mode": ("truncate", "mask"),
    "metrics.wandb_mode": ("", "online", "offline"),
}


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Read `--config FILE` (default: config.toml in the repo root), apply `--section.key=value`
    or `--section.key value` overrides, and validate for `world_size` ranks (default: $WORLD_SIZE)."""
    if argv is None:
        argv = sys.argv[1:]
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config_path, overrides = _parse_argv(argv)
    raw = _read_toml(config_path)
    for section, key, text in overrides:
        raw.setdefault(section, {})[key] = _parse_cli_value(text, _TYPES[section][key])
    cfg = Config(**{section: _build_section(section, raw.get(section, {})) for section in _SECTIONS})
    validate_config(cfg, world_size)
    return cfg


def _parse_argv(argv: list[str]) -> tuple[Path, list[tuple[str, str, str]]]:
    config_path = DEFAULT_CONFIG_PATH
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key=value")
        name, eq, text = arg[2:].partition("=")
        section, dot, key = name.partition(".")
        if name != "config":
            if not dot or not section or not key:
                match = difflib.get_close_matches(name, _ALL_KEYS, n=1)
                hint = f" (did you mean '--{match[0]}'?)" if match else ""
                raise ConfigError(f"'--{name}' is not a config key; overrides look like --section.key=value{hint}")
            _check_key(section, key)
        if not eq:
            # a following "--..." is the next option, not this one's value
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"missing value for '{arg}'; write {arg}=VALUE or {arg} VALUE")
            text = argv[i + 1]
            i += 1
        i += 1
        if name == "config":
            config_path = Path(text)
        else:
            overrides.append((section, key, text))
    return config_path, overrides


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot parse config file {path}: {e}") from None
    for section, table in raw.items():
        if not isinstance(table, dict):
            if section in _SECTIONS:
                raise ConfigError(f"config section '{section}' in {path} must be a table ([{section}])")
            raise ConfigError(f"unknown config key '{section}'{_did_you_mean(section, _ALL_KEYS)}")
        for key in table:
            _check_key(section, key)
    return raw


def _check_key(section: str, key: str) -> None:
    if section not in _SECTIONS:
        raise ConfigError(f"unknown config section '{section}'{_did_you_mean(section, list(_SECTIONS))}")
    if key not in _TYPES[section]:
        full = f"{section}.{key}"
        hint = _did_you_mean(full, _ALL_KEYS) or f" ([{section}] has: {', '.join(_TYPES[section])})"
        raise ConfigError(f"unknown config key '{full}'{hint}")


def _did_you_mean(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _parse_cli_value(text: str, typ: Any) -> Any:
    # TOML syntax gives lists, bools and numbers; anything TOML rejects is a bare string
    # (--job.output_dir=runs/x, --parallelism.mode=split).
    try:
        doc = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    # A string key keeps its text verbatim even when it happens to read as TOML (a path named 2024, "inf").
    if set(doc) != {"v"} or (typ is str and not isinstance(doc["v"], str)):
        return text
    return doc["v"]


def _build_section(section: str, values: dict[str, Any]) -> Any:
    types = _TYPES[section]
    return _SECTIONS[section](**{key: _coerce(f"{section}.{key}", v, types[key]) for key, v in values.items()})


def _coerce(key: str, value: Any, typ: Any) -> Any:
    if typing.get_origin(typ) is list:
        (elem,) = typing.get_args(typ)
        if isinstance(value, list):
            bad = [v for v in value if not _is_a(v, elem)]
            if not bad:
                return [float(v) if elem is float else v for v in value]
            raise ConfigError(
                f"config key '{key}' expects {typ}, got a list holding {type(bad[0]).__name__} ({bad[0]!r})"
            )
    elif _is_a(value, typ):
        return float(value) if typ is float else value
    type_name = typ if typing.get_origin(typ) else typ.__name__
    raise ConfigError(f"config key '{key}' expects {type_name}, got {type(value).__name__} ({value!r})")


def _is_a(value: Any, typ: type) -> bool:
    # bool is an int subclass, but `steps = true` is a mistake, not 1
    if isinstance(value, bool):
        return typ is bool
    if typ is float:
        return isinstance(value, (int, float))
    return isinstance(value, typ)


def validate_config(cfg: Config, world_size: int) -> None:
    """Raise ConfigError naming the first impossible setting, including rank-layout ones."""
    for key, allowed in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            choices = ", ".join(map(_toml_value, allowed))
            raise ConfigError(f"config key '{key}' must be one of {choices}; got {_toml_value(value)}")

    m = cfg.model
    if bool(m.path) != bool(cfg.data.path):
        raise ConfigError(
            "model.path and data.path go together: an HF checkpoint brings the tokenizer a prompt file "
            "needs, and the built-in tasks use the built-in tokenizer "
            f"(model.path = {m.path!r}, data.path = {cfg.data.path!r})"
        )
    if m.path and not Path(m.path).exists():
        raise ConfigError(f"model.path = {m.path!r} does not exist")
    if m.path and not (Path(m.path) / "config.json").is_file():
        raise ConfigError(f"model.path = {m.path!r} has no config.json (expected an HF checkpoint folder)")
    if is_gym_path(cfg.data.path):
        try:
            check_gym_config(cfg.data.path, cfg.data.reasoning_gym)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    elif cfg.data.reasoning_gym:
        raise ConfigError("data.reasoning_gym is set but data.path does not name a reasoning-gym dataset ('reasoning_gym:NAME')")
    elif cfg.data.path and not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path = {cfg.data.path!r} does not exist")
    if cfg.data.path and cfg.grpo.dynamic_sampling:
        raise ConfigError(
            "grpo.dynamic_sampling with data.path is not supported yet (extra rounds could redraw a "
            "prompt of the same step); use it with the built-in tasks"
        )
    _require(cfg.data.max_prompt_tokens >= 1, "data.max_prompt_tokens", cfg.data.max_prompt_tokens, "must be >= 1")
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        _require(getattr(m, name) >= 1, f"model.{name}", getattr(m, name), "must be >= 1")
    kv_why = f"must be a multiple of model.n_kv_heads = {m.n_kv_heads}"
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_heads", m.n_heads, kv_why)
    _require(m.dim % m.n_heads == 0, "model.dim", m.dim, f"must be a multiple of model.n_heads = {m.n_heads}")
    if m.dim // m.n_heads % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even (RoPE rotates pairs)")

    d = cfg.data
    _require(d.prompts_per_step >= 1, "data.prompts_per_step", d.prompts_per_step, "must be >= 1")
    _require(d.digits_min >= 1, "data.digits_min", d.digits_min, "must be >= 1")
    digits_why = f"must not exceed data.digits_max = {d.digits_max}"
    _require(d.digits_min <= d.digits_max, "data.digits_min", d.digits_min, digits_why)

    g = cfg.generation
    _require(g.max_new_tokens >= 1, "generation.max_new_tokens", g.max_new_tokens, "must be >= 1")
    _require(
        bool(d.path) or g.max_new_tokens >= d.digits_max,
        "generation.max_new_tokens",
        g.max_new_tokens,
        f"cannot hold the longest answer of the built-in task (data.digits_max = {d.digits_max})",
    )
    _require(g.temperature >= 0, "generation.temperature", g.temperature, "must be >= 0 (0 = greedy)")
    _require(0 < g.top_p <= 1, "generation.top_p", g.top_p, "must be in (0, 1] (1 = off)")
    _require(g.top_k >= 0, "generation.top_k", g.top_k, "must be >= 0 (0 = off)")
    _require("" not in g.stop, "generation.stop", g.stop, "must not contain an empty string (it matches at once)")
    _require(g.max_batch_size >= 1, "generation.max_batch_size", g.max_batch_size, "must be >= 1")
    _require(
        g.max_seq_len == 0 or g.max_seq_len > g.max_new_tokens,
        "generation.max_seq_len",
        g.max_seq_len,
        f"must be 0 (derived) or hold a prompt plus generation.max_new_tokens = {g.max_new_tokens}",
    )
    _require(g.kv_cache_gb >= 0, "generation.kv_cache_gb", g.kv_cache_gb, "must be >= 0 (0 = sized from max_batch_size)")
    _require(0 < g.kv_cache_fraction <= 1, "generation.kv_cache_fraction", g.kv_cache_fraction, "must be in (0, 1]")
    _require(g.sync_every >= 1, "generation.sync_every", g.sync_every, "must be >= 1")

    p = cfg.grpo
    _require(
        p.group_size >= 2,
        "grpo.group_size",
        p.group_size,
        "must be >= 2 (advantages compare the samples of one prompt with each other)",
    )
    _require(p.clip_eps_low >= 0, "grpo.clip_eps_low", p.clip_eps_low, "must be >= 0")
    _require(p.clip_eps_high >= 0, "grpo.clip_eps_high", p.clip_eps_high, "must be >= 0")
    _require(p.num_iterations >= 1, "grpo.num_iterations", p.num_iterations, "must be >= 1")
    _require(p.minibatches >= 1, "grpo.minibatches", p.minibatches, "must be >= 1")
    _require(
        p.clip_ratio_c == 0 or p.clip_ratio_c > 1, "grpo.clip_ratio_c", p.clip_ratio_c, "must be 0 (off) or > 1"
    )
    _require(p.gspo_clip_eps_low >= 0, "grpo.gspo_clip_eps_low", p.gspo_clip_eps_low, "must be >= 0")
    _require(p.gspo_clip_eps_high >= 0, "grpo.gspo_clip_eps_high", p.gspo_clip_eps_high, "must be >= 0")
    _require(p.kl_coef >= 0, "grpo.kl_coef", p.kl_coef, "must be >= 0")
    _require(p.tis_cap == 0 or p.tis_cap >= 1, "grpo.tis_cap", p.tis_cap, "must be 0 (off) or >= 1")
    _require(p.overlong_buffer >= 0, "grpo.overlong_buffer", p.overlong_buffer, "must be >= 0 (0 = off)")
    _require(
        p.overlong_buffer <= g.max_new_tokens,
        "grpo.overlong_buffer",
        p.overlong_buffer,
        f"must not exceed generation.max_new_tokens = {g.max_new_tokens}",
    )
    _require(p.overlong_penalty >= 0, "grpo.overlong_penalty", p.overlong_penalty, "must be >= 0")
    _require(
        not p.dynamic_sampling or p.filter_zero_variance,
        "grpo.dynamic_sampling",
        p.dynamic_sampling,
        "needs grpo.filter_zero_variance = true (it replaces the groups that filter drops)",
    )
    _require(
        p.dynamic_sampling_max_rounds >= 1,
        "grpo.dynamic_sampling_max_rounds",
        p.dynamic_sampling_max_rounds,
        "must be >= 1",
    )

    r = cfg.rewards
    _require(len(r.functions) >= 1, "rewards.functions", r.functions, "must name at least one reward function")
    _require(
        len(r.weights) == len(r.functions),
        "rewards.weights",
        r.weights,
        f"has {len(r.weights)} values but rewards.functions has {len(r.functions)}; give one weight per function",
    )
    _require(r.timeout_s > 0, "rewards.timeout_s", r.timeout_s, "must be > 0")
    _require(r.num_workers >= 0, "rewards.num_workers", r.num_workers, "must be >= 0")

    o = cfg.optimizer
    _require(o.lr > 0, "optimizer.lr", o.lr, "must be > 0")
    betas_ok = len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas)
    _require(betas_ok, "optimizer.betas", o.betas, "must be two values in [0, 1)")
    _require(o.eps >= 0, "optimizer.eps", o.eps, "must be >= 0")
    _require(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0")
    _require(o.warmup_steps >= 0, "optimizer.warmup_steps", o.warmup_steps, "must be >= 0")
    _require(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    _require(o.max_grad_norm >= 0, "optimizer.max_grad_norm", o.max_grad_norm, "must be >= 0 (0 = off)")

    t = cfg.training
    _require(t.steps >= 1, "training.steps", t.steps, "must be >= 1")
    longest = cfg.data.max_prompt_tokens + cfg.generation.max_new_tokens
    _require(
        t.micro_batch_tokens >= longest,
        "training.micro_batch_tokens",
        t.micro_batch_tokens,
        f"must hold the longest episode: data.max_prompt_tokens + generation.max_new_tokens = {longest}",
    )

    e = cfg.eval
    _require(e.every >= 0, "eval.every", e.every, "must be >= 0 (0 = only at step 0 and the end)")
    _require(p.entropy_coef >= 0, "grpo.entropy_coef", p.entropy_coef, "must be >= 0")
    _require(e.num_prompts >= 1, "eval.num_prompts", e.num_prompts, "must be >= 1")
    _require(e.samples >= 1, "eval.samples", e.samples, "must be >= 1 (1 = greedy)")
    c = cfg.checkpoint
    _require(c.export_hf_every >= 0, "checkpoint.export_hf_every", c.export_hf_every, "must be >= 0 (0 = export only at the end)")
    _require(c.every >= 0, "checkpoint.every", c.every, "must be >= 0 (0 = only at the end)")
    _require(c.keep >= 0, "checkpoint.keep", c.keep, "must be >= 0 (0 = keep all)")
    _require(
        c.resume in ("auto", "none") or Path(c.resume).is_dir(),
        "checkpoint.resume",
        c.resume,
        'must be "auto", "none" or an existing checkpoint folder',
    )
    _require(t.max_bad_steps >= 1, "training.max_bad_steps", t.max_bad_steps, "must be >= 1")
    mt = cfg.metrics
    _require(mt.samples_every >= 0, "metrics.samples_every", mt.samples_every, "must be >= 0 (0 = never)")
    _require(mt.samples_prompts >= 1, "metrics.samples_prompts", mt.samples_prompts, "must be >= 1")
    _require(mt.peak_tflops >= 0, "metrics.peak_tflops", mt.peak_tflops, "must be >= 0 (0 = built-in table)")

    prompts = d.prompts_per_step
    par = cfg.parallelism
    _require(par.weight_bucket_mb >= 1, "parallelism.weight_bucket_mb", par.weight_bucket_mb, "must be >= 1")
    _require(par.collective_timeout_s > 0, "parallelism.collective_timeout_s", par.collective_timeout_s, "must be > 0")
    if par.mode == "colocated":
        _require_multiple(
            prompts, world_size, f"world size {world_size}", "colocated mode: every rank generates an equal share"
        )
    else:
        if world_size < 2:
            raise ConfigError(
                'parallelism.mode = "split" needs at least 2 ranks '
                "(launch with torchrun --nproc_per_node=2 or more, or set --parallelism.mode=colocated)"
            )
        if par.generator_ranks < 1:
            raise ConfigError(
                f"parallelism.generator_ranks = {par.generator_ranks} leaves no generator rank; "
                f"set it between 1 and {world_size - 1}"
            )
        if par.generator_ranks >= world_size:
            raise ConfigError(
                f"parallelism.generator_ranks = {par.generator_ranks} leaves no trainer rank with world size "
                f"{world_size}; set it between 1 and {world_size - 1}"
            )
        _require_multiple(
            prompts,
            par.generator_ranks,
            f"parallelism.generator_ranks = {par.generator_ranks}",
            "split mode: every generator rank generates an equal share",
        )
    _require(
        prompts % p.minibatches == 0,
        "data.prompts_per_step",
        prompts,
        f"is not divisible by grpo.minibatches = {p.minibatches} (a minibatch holds whole groups); "
        f"set --grpo.minibatches to a divisor of {prompts}",
    )


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {_toml_value(value)} {why}")


def _require_multiple(prompts: int, divisor: int, divisor_desc: str, why: str) -> None:
    lower = prompts // divisor * divisor
    examples = " or ".join(str(n) for n in (lower, lower + divisor) if n > 0)
    _require(
        prompts % divisor == 0,
        "data.prompts_per_step",
        prompts,
        f"is not divisible by {divisor_desc} ({why}); "
        f"set --data.prompts_per_step to a multiple of {divisor}, e.g. {examples}",
    )


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML that `load_config(["--config", file])` reads back to an equal Config."""
    lines = [
        "# Resolved config of this run: defaults, then the config file, then command-line overrides.",
        "# Rerun with: torchrun ... train_grpo.py --config <this file>",
    ]
    for section in dataclasses.fields(cfg):
        lines += ["", f"[{section.name}]"]
        values = getattr(cfg, section.name)
        lines += [f"{f.name} = {_toml_value(getattr(values, f.name))}" for f in dataclasses.fields(values)]
    return "\n".join(lines) + "\n"


def write_resolved_config(cfg: Config, path: str | Path) -> None:
    """Write `config_to_toml(cfg)` to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_toml(cfg), encoding="utf-8")


# TOML basic-string escapes; other control characters (and DEL) become \uXXXX
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        # float repr round-trips exactly, and its inf/nan spellings are TOML's
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_char(c: str) -> str:
    if c in _TOML_ESCAPES:
        return _TOML_ESCAPES[c]
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return f"\\u{ord(c):04x}"
    return c
