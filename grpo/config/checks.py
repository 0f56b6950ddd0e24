"""Config validation: every impossible setting, the rank layout included, found before any
process group exists and reported as one ConfigError line naming the key."""

from __future__ import annotations

import importlib.util
import math
import re
import string
from pathlib import Path

from grpo.config.io import _did_you_mean, _toml_value
from grpo.config.keys import CHOICES, TYPES
from grpo.config.launch_checks import check_bitwise, check_parallelism, check_train_attention, check_vllm
from grpo.config.lora_checks import check_lora
from grpo.config.require import require
from grpo.config.sections import AUTO_TIS_CAP, Config, ConfigError
from grpo.data.gym import check_gym_config, is_gym_path
from grpo.envs import BUILTIN_ENVIRONMENTS


def validate_config(cfg: Config, world_size: int) -> None:
    """Raise ConfigError naming the first impossible setting, including rank-layout ones."""
    _check_choices(cfg)
    _check_finite(cfg)
    _check_job(cfg)
    _check_paths(cfg)
    _check_model(cfg)
    _check_data(cfg)
    _check_generation(cfg)
    _check_grpo(cfg)
    _check_rewards(cfg)
    _check_env(cfg)
    _check_optimizer(cfg)
    _check_training(cfg)
    _check_eval(cfg)
    _check_checkpoint(cfg)
    _check_metrics(cfg)
    check_lora(cfg)
    check_bitwise(cfg)  # before vLLM's: with vLLM it is a contradiction, whether or not vLLM is installed
    check_vllm(cfg)
    check_train_attention(cfg)
    check_parallelism(cfg, world_size)


def _check_choices(cfg: Config) -> None:
    """Settings that take one of a few words (their Literal types)."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            choices = ", ".join(map(_toml_value, allowed))
            raise ConfigError(f"config key '{key}' must be one of {choices}; got {_toml_value(value)}")


def _check_finite(cfg: Config) -> None:
    """Every float setting: inf passes checks such as "> 0" and nan fails them with the wrong reason,
    and either one turns the run's weights, rewards or timeouts into nonsense."""
    for section, keys in TYPES.items():
        for name, typ in keys.items():
            value = getattr(getattr(cfg, section), name)
            if typ is float:
                require(math.isfinite(value), f"{section}.{name}", value, "must be a finite number")
            elif typ == list[float]:
                require(all(map(math.isfinite, value)), f"{section}.{name}", value, "must hold finite numbers only")


def _check_paths(cfg: Config) -> None:
    """model.path and data.path: present together, existing, of the right kind; the checkpoint's config.json readable."""
    m = cfg.model
    if bool(m.path) != bool(cfg.data.path):
        raise ConfigError(
            "model.path and data.path go together: an HF checkpoint brings the tokenizer a prompt file "
            "needs, and the built-in tasks use the built-in tokenizer "
            f"(model.path = {m.path!r}, data.path = {cfg.data.path!r})"
        )
    if m.path and not Path(m.path).exists():
        raise ConfigError(f"model.path = {m.path!r} does not exist")
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
    if m.path:
        _check_checkpoint_folder(m.path)


def _check_checkpoint_folder(path: str) -> None:
    """The checkpoint folder: a config.json the native model can read, and safetensors weights."""
    # Imported here: torch loads only for a run that names a checkpoint.
    from model.args import HFConfigError, ModelArgs, UnsupportedModelError
    from model.hf import WEIGHTS_FILE, WEIGHTS_INDEX

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.path = {path!r} has no config.json (expected an HF checkpoint folder)")
    if not any((Path(path) / name).is_file() for name in (WEIGHTS_FILE, WEIGHTS_INDEX)):
        raise ConfigError(
            f"model.path = {path!r} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX} (tandem reads the weights from safetensors)"
        )
    try:
        ModelArgs.from_hf_dir(path)
    except HFConfigError as error:
        raise ConfigError(str(error)) from None
    except UnsupportedModelError as error:
        raise ConfigError(f"model.path = {path!r}: {error}") from None


def _check_model(cfg: Config) -> None:
    """The built-in shape: positive sizes, heads that split the width into even RoPE pairs."""
    m = cfg.model
    require(cfg.data.max_prompt_tokens >= 1, "data.max_prompt_tokens", cfg.data.max_prompt_tokens, "must be >= 1")
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        require(getattr(m, name) >= 1, f"model.{name}", getattr(m, name), "must be >= 1")
    kv_why = f"must be a multiple of model.n_kv_heads = {m.n_kv_heads}"
    require(m.n_heads % m.n_kv_heads == 0, "model.n_heads", m.n_heads, kv_why)
    require(m.dim % m.n_heads == 0, "model.dim", m.dim, f"must be a multiple of model.n_heads = {m.n_heads}")
    if m.dim // m.n_heads % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even (RoPE rotates pairs)")


def _check_data(cfg: Config) -> None:
    """[data]: batch size and the built-in task's digit range."""
    d = cfg.data
    require(d.prompts_per_step >= 1, "data.prompts_per_step", d.prompts_per_step, "must be >= 1")
    require(d.digits_min >= 1, "data.digits_min", d.digits_min, "must be >= 1")
    digits_why = f"must not exceed data.digits_max = {d.digits_max}"
    require(d.digits_min <= d.digits_max, "data.digits_min", d.digits_min, digits_why)
    require(not d.response_prefix or bool(d.path), "data.response_prefix", d.response_prefix,
            "needs data.path: the built-in task's prompts are not rendered from text")
    problem = _template_problem(d.prompt_template) if d.prompt_template else ""
    require(not problem, "data.prompt_template", d.prompt_template, problem)


# The placeholders render_prompt (grpo/data/files.py) fills in a data.prompt_template.
_TEMPLATE_FIELDS = ("prompt", "system")


def _template_problem(template: str) -> str:
    """Why render_prompt could not fill `template` with one record's text, or "" when it can."""
    braces = "write a literal brace as {{ or }}"
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        return f"is not a format string ({error}); {braces}"
    unknown = [name for name in fields if name not in _TEMPLATE_FIELDS]
    if unknown:
        return f"has the placeholder {{{unknown[0]}}}; only {{prompt}} and {{system}} are filled in ({braces})"
    if "prompt" not in fields:
        return "has no {prompt} placeholder: every prompt would render as the same text"
    try:
        template.format(prompt="", system="")
    except (ValueError, KeyError, IndexError) as error:  # a bad conversion or format spec, e.g. {prompt:d}
        return f"cannot be filled in ({error}); {braces}"
    return ""


def _check_generation(cfg: Config) -> None:
    """[generation]: sampling, lengths and the KV cache budget."""
    d = cfg.data
    g = cfg.generation
    require(g.max_new_tokens >= 1, "generation.max_new_tokens", g.max_new_tokens, "must be >= 1")
    require(
        bool(d.path) or g.max_new_tokens >= d.digits_max,
        "generation.max_new_tokens",
        g.max_new_tokens,
        f"cannot hold the longest answer of the built-in task (data.digits_max = {d.digits_max})",
    )
    require(g.temperature > 0, "generation.temperature", g.temperature,
            "must be > 0: greedy decoding gives every sample of a group the same completion, so every advantage is 0 "
            "and nothing is learned (held-out eval with eval.samples = 1 is greedy already)")
    require(0 < g.top_p <= 1, "generation.top_p", g.top_p, "must be in (0, 1] (1 = off)")
    require(g.top_k >= 0, "generation.top_k", g.top_k, "must be >= 0 (0 = off)")
    require("" not in g.stop, "generation.stop", g.stop, "must not contain an empty string (it matches at once)")
    require(g.max_batch_size >= 1, "generation.max_batch_size", g.max_batch_size, "must be >= 1")
    require(
        g.max_seq_len == 0 or g.max_seq_len > g.max_new_tokens,
        "generation.max_seq_len",
        g.max_seq_len,
        f"must be 0 (derived) or hold a prompt plus generation.max_new_tokens = {g.max_new_tokens}",
    )
    require(g.kv_cache_gb >= 0, "generation.kv_cache_gb", g.kv_cache_gb, "must be >= 0 (0 = sized from max_batch_size)")
    require(0 < g.kv_cache_fraction <= 1, "generation.kv_cache_fraction", g.kv_cache_fraction, "must be in (0, 1]")
    require(g.sync_every >= 1, "generation.sync_every", g.sync_every, "must be >= 1")


def _check_grpo(cfg: Config) -> None:
    """[grpo]: group size, clipping, penalties and filtering."""
    p, g = cfg.grpo, cfg.generation
    require(
        p.group_size >= 2,
        "grpo.group_size",
        p.group_size,
        "must be >= 2 (advantages compare the samples of one prompt with each other)",
    )
    require(p.clip_eps_low >= 0, "grpo.clip_eps_low", p.clip_eps_low, "must be >= 0")
    require(p.clip_eps_high >= 0, "grpo.clip_eps_high", p.clip_eps_high, "must be >= 0")
    require(p.num_iterations >= 1, "grpo.num_iterations", p.num_iterations, "must be >= 1")
    require(p.minibatches >= 1, "grpo.minibatches", p.minibatches, "must be >= 1")
    require(
        p.clip_ratio_c == 0 or p.clip_ratio_c > 1, "grpo.clip_ratio_c", p.clip_ratio_c, "must be 0 (off) or > 1"
    )
    require(p.gspo_clip_eps_low >= 0, "grpo.gspo_clip_eps_low", p.gspo_clip_eps_low, "must be >= 0")
    require(p.gspo_clip_eps_high >= 0, "grpo.gspo_clip_eps_high", p.gspo_clip_eps_high, "must be >= 0")
    require(p.kl_coef >= 0, "grpo.kl_coef", p.kl_coef, "must be >= 0")
    require(p.tis_cap in (0, AUTO_TIS_CAP) or p.tis_cap >= 1, "grpo.tis_cap", p.tis_cap, "must be 0 (off), -1 (auto) or >= 1")
    require(p.overlong_buffer >= 0, "grpo.overlong_buffer", p.overlong_buffer, "must be >= 0 (0 = off)")
    require(
        p.overlong_buffer <= g.max_new_tokens,
        "grpo.overlong_buffer",
        p.overlong_buffer,
        f"must not exceed generation.max_new_tokens = {g.max_new_tokens}",
    )
    require(p.overlong_penalty >= 0, "grpo.overlong_penalty", p.overlong_penalty, "must be >= 0")
    require(
        not p.dynamic_sampling or p.filter_zero_variance,
        "grpo.dynamic_sampling",
        p.dynamic_sampling,
        "needs grpo.filter_zero_variance = true (it replaces the groups that filter drops)",
    )
    require(
        p.dynamic_sampling_max_rounds >= 1,
        "grpo.dynamic_sampling_max_rounds",
        p.dynamic_sampling_max_rounds,
        "must be >= 1",
    )

    require(p.entropy_coef >= 0, "grpo.entropy_coef", p.entropy_coef, "must be >= 0")


def _check_rewards(cfg: Config) -> None:
    """[rewards]: at least one function, one weight each, a timeout, the packages the built-ins import."""
    r = cfg.rewards
    require(len(r.functions) >= 1, "rewards.functions", r.functions, "must name at least one reward function")
    require(
        len(r.weights) == len(r.functions),
        "rewards.weights",
        r.weights,
        f"has {len(r.weights)} values but rewards.functions has {len(r.functions)}; give one weight per function",
    )
    require(r.timeout_s > 0, "rewards.timeout_s", r.timeout_s, "must be > 0")
    require(r.num_workers >= -1, "rewards.num_workers", r.num_workers, "must be >= 0, or -1 (sized from the host's cores)")
    # Compiled as format_reward compiles it: a bad pattern is found now, not on the first scored episode.
    try:
        re.compile(r.format_pattern, re.DOTALL)
    except re.error as error:
        raise ConfigError(f"rewards.format_pattern = {_toml_value(r.format_pattern)} is not a valid regex: {error}") from None
    # math_accuracy imports math_verify on its first call, in a worker: found missing here, before any work.
    if "math_accuracy" in r.functions and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("rewards.functions names math_accuracy, which needs the math-verify package "
                          "(a dependency of tandem): pip install math-verify")


def _check_env(cfg: Config) -> None:
    """[env]: a built-in or "module:factory" name, budgets, and what multi-turn episodes cannot do yet."""
    e = cfg.env
    uses_env_reward = "env_reward" in cfg.rewards.functions
    if not e.name:
        require(not uses_env_reward, "rewards.functions", cfg.rewards.functions,
                "names env_reward, which reads the reward an environment gives: set env.name")
        return
    if e.name not in BUILTIN_ENVIRONMENTS and ":" not in e.name:
        builtins = ", ".join(repr(name) for name in BUILTIN_ENVIRONMENTS)
        hint = _did_you_mean(e.name, list(BUILTIN_ENVIRONMENTS)) or f" (built-ins: {builtins}, or \"module:factory\")"
        raise ConfigError(f"env.name = {_toml_value(e.name)} is not a built-in environment{hint}")
    require(e.name not in ("calculator", "verifiers", "skyrl_gym") or bool(cfg.model.path), "env.name", e.name,
            "needs model.path: tool calls and environment messages are written in a checkpoint's chat template")
    require(e.max_tokens >= 1, "env.max_tokens", e.max_tokens, "must be >= 1")
    require(e.max_turns >= 0, "env.max_turns", e.max_turns, "must be >= 0 (0 = the environment's own)")
    require(e.timeout_s > 0, "env.timeout_s", e.timeout_s, "must be > 0")
    require(e.workers >= 1, "env.workers", e.workers, "must be >= 1")
    require(e.keep_kv or cfg.generation.engine != "vllm", "env.keep_kv", e.keep_kv,
            "must be true with generation.engine = \"vllm\": vLLM's prefix cache keeps a conversation's K/V "
            "between turns whatever this says")
    require(cfg.grpo.overlong_buffer == 0, "grpo.overlong_buffer", cfg.grpo.overlong_buffer,
            "must be 0 with env.name: the overlong penalty counts one completion's tokens against "
            "generation.max_new_tokens, and a multi-turn episode holds several turns and the environment's")


def _check_optimizer(cfg: Config) -> None:
    """[optimizer]: AdamW's constants and the learning-rate schedule."""
    o = cfg.optimizer
    require(0 < o.lr < 1, "optimizer.lr", o.lr,
            "must be in (0, 1): AdamW moves every weight by about lr a step, so a step of 1 or more overwrites the model")
    betas_ok = len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas)
    require(betas_ok, "optimizer.betas", o.betas, "must be two values in [0, 1)")
    require(o.eps >= 0, "optimizer.eps", o.eps, "must be >= 0")
    require(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0")
    require(o.warmup_steps >= 0, "optimizer.warmup_steps", o.warmup_steps, "must be >= 0")
    require(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    require(o.max_grad_norm >= 0, "optimizer.max_grad_norm", o.max_grad_norm, "must be >= 0 (0 = off)")


def _check_training(cfg: Config) -> None:
    """[training]: length, micro-batch budget, and what the async schedule cannot do."""
    t, p = cfg.training, cfg.grpo
    require(t.steps >= 1, "training.steps", t.steps, "must be >= 1")
    longest = cfg.data.max_prompt_tokens + cfg.max_episode_tokens
    after_prompt = "env.max_tokens" if cfg.env.name else "generation.max_new_tokens"
    require(
        t.micro_batch_tokens >= longest,
        "training.micro_batch_tokens",
        t.micro_batch_tokens,
        f"must hold the longest episode: data.max_prompt_tokens + {after_prompt} = {longest}",
    )
    require(
        t.frozen_pass_tokens == 0 or t.frozen_pass_tokens >= t.micro_batch_tokens,
        "training.frozen_pass_tokens",
        t.frozen_pass_tokens,
        f"must be 0 (4 micro-batches) or hold one micro-batch: >= training.micro_batch_tokens = {t.micro_batch_tokens}",
    )

    require(t.max_bad_steps >= 1, "training.max_bad_steps", t.max_bad_steps, "must be >= 1")
    require(t.max_staleness >= 1, "training.max_staleness", t.max_staleness, "must be >= 1")
    if t.schedule == "async":
        if cfg.parallelism.mode == "colocated" and cfg.generation.engine != "native":
            raise ConfigError(
                f'training.schedule = "async" on colocated ranks needs generation.engine = "native": the '
                f"{cfg.generation.engine} engine cannot decode in a background thread while the rank trains "
                "(set --parallelism.mode=split, or --training.schedule=sync)"
            )
        if p.dynamic_sampling:
            raise ConfigError(
                'grpo.dynamic_sampling with training.schedule = "async" is not supported: each extra round '
                "waits for the scores of the one before, which serialises the two roles"
            )


def _check_eval(cfg: Config) -> None:
    """[eval]: how often and on how many held-out prompts."""
    e = cfg.eval
    require(e.every >= 0, "eval.every", e.every, "must be >= 0 (0 = only at step 0 and the end)")
    require(e.num_prompts >= 1, "eval.num_prompts", e.num_prompts, "must be >= 1")
    require(e.samples >= 1, "eval.samples", e.samples, "must be >= 1 (1 = greedy)")


def _check_checkpoint(cfg: Config) -> None:
    """[checkpoint]: periods, retention and what to resume from."""
    c = cfg.checkpoint
    require(c.export_hf_every >= 0, "checkpoint.export_hf_every", c.export_hf_every, "must be >= 0 (0 = export only at the end)")
    require(c.every >= 0, "checkpoint.every", c.every, "must be >= 0 (0 = only at the end)")
    require(c.keep >= 0, "checkpoint.keep", c.keep, "must be >= 0 (0 = keep all)")
    require(
        c.resume in ("auto", "none") or Path(c.resume).is_dir(),
        "checkpoint.resume",
        c.resume,
        'must be "auto", "none" or an existing checkpoint folder',
    )


def _check_metrics(cfg: Config) -> None:
    """[metrics]: samples, the MFU peak and the profiled step."""
    mt = cfg.metrics
    require(mt.samples_every >= 0, "metrics.samples_every", mt.samples_every, "must be >= 0 (0 = never)")
    require(mt.samples_prompts >= 1, "metrics.samples_prompts", mt.samples_prompts, "must be >= 1")
    require(mt.peak_tflops >= 0, "metrics.peak_tflops", mt.peak_tflops, "must be >= 0 (0 = built-in table)")
    require(
        0 <= mt.profile_step <= cfg.training.steps, "metrics.profile_step", mt.profile_step,
        f"must be a step of this run, 1..training.steps = {cfg.training.steps} (0 = never)",
    )
    require(
        mt.profile_step == 0 or cfg.training.schedule == "sync", "metrics.profile_step", mt.profile_step,
        'needs training.schedule = "sync": the async schedule overlaps phases of different steps',
    )
    for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(mt, flag) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"metrics.{flag} = true needs the {package} package: pip install {package}")


def _check_job(cfg: Config) -> None:
    """[job]: an output folder, and a device that is there."""
    # "" would put the run's lock, metrics and checkpoints in whatever folder the job starts from.
    require(bool(cfg.job.output_dir.strip()), "job.output_dir", cfg.job.output_dir,
            "must name a folder (metrics, checkpoints and exports go there)")
    if cfg.job.device == "cuda":
        # Imported only for this key: reading a config loads no torch otherwise.
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                'job.device = "cuda" but this machine has no CUDA device (or this torch build has no CUDA); '
                'use job.device = "cpu" or "auto"'
            )
