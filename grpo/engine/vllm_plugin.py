"""vLLM plugin (entry point `vllm.general_plugins` in pyproject.toml): registers the tandem model
wrapper in every process vLLM starts, including its engine-core and worker processes, which do
not see registrations made in the process that created the engine."""

from __future__ import annotations


def register() -> None:
    from vllm import ModelRegistry

    from grpo.engine.vllm_engine import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "grpo.engine.vllm_model:TandemForCausalLM")
