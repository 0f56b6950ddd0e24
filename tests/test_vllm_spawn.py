"""The environment the vLLM engine spawns its engine core with (no vLLM needed): under torchrun,
whose agent sets TORCHELASTIC_USE_AGENT_STORE=True in every rank, a process's own one-rank TCP
world waits for a store nobody hosts; with `engine_core_environment`'s environment it starts."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from torch.distributed import DistNetworkError, rendezvous

from grpo.engine.vllm_engine import engine_core_environment


def _own_world_starts() -> bool:
    """Whether the rendezvous vLLM's engine core makes at start (tcp://127.0.0.1:port, one rank)
    succeeds in the current environment, which a spawned child inherits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        next(rendezvous(f"tcp://127.0.0.1:{port}?rank=0&world_size=1", timeout=timedelta(seconds=1)))
    except DistNetworkError:
        return False
    return True


def test_the_engine_core_is_spawned_without_torchruns_agent_store_flag(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert not _own_world_starts()  # the hang vLLM's engine core met under torchrun, cut to 1 s
    with engine_core_environment():
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
        assert _own_world_starts()
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the rank's own environment is restored
