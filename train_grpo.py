"""tandem: GRPO post-training in native PyTorch, generator and trainer ranks in one launch.

Launch (config.toml documents every key; override any with --section.key=value):

    torchrun --nproc_per_node=2 train_grpo.py                             # 1 generator + 1 trainer rank
    torchrun --nproc_per_node=2 train_grpo.py --parallelism.mode=colocated
    python train_grpo.py --parallelism.mode=colocated                     # one process
    python train_grpo.py --parallelism.mode=colocated --training.schedule=async   # generates while it trains
    torchrun --nproc_per_node=8 train_grpo.py --parallelism.generator_ranks=2 --config my.toml
"""

from __future__ import annotations

import os
import socket
import sys
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.config import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config, record_config
from grpo.distributed import error_report
from grpo.distributed.faults import (
    GracefulStop,
    PeerLost,
    end_process,
    is_connection_lost,
    peer_lost,
    restart_count,
    show_stacks_on_crash,
)
from grpo.distributed.preflight import check_output_dir, check_shared_output_dir, take_output_lock
from grpo.distributed.roles import build_roles
from grpo.errors import TandemError
from grpo.run.loop import run_loop
from grpo.run.rank import Run, RunAborted
from grpo.run.sync_step import scores_during_generation
from grpo.scoring.pool import auto_pool_size
from grpo.scoring.scorer import Scorer
from grpo.train.checkpoint_folders import find_resume, saved_step
from model import batch_invariant
from model.attention import set_packed_kernel


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks reach the rendezvous at different times (imports, a slow node, a busy host): waiting for all
# of them is bounded by this, not by parallelism.collective_timeout_s, which is meant for ranks
# that are running.
START_UP_TIMEOUT_S = 600.0


def _rendezvous_store(timeout: timedelta) -> dist.Store:
    """The store the ranks meet in, with a prefix per torchrun attempt.

    Under torchrun the agent hosts the store and keeps it across restarts (--max-restarts), so the
    addresses the ranks of a failed attempt published are still in it; a restarted rank that read
    one would dial a dead process.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    store = dist.PrefixStore(f"tandem/attempt_{restart_count()}", store)
    error_report.attach(store)
    return store


def one_host_thread() -> None:
    """A GPU rank's CPU tensor work in one thread, unless OMP_NUM_THREADS says otherwise (torchrun
    sets it to 1 where it starts several ranks a node, not for one). That work is small (packing,
    indices, sampling set-up): on one H100 the realistic step ran 5-8% faster with one thread than
    with torch's default of one per core (bench/RESULTS.md). Processes started later (reward
    workers, compile workers) inherit the setting."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def init_distributed(cfg: Config) -> torch.device:
    """Join the process group (a one-rank group when not launched by torchrun) and pick the device."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    timeout = timedelta(seconds=cfg.parallelism.collective_timeout_s)
    store = _rendezvous_store(max(timeout, timedelta(seconds=START_UP_TIMEOUT_S)))
    world = int(os.environ["WORLD_SIZE"])
    if store.add("arrived", 1) == world:
        store.set("everyone", "1")
    store.wait(["everyone"])
    group = dict(store=store, rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    use_cuda = cfg.job.device == "cuda" or (cfg.job.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        one_host_thread()
        # nccl for CUDA tensors (weights), gloo for CPU tensors (episodes, control, metrics).
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device, **group)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **group)
    return device


def reward_pool_size(cfg: Config, split: bool) -> int:
    """rewards.num_workers, or for -1 the automatic size: a smaller pool where this rank's engine
    generates while the pool scores (scoring during generation, colocated ranks on the async
    schedule), so that the engine's host work keeps its cores."""
    if cfg.rewards.num_workers != -1:
        return cfg.rewards.num_workers
    engine_beside = scores_during_generation(cfg, split) or (not split and cfg.training.schedule == "async")
    return auto_pool_size(engine_beside=engine_beside)


def run(cfg: Config, stop: GracefulStop) -> None:
    """One rank's job; `stop` records a SIGTERM / SIGINT for the loop to act on at a step boundary."""
    device = init_distributed(cfg)
    try:
        roles = build_roles(
            cfg.parallelism.mode,
            cfg.parallelism.generator_ranks,
            device,
            timedelta(seconds=cfg.parallelism.collective_timeout_s),
            cfg.parallelism.generator_tp,
        )
        # Start-up checks come before any model is built or loaded, and nothing in the output folder
        # is written before they pass.
        check_output_dir(cfg.job.output_dir, roles.rank)
        is_leader = roles.rank == roles.leader
        lock = take_output_lock(cfg.job.output_dir, is_leader)
        try:
            # After the lock: a run refused for a busy folder must not write into it.
            check_shared_output_dir(cfg.job.output_dir, roles.rank, roles.leader)
            resume = find_resume(cfg.job.output_dir, cfg.checkpoint.resume, announce=is_leader)
            if cfg.job.deterministic:
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
                torch.use_deterministic_algorithms(True)
            batch_invariant.enable(cfg.job.bitwise_logprobs)
            batch_invariant.set_fp32_logits(cfg.model.fp32_logits)
            set_packed_kernel(cfg.model.train_attention)
            if cfg.job.bitwise_logprobs and is_leader:
                print(f"numerics: batch-invariant log-probs, {batch_invariant.describe(device)}", flush=True)
            scorer = None
            if roles.is_trainer:
                r = cfg.rewards
                workers = reward_pool_size(cfg, roles.split)
                if r.num_workers == -1 and is_leader:
                    print(f"rewards: {workers} reward worker(s) per scoring rank (rewards.num_workers = -1)", flush=True)
                scorer = Scorer(r.functions, r.weights, r.timeout_s, workers, on_error=r.on_error)
            job = None
            try:
                job = Run(cfg, device, roles, scorer, resume)
                if is_leader:
                    note = record_config(cfg, Path(cfg.job.output_dir) / "config.toml",
                                         None if resume is None else saved_step(resume))
                    if note:
                        print(f"warning: {note}", file=sys.stderr, flush=True)
                run_loop(cfg, job, resume, stop)
                # Leave together: no rank tears its process groups down while the leader still writes
                # the report and its last lines.
                dist.barrier()
            finally:
                if job is not None and job.engine is not None:
                    job.engine.close()
                if scorer is not None:
                    scorer.close()
        finally:
            if lock is not None:
                lock.release()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    if any(arg in ("-h", "--help") for arg in (sys.argv[1:] if argv is None else argv)):
        print(f"{__doc__.strip()}\n\nEvery key, its default and a one-line comment: {DEFAULT_CONFIG_PATH}")
        return 0
    error_report.attach(None)
    show_stacks_on_crash()
    try:
        cfg = load_config(argv)
    except ConfigError as error:
        error_report.config_error(f"config error: {error}")
        return 2
    # Signals stay deferred until this rank has said why it stops: when a rank dies, torchrun sends
    # SIGTERM to the others, which must not cut their teardown and error line short.
    with GracefulStop() as stop:
        try:
            run(cfg, stop)
        except PeerLost as error:
            error_report.lost_peers(f"error: {error}")
            return 1
        except TandemError as error:
            error_report.own_error(f"error: {error}")
            return 1
        except RunAborted:
            # Silent: the rank that failed has printed the one line.
            return 1
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt) or stop.forced:
                error_report.own_error("stopped at once by a second Ctrl-C: nothing was saved after the last checkpoint")
                return 130
            if not (isinstance(error, (RuntimeError, dist.DistError)) and is_connection_lost(error)):
                raise
            # A collective outside the loop's named waits (start-up, the final barrier) lost its peers.
            rank = os.environ.get("RANK", "0")
            error_report.lost_peers(f"error: {peer_lost(f'rank {rank}', 'the other ranks')}")
            return 1
    return 0


if __name__ == "__main__":
    end_process(main())
