"""FSDP2's mixed precision on one rank, without FSDP: fp32 master weights, a compute-dtype copy that
runs forward and backward, gradients accumulated in fp32.

On one rank FSDP2 shards nothing, yet its bookkeeping costs the host more than the device needs for
a step of a small model: a copy of every gradient into one reduce buffer (17 ms for 0.6B
parameters on an H200's host), DTensor dispatch in every optimizer operation (10 ms), hooks. The
arithmetic it does there is simple, and is done here the same way, so the numbers are bitwise
those of FSDP2 on one rank: the compute copy is each master cast to the compute dtype; each
micro-batch's gradient (compute dtype, summed by autograd) is cast to fp32 and added to the
master's gradient, the first one copied. Both the copy and its gradients live in one flat buffer
each, so a cast or an accumulation is one kernel, and they are freed between steps as FSDP2 frees
its unsharded parameters.

Frozen parameters (LoRA's base, model/lora.py) are already in the compute dtype: the compute copy
shares them rather than copying them, and only trainable ones have masters, copies and gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from model.model import Transformer
from model.parallelize import check_master_dtypes, checkpoint_block, compile_blocks

# Elements between parameter starts in the flat buffers: 256 bytes in fp32.
_ALIGN = 64


class OneRankMixedPrecision:
    """`master` (fp32 parameters, what the optimizer steps) and its compute copy.

    Per training step: `prepare()`, then forward with `__call__` and `.backward()` per micro-batch,
    each followed by `accumulate()`; the master gradients are then ready. After changing the
    masters call `invalidate()`; `zero_grad()` drops the master gradients, `release()` frees the
    copy (a later forward allocates and casts it again).
    """

    def __init__(
        self,
        master: Transformer,
        compute_dtype: torch.dtype,
        activation_checkpointing: bool = False,
        compile: bool = False,
        structure: Callable[[Transformer], None] | None = None,
    ):
        """structure: what was applied to `master` beyond the plain model (e.g. apply_lora), to
        apply to the compute copy as well so that both have the same parameter names."""
        # Frozen parameters are used as they are: they must be in the compute dtype already.
        check_master_dtypes(master, (compute_dtype,))
        self.master = master
        device = next(master.parameters()).device
        with torch.device("meta"):
            self.compute = Transformer(master.args, dtype=compute_dtype)
            if structure is not None:
                structure(self.compute)
        self.compute.keep_rope_on(device)
        for name, param in master.named_parameters():
            if not param.requires_grad:
                module_name, _, param_name = name.rpartition(".")
                setattr(self.compute.get_submodule(module_name), param_name, param)
        trainable = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
        self._masters = [p for _, p in trainable]
        names = [n for n, _ in trainable]
        # Each parameter starts on a 256-byte boundary, as a separate allocation would: compiled
        # kernels assume aligned inputs and copy the others.
        self._offsets, total = [], 0
        for param in self._masters:
            self._offsets.append(total)
            total += -(-param.numel() // _ALIGN) * _ALIGN
        self._weights = torch.empty(total, dtype=compute_dtype, device=device)
        self._copies = []
        for name, view in zip(names, self._views(self._weights, self._masters)):
            module_name, _, param_name = name.rpartition(".")
            param = nn.Parameter(view)
            setattr(self.compute.get_submodule(module_name), param_name, param)
            self._copies.append(param)
        self._storage_bytes = self._weights.untyped_storage().nbytes()
        self._grads: torch.Tensor | None = None
        self._master_grads: torch.Tensor | None = None
        self._fresh = False
        if compile:
            compile_blocks(self.compute)
        if activation_checkpointing:
            for block in self.compute.layers:
                checkpoint_block(block)
        self.release()

    def prepare(self) -> None:
        """Start a step: the gradient buffer allocated, the copy cast afresh at the next forward."""
        self._fresh = False
        if self._grads is None:
            self._grads = torch.zeros_like(self._weights)
            for param, grad in zip(self._copies, self._views(self._grads, self._copies)):
                param.grad = grad

    def invalidate(self) -> None:
        """The masters changed: the next forward casts them again."""
        self._fresh = False

    def __call__(self, *args, **kwargs):
        """The compute copy's forward (Transformer.forward's arguments), on the current masters."""
        if not self._fresh:
            storage = self._weights.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self._storage_bytes)
            with torch.no_grad():
                torch._foreach_copy_(self._copies, self._masters)
            self._fresh = True
        return self.compute(*args, **kwargs)

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the last backward's gradients (compute dtype) to the masters' fp32 gradients."""
        if self._master_grads is None:
            # A copy even when the compute dtype is fp32: the gradient buffer is zeroed next.
            self._master_grads = self._grads.to(torch.float32, copy=True)
            for param, grad in zip(self._masters, self._views(self._master_grads, self._masters)):
                param.grad = grad
        else:
            self._master_grads.add_(self._grads)
        self._grads.zero_()

    def zero_grad(self) -> None:
        """Drop the masters' gradients (as optimizer.zero_grad(set_to_none=True) would)."""
        for param in self._masters:
            param.grad = None
        self._master_grads = None

    def release(self) -> None:
        """Free the compute copy and its gradients until the next prepare()."""
        for param in self._copies:
            param.grad = None
        self._grads = None
        self._weights.untyped_storage().resize_(0)
        self._fresh = False

    def _views(self, flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of `flat` at the parameters' offsets, shaped as `like`."""
        return [flat[o : o + t.numel()].view(t.shape) for o, t in zip(self._offsets, like)]

    def train(self, mode: bool = True) -> OneRankMixedPrecision:
        self.compute.train(mode)
        return self

    def eval(self) -> OneRankMixedPrecision:
        return self.train(False)
