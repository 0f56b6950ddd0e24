"""Device memory whose addresses outlive its physical pages, through CUDA's virtual memory
management (the driver API, called with ctypes).

The engine's decode steps are captured in CUDA graphs, and a graph holds the KV cache's addresses.
A colocated trainer needs that memory while it trains; freeing the cache the ordinary way would
mean recapturing every graph afterwards (0.3 s a step at the Qwen3-0.6B shape, measured on an
H200). Here the cache sits in a reserved virtual address range: `unmap()` gives its physical pages
back to the driver (the trainer's allocations can then use them), `remap()` backs the same
addresses with new pages, and the captured graphs stay valid.

PyTorch's allocator does not see this memory: `mapped_bytes()` says how much is mapped, for the
peak-memory metrics.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

_PINNED, _ON_DEVICE, _READ_WRITE, _GRANULARITY_RECOMMENDED = 1, 1, 3, 1
_OUT_OF_MEMORY = 2
_mapped = {"bytes": 0}


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compression_type", ctypes.c_ubyte), ("gpu_direct_rdma", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", _Location),
                ("win32_metadata", ctypes.c_void_p), ("flags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(result: int, what: str) -> None:
    if result == 0:
        return
    message = ctypes.c_char_p()
    _cuda().cuGetErrorString(result, ctypes.byref(message))
    text = message.value.decode() if message.value else f"error {result}"
    if result == _OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"{what}: {text}")
    raise RuntimeError(f"{what}: {text}")


def mapped_bytes() -> int:
    """Bytes this process has mapped through VirtualBuffer right now."""
    return _mapped["bytes"]


class _ArrayInterface:
    """A raw device range in the form torch.as_tensor reads without copying."""

    def __init__(self, address: int, nbytes: int, owner: VirtualBuffer):
        # The tensor made from this keeps it, and so the buffer, alive.
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None,
        }


class VirtualBuffer:
    """`nbytes` of device memory at a fixed virtual address; `tensor` is a uint8 view of it.

    Between unmap() and remap() the range has no memory behind it: nothing may read or write
    `tensor` (or a graph that uses it) then.
    """

    def __init__(self, nbytes: int, device: torch.device):
        torch.cuda.init()
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._prop = _AllocationProp(type=_PINNED, location=_Location(type=_ON_DEVICE, id=self.device_index))
        granularity = ctypes.c_size_t()
        with torch.cuda.device(self.device_index):
            _check(_cuda().cuMemGetAllocationGranularity(
                ctypes.byref(granularity), ctypes.byref(self._prop), _GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity")
            step = granularity.value
            self.size = -(-max(nbytes, 1) // step) * step
            address = ctypes.c_uint64()
            _check(_cuda().cuMemAddressReserve(ctypes.byref(address), ctypes.c_size_t(self.size),
                                               ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)),
                   "cuMemAddressReserve")
        self.address = address.value
        # Frees the range however the buffer goes away; unmaps first if still mapped.
        self._state = {"handle": None}
        self._finalizer = weakref.finalize(self, _free, self.address, self.size, self._state)
        self.remap()
        self.tensor = torch.as_tensor(_ArrayInterface(self.address, nbytes, self), device=f"cuda:{self.device_index}")

    @property
    def mapped(self) -> bool:
        return self._state["handle"] is not None

    def remap(self) -> None:
        """Back the range with new physical memory (its contents undefined)."""
        if self.mapped:
            return
        handle = ctypes.c_uint64()
        with torch.cuda.device(self.device_index):
            _check(_cuda().cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(self._prop),
                                       ctypes.c_uint64(0)),
                   f"cuMemCreate of {self.size / 1e9:.3g} GB for the KV cache")
            try:
                _check(_cuda().cuMemMap(ctypes.c_uint64(self.address), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                                        handle, ctypes.c_uint64(0)), "cuMemMap")
                access = _AccessDesc(location=_Location(type=_ON_DEVICE, id=self.device_index), flags=_READ_WRITE)
                _check(_cuda().cuMemSetAccess(ctypes.c_uint64(self.address), ctypes.c_size_t(self.size),
                                              ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
            except BaseException:
                _cuda().cuMemUnmap(ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
                _cuda().cuMemRelease(handle)
                raise
        self._state["handle"] = handle.value
        _mapped["bytes"] += self.size

    def unmap(self) -> None:
        """Give the physical memory back to the driver; the addresses stay reserved."""
        if not self.mapped:
            return
        # Work queued on the range must finish before its pages go.
        torch.cuda.synchronize(self.device_index)
        _unmap(self.address, self.size, self._state)


def _unmap(address: int, size: int, state: dict) -> None:
    _check(_cuda().cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(size)), "cuMemUnmap")
    _check(_cuda().cuMemRelease(ctypes.c_uint64(state["handle"])), "cuMemRelease")
    state["handle"] = None
    _mapped["bytes"] -= size


def _free(address: int, size: int, state: dict) -> None:
    if state["handle"] is not None:
        _unmap(address, size, state)
    _cuda().cuMemAddressFree(ctypes.c_uint64(address), ctypes.c_size_t(size))
