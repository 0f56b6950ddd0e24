"""A buffer both the generator rank and vLLM's worker process see: the road weights take into vLLM.

The rank owns the buffer and writes each weight piece into it; the worker maps the same memory once
(`OpenedStaging`) and copies from it into the model's parameters. On CUDA the buffer is device
memory shared by a CUDA IPC handle, so weights go GPU -> GPU and never touch host memory; on the
CPU it is a shared mapping of a file in /dev/shm (memory; the rank removes it when the engine
closes). Only the handle (a few hundred bytes) and, the first time, each flush's layout cross
vLLM's RPC channel.
"""

from __future__ import annotations

import os
import pickle
import tempfile

import torch

# One piece of a flush: (parameter name, [[start, stop] per dimension], staging offset, shape).
StagedPiece = tuple[str, list[list[int]], int, list[int]]


def _shared_file_dir() -> str | None:
    """Where the CPU buffer's file lives: /dev/shm (memory) where the system has it."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class StagingBuffer:
    """`numel` elements of `dtype` on `device`, visible to a child process through `handle()`."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self._path = None
        if device.type == "cuda":
            self.tensor = torch.empty(numel, dtype=dtype, device=device)
        else:
            fd, self._path = tempfile.mkstemp(prefix="tandem-staging-", dir=_shared_file_dir())
            os.close(fd)
            self.tensor = torch.from_file(self._path, shared=True, size=numel, dtype=dtype)

    def handle(self) -> bytes:
        """What `OpenedStaging` needs to map this buffer in another process (pickled, so that it
        crosses vLLM's msgpack RPC as plain bytes)."""
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            rebuild, args = reduce_tensor(self.tensor)
            return pickle.dumps(("cuda", rebuild, args))
        return pickle.dumps(("cpu", self._path, self.numel, self.dtype))

    def close(self) -> None:
        """Free the buffer (after the worker has let go of it)."""
        self.tensor = None
        if self._path is not None:
            os.unlink(self._path)
            self._path = None


class OpenedStaging:
    """The worker's view of a StagingBuffer: `tensor` aliases the rank's memory."""

    def __init__(self, handle: bytes):
        kind, *rest = pickle.loads(handle)
        if kind == "cuda":
            rebuild, args = rest
            self.tensor = rebuild(*args)
        else:
            path, numel, dtype = rest
            self.tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)

    def close(self) -> None:
        self.tensor = None
