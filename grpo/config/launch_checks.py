"""Config checks that depend on the launch: the rank layout for the world size, the devices, the
model's shape, and what the chosen engine and numerics can serve on them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.config.require import require, require_multiple
from grpo.config.sections import Config, ConfigError

if TYPE_CHECKING:
    from model.args import ModelArgs


def check_parallelism(cfg: Config, world_size: int) -> None:
    """[parallelism]: the rank layout for world_size ranks, and batches that split evenly over it."""
    prompts, p = cfg.data.prompts_per_step, cfg.grpo
    par = cfg.parallelism
    require(par.weight_bucket_mb >= 1, "parallelism.weight_bucket_mb", par.weight_bucket_mb, "must be >= 1")
    require(par.collective_timeout_s > 0, "parallelism.collective_timeout_s", par.collective_timeout_s, "must be > 0")
    if par.mode == "colocated":
        if par.generator_tp != 1:
            raise ConfigError(
                f"parallelism.generator_tp = {par.generator_tp} needs split roles (parallelism.mode = \"split\"): "
                "colocated ranks each run a whole engine"
            )
        require_multiple(
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
        _check_generator_tp(cfg)
        engines = par.generator_ranks // par.generator_tp
        require_multiple(
            prompts,
            engines,
            f"parallelism.generator_ranks = {par.generator_ranks}"
            + (f" / generator_tp = {par.generator_tp} = {engines} engines" if par.generator_tp > 1 else ""),
            "split mode: every engine generates an equal share",
        )
    require(
        prompts % p.minibatches == 0,
        "data.prompts_per_step",
        prompts,
        f"is not divisible by grpo.minibatches = {p.minibatches} (a minibatch holds whole groups); "
        f"set --grpo.minibatches to a divisor of {prompts}",
    )


def check_vllm(cfg: Config) -> None:
    """The vLLM engine: installed (and usable), a head size it serves, one rank per engine."""
    g = cfg.generation
    if g.engine != "vllm":
        return
    # Imported here, not at the top: reading a config must not load torch (scripts, SLURM front ends).
    from grpo.engine.vllm_engine import vllm_problem

    device = _device_type(cfg)
    problem = vllm_problem(model_shape(cfg).head_dim, device)
    if problem:
        raise ConfigError(f'generation.engine = "vllm" {problem}')
    if cfg.parallelism.generator_tp != 1:
        raise ConfigError('generation.engine = "vllm" runs one generator rank per engine (parallelism.generator_tp = 1)')


def check_bitwise(cfg: Config) -> None:
    """job.bitwise_logprobs: batch-invariant kernels serve the native engine, whole on one rank."""
    if not cfg.job.bitwise_logprobs:
        return
    if cfg.generation.engine != "native":
        raise ConfigError(
            'job.bitwise_logprobs = true needs generation.engine = "native": vLLM computes its log-probs '
            "with kernels of its own"
        )
    if cfg.parallelism.generator_tp != 1:
        raise ConfigError(
            "job.bitwise_logprobs = true needs parallelism.generator_tp = 1: a tensor-parallel engine sums "
            "partial products in another order than the trainer's whole matmuls"
        )
    if cfg.training.share_prompts == "on":
        raise ConfigError(
            'training.share_prompts = "on" does not apply with job.bitwise_logprobs = true: the batch-invariant '
            'attention kernel runs each episode whole; set training.share_prompts = "auto" or "off"'
        )


def check_train_attention(cfg: Config) -> None:
    """model.train_attention = "fa4": FlashAttention 4 installed and serving this GPU, in the mode
    and dtype that reach it."""
    if cfg.model.train_attention != "fa4":
        return
    if cfg.job.bitwise_logprobs:
        raise ConfigError(
            'model.train_attention = "fa4" does not apply with job.bitwise_logprobs = true: the trainer then '
            'runs its batch-invariant attention kernel; set model.train_attention = "flash"'
        )
    if cfg.model.dtype == "float32":
        raise ConfigError('model.train_attention = "fa4" needs bf16 compute (model.dtype = "auto" or "bfloat16")')
    if cfg.training.share_prompts == "on":
        raise ConfigError(
            'training.share_prompts = "on" needs model.train_attention = "flash": a shared prompt is attended '
            "through two of aten's flash calls merged by their log-sum-exps (model/shared_prefix.py)"
        )
    # Imported here: reading a config must not load torch.
    from model.fa4 import fa4_problem

    problem = fa4_problem(_device_type(cfg))
    if problem:
        raise ConfigError(f'model.train_attention = "fa4" {problem}')


def model_shape(cfg: Config) -> ModelArgs:
    """The head and width counts of the model the run will build: the checkpoint's, or the built-in
    shape's (whose heads split model.dim evenly)."""
    from model.args import ModelArgs

    m = cfg.model
    if m.path:
        return ModelArgs.from_hf_dir(m.path)
    return ModelArgs(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                     head_dim=m.dim // m.n_heads, ffn_dim=m.ffn_dim)


def model_parameter_names(args: ModelArgs) -> list[str]:
    """The parameter names of a model of shape `args` (a meta model: nothing is allocated)."""
    import torch

    from model.model import Transformer

    with torch.device("meta"):
        return [name for name, _ in Transformer(args).named_parameters()]


def _device_type(cfg: Config) -> str:
    """"cuda" or "cpu": job.device, with "auto" resolved as train_grpo.py resolves it."""
    if cfg.job.device != "auto":
        return cfg.job.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_generator_tp(cfg: Config) -> None:
    """A TP group must split the generator ranks into whole engines and the model into equal shards."""
    par = cfg.parallelism
    tp = par.generator_tp
    require(tp >= 1, "parallelism.generator_tp", tp, "must be >= 1")
    if par.generator_ranks % tp:
        raise ConfigError(
            f"parallelism.generator_tp = {tp} does not divide parallelism.generator_ranks = {par.generator_ranks} "
            "(each engine takes generator_tp consecutive generator ranks)"
        )
    if tp == 1:
        return
    from model.parallelize import tensor_parallel_problem

    problem = tensor_parallel_problem(model_shape(cfg), tp)
    if problem:
        raise ConfigError(f"parallelism.generator_tp = {tp} {problem} of the model")
