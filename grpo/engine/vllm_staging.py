"""A buffer both the generator rank and vLLM's worker process see: the road weights take into vLLM.

The rank owns the buffer and writes each weight piece into it; the worker maps the same memory once
(`open_staging`) and copies from it into the model's parameters. On CUDA the buffer is device
memory shared by a CUDA IPC handle, so weights go GPU -> GPU and never touch host memory; on the
CPU it is a POSIX shared-memory block. Only the handle (a few hundred bytes) and, per flush, the
list of pieces cross vLLM's RPC channel.
"""

from __future__ import annotations

import pickle
from multiprocessing import resource_tracker, shared_memory

import torch

# One piece of a flush: (parameter name, [[start, stop] per dimension], staging offset, shape).
StagedPiece = tuple[str, list[list[int]], int, list[int]]


class StagingBuffer:
    """`numel` elements of `dtype` on `device`, visible to a child process through `handle()`."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self._shm = None
        if device.type == "cuda":
            self.tensor = torch.empty(numel, dtype=dtype, device=device)
        else:
            itemsize = torch.empty((), dtype=dtype).element_size()
            self._shm = shared_memory.SharedMemory(create=True, size=numel * itemsize)
            self.tensor = torch.frombuffer(self._shm.buf, dtype=dtype, count=numel)

    def handle(self) -> bytes:
        """What `open_staging` needs to map this buffer in another process (pickled, so that it
        crosses vLLM's msgpack RPC as plain bytes)."""
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            rebuild, args = reduce_tensor(self.tensor)
            return pickle.dumps(("cuda", rebuild, args))
        return pickle.dumps(("cpu", self._shm.name, self.numel, self.dtype))

    def close(self) -> None:
        """Free the buffer (after the worker has let go of it)."""
        self.tensor = None
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


class OpenedStaging:
    """The worker's view of a StagingBuffer: `tensor` aliases the rank's memory."""

    def __init__(self, handle: bytes):
        kind, *rest = pickle.loads(handle)
        self._shm = None
        if kind == "cuda":
            rebuild, args = rest
            self.tensor = rebuild(*args)
        else:
            name, numel, dtype = rest
            self._shm = shared_memory.SharedMemory(name=name)
            # The rank created the block and unlinks it; this process must not (Python < 3.13
            # registers every attached block with the resource tracker, which unlinks at exit).
            resource_tracker.unregister(self._shm._name, "shared_memory")
            self.tensor = torch.frombuffer(self._shm.buf, dtype=dtype, count=numel)

    def close(self) -> None:
        self.tensor = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
