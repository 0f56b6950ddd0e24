"""The native generation engine: batched prefill + decode with a KV cache, on the native model.

Sampling is a Gumbel-max draw whose noise is a hash of (seed, step, prompt index, sample index,
position, token id): a completion depends only on its key and the weights, never on which other
requests share its batch. Log-probs are log softmax(logits / temperature) over the full vocabulary
(top-k / top-p only restrict which tokens may be drawn).

Out of memory: a batch that runs out of device memory is retried in halves (the engine keeps the
smaller batch size), which changes no completion since sampling does not depend on batching; only
a single request that does not fit stops generation, with `GenerationOutOfMemory`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from model import KVCache, ModelArgs, Transformer

_M32 = 0xFFFFFFFF

# (parameter name, index into it as a tuple of slices, values): one piece of a weight update.
WeightUpdate = tuple[str, tuple[slice, ...], torch.Tensor]


class GenerationOutOfMemory(RuntimeError):
    """A single request does not fit in the generator's memory (its prompt plus max_new_tokens)."""


@dataclass
class SamplingParams:
    """How to sample: temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class GenerationRequest:
    """One completion to produce. (step, prompt_index, sample_index) keys its randomness."""

    prompt_tokens: list[int]
    step: int
    prompt_index: int
    sample_index: int


@dataclass
class Completion:
    """A finished request: tokens and per-token log-probs of the completion only.

    finish_reason: "eos" (an EOS id was drawn; it is kept as the last token), "stop" (the decoded
    text reached a stop string) or "length" (max_new_tokens reached).
    """

    request: GenerationRequest
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int64 tensors holding values < 2**32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def _combine(h: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    return _mix32((h ^ (torch.as_tensor(value) & _M32)) + 0x9E3779B9 & _M32)


class NativeEngine:
    """Generates completions with its own copy of the model, in its own dtype and buffers.

    Interface: `submit(requests)` queues, `poll()` runs everything queued and returns the finished
    completions, `generate(requests)` does both; `update_weights(buckets, version)` copies new weights
    into the existing parameters; `pause()` / `resume()` hold and release the queue; `close()`.
    """

    def __init__(
        self,
        args: ModelArgs,
        sampling: SamplingParams,
        eos_ids: Sequence[int],
        seed: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pad_id: int = 0,
        stop_strings: Sequence[str] = (),
        decode_text: Callable[[list[int]], str] | None = None,
        max_batch_size: int = 256,
    ):
        if stop_strings and decode_text is None:
            raise ValueError("stop strings need a decode_text function to read the completion text")
        self.args, self.sampling = args, sampling
        self.eos_ids = torch.tensor(list(eos_ids), device=device)
        self.seed, self.dtype, self.device, self.pad_id = seed, dtype, torch.device(device), pad_id
        self.stop_strings, self.decode_text = list(stop_strings), decode_text
        self.max_batch_size = max_batch_size
        with torch.device("meta"):
            self.model = Transformer(args, dtype=dtype)
        self.model.to_empty(device=self.device)
        self.model.eval().requires_grad_(False)
        self._params = dict(self.model.named_parameters())
        self._vocab_hash = _mix32(torch.arange(args.vocab_size, device=self.device, dtype=torch.int64))
        self.version = -1
        self.paused = False
        self._queue: list[tuple[GenerationRequest, SamplingParams]] = []

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Iterable[WeightUpdate]], version: int) -> None:
        """Copy (name, index, tensor) updates, bucket by bucket, into the engine's own parameters:
        `param[index] = tensor`, where index is a tuple of slices (empty for the whole parameter)."""
        for bucket in buckets:
            for name, index, tensor in bucket:
                if name not in self._params:
                    raise KeyError(f"engine model has no parameter {name!r}")
                target = self._params[name][index]
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"weight update for {name!r}{list(index) if index else ''} has shape "
                        f"{list(tensor.shape)}, the engine holds {list(target.shape)}"
                    )
                target.copy_(tensor)
        self.version = version

    def submit(self, requests: Iterable[GenerationRequest], sampling: SamplingParams | None = None) -> None:
        """Queue requests, sampled with `sampling` (default: the engine's)."""
        self._queue.extend((r, sampling or self.sampling) for r in requests)

    def pause(self) -> None:
        """Hold queued requests: poll() returns nothing until resume() (e.g. while weights change)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def poll(self) -> list[Completion]:
        """Run every queued request to completion, in order, batching runs of equal sampling params."""
        if self.paused:
            return []
        queued, self._queue = self._queue, []
        finished: list[Completion] = []
        start = 0
        while start < len(queued):
            sampling = queued[start][1]
            end = start
            while end < len(queued) and end - start < self.max_batch_size and queued[end][1] == sampling:
                end += 1
            batch = [r for r, _ in queued[start:end]]
            try:
                completions = self._generate_batch(batch, sampling)
            except torch.OutOfMemoryError as exc:
                if len(batch) == 1:
                    prompt = len(batch[0].prompt_tokens)
                    raise GenerationOutOfMemory(
                        f"generator: out of memory on a single request (prompt of {prompt} tokens, "
                        f"max_new_tokens {sampling.max_new_tokens}); lower generation.max_new_tokens or "
                        f"data.max_prompt_tokens, or give the generator more memory"
                    ) from exc
                completions = None
            if completions is None:
                # Past the handler, the traceback no longer holds the failed batch's tensors: they are freed.
                self._shrink_batches(len(batch))
                continue
            finished.extend(completions)
            start = end
        return finished

    def _shrink_batches(self, failed: int) -> None:
        """After a batch of `failed` requests ran out of memory: release cached memory and halve
        the batch size for this and later polls."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        # Half the failed batch, not of max_batch_size: a short last batch may be far below the maximum.
        self.max_batch_size = failed // 2
        print(
            f"generator: out of memory with a batch of {failed} requests; retrying with batches of {self.max_batch_size}",
            file=sys.stderr,
            flush=True,
        )

    def generate(self, requests: Iterable[GenerationRequest], sampling: SamplingParams | None = None) -> list[Completion]:
        self.submit(requests, sampling)
        return self.poll()

    def close(self) -> None:
        self._queue = []

    def _noise_keys(self, requests: list[GenerationRequest]) -> torch.Tensor:
        keys = torch.full((len(requests),), self.seed & _M32, dtype=torch.int64)
        for field in ("step", "prompt_index", "sample_index"):
            keys = _combine(keys, torch.tensor([getattr(r, field) for r in requests], dtype=torch.int64))
        return keys.to(self.device)

    def _sample(self, logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, sp: SamplingParams):
        """Next token and its log-prob for logits [B, V] (fp32); keys, positions [B] int64."""
        if sp.temperature == 0:
            return logits.argmax(-1), torch.log_softmax(logits, dim=-1).max(-1).values
        scaled = logits / sp.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        allowed = scaled
        if sp.top_k > 0:
            kth = torch.topk(scaled, min(sp.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            allowed = allowed.masked_fill(scaled < kth, float("-inf"))
        if sp.top_p < 1.0:
            probs, order = torch.softmax(allowed, dim=-1).sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p: drop tokens whose preceding mass already does.
            drop_sorted = probs.cumsum(-1) - probs >= sp.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            allowed = allowed.masked_fill(drop, float("-inf"))
        row_hash = _combine(keys, positions)[:, None]
        bits = _mix32(row_hash ^ self._vocab_hash[None, :]) >> 8
        uniform = (bits.float() + 0.5) / 2**24
        tokens = (allowed - torch.log(-torch.log(uniform))).argmax(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    @torch.no_grad()
    def _generate_batch(self, requests: list[GenerationRequest], sp: SamplingParams) -> list[Completion]:
        device = self.device
        B = len(requests)
        prompt_lens = torch.tensor([len(r.prompt_tokens) for r in requests], device=device)
        width = int(prompt_lens.max())
        prompts = torch.full((B, width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(requests):
            prompts[i, : len(r.prompt_tokens)] = torch.tensor(r.prompt_tokens)
        prompts = prompts.to(device)
        cache = KVCache.allocate(self.args, B, width + sp.max_new_tokens, self.dtype, device)
        positions = torch.arange(width, device=device).expand(B, width)
        logits = self.model.decode(prompts, positions, cache, logits_index=prompt_lens - 1).float()
        keys = self._noise_keys(requests)

        out_tokens = torch.full((B, sp.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((B, sp.max_new_tokens), dtype=torch.float32, device=device)
        lengths = torch.zeros(B, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        reasons = ["length"] * B
        for t in range(sp.max_new_tokens):
            tokens, logprobs = self._sample(logits, keys, prompt_lens + t, sp)
            active = ~done
            out_tokens[active, t] = tokens[active]
            out_logprobs[active, t] = logprobs[active]
            lengths += active.long()
            hit_eos = active & torch.isin(tokens, self.eos_ids)
            done |= hit_eos
            for i in hit_eos.nonzero().flatten().tolist():
                reasons[i] = "eos"
            if self.stop_strings:
                for i in (active & ~hit_eos).nonzero().flatten().tolist():
                    text = self.decode_text(out_tokens[i, : t + 1].tolist())
                    if any(stop in text for stop in self.stop_strings):
                        done[i] = True
                        reasons[i] = "stop"
            if bool(done.all()) or t == sp.max_new_tokens - 1:
                break
            logits = self.model.decode(tokens[:, None], (prompt_lens + t)[:, None], cache)[:, 0].float()

        out_tokens, out_logprobs, lengths = out_tokens.cpu(), out_logprobs.cpu(), lengths.tolist()
        return [
            Completion(
                request=r,
                tokens=out_tokens[i, : lengths[i]].tolist(),
                logprobs=out_logprobs[i, : lengths[i]].tolist(),
                finish_reason=reasons[i],
                version=self.version,
            )
            for i, r in enumerate(requests)
        ]
