"""Trainer -> generator weight sync (grpo/distributed/weight_sync.py) and the colocated weight refresh.

References are independent of the code under test: `torch.chunk` (the rule FSDP2 uses for uneven
first dimensions) and DTensor's own local-shape/offset computation for shard boxes; element-count
arrays for bucket coverage; for the distributed sync, each generator rebuilds the expected weights
itself (same seed, same init, the same perturbation applied to the whole fp32 tensor, cast to
bf16) and compares bitwise.

Multi-rank runs are real gloo processes: 1+1, 1+2, 2+1 and 2+2 generator + trainer ranks, one
spawn per world size (both 3-rank layouts share a spawn).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard

import grpo.distributed.weight_sync as weight_sync
from grpo.config import GRPOConfig, OptimizerConfig
from grpo.distributed.roles import build_roles
from grpo.distributed.weight_sync import WeightSync, intersect, plan_buckets, shard_box
from grpo.engine import NativeEngine, SamplingParams
from grpo.train.trainer import Trainer
from model import ModelArgs, Transformer
from model.parallelize import parallelize
from tests.dist_utils import one_thread, run_ranks, single_process_group

# Odd sizes everywhere: vocab 13, dim 21, ffn 37 rows split unevenly over 2 trainer ranks.
ARGS = ModelArgs(vocab_size=13, dim=21, n_layers=3, n_heads=3, n_kv_heads=1, head_dim=6, ffn_dim=37)
GEN_DTYPE = torch.bfloat16
# bf16 = 2 bytes: 256-element buckets (shards cut into several pieces), then 30-element buckets
# (smaller than one 37-element row of w2: such a row travels alone in an oversized bucket).
BUCKET_BYTES = (512, 60)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


# ------------------------------------------------------------------------------------ shard boxes


def chunk_range(n: int, parts: int, index: int) -> list[int]:
    """Indices of chunk `index` of torch.chunk(range(n), parts); empty past the chunks that exist."""
    chunks = torch.arange(n).chunk(parts)
    return chunks[index].tolist() if index < len(chunks) else []


def box_indices(box, dim: int) -> list[int]:
    return list(range(*box[dim]))


@pytest.mark.parametrize("n, parts", [(5, 2), (7, 3), (2, 3), (5, 4), (6, 4), (1, 2), (13, 2), (8, 8)])
def test_shard_box_first_dim_follows_torch_chunk(n, parts):
    shape = (n, 3)
    for rank in range(parts):
        box = shard_box(shape, (Shard(0),), (parts,), (rank,))
        assert box_indices(box, 0) == chunk_range(n, parts, rank), (n, parts, rank, box)
        assert box[1] == (0, 3)
        # DTensor's own rule agrees (local size along dim 0)
        local_shape, offset = _compute_local_shape_and_global_offset(shape, (parts,), [rank], (Shard(0),))
        assert box[0][1] - box[0][0] == local_shape[0]
        if local_shape[0]:
            assert box[0][0] == offset[0]


@pytest.mark.parametrize("n, parts", [(7, 3), (2, 3), (10, 4)])
def test_shard_box_other_dim_follows_torch_chunk(n, parts):
    for rank in range(parts):
        box = shard_box((4, n), (Shard(1),), (parts,), (rank,))
        assert box[0] == (0, 4)
        assert box_indices(box, 1) == chunk_range(n, parts, rank)


def test_shard_box_replicate_is_whole_tensor():
    assert shard_box((5, 7), (Replicate(),), (3,), (2,)) == ((0, 5), (0, 7))
    assert shard_box((9,), (Replicate(),), (1,), (0,)) == ((0, 9),)


@pytest.mark.parametrize(
    "placements",
    [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Shard(0)), (Replicate(), Shard(1)), (Shard(1), Replicate())],
)
def test_shard_box_two_mesh_dims(placements):
    shape, mesh = (11, 7), (2, 3)
    full = torch.arange(math.prod(shape)).view(shape)
    for i in range(mesh[0]):
        for j in range(mesh[1]):
            # expected: split by mesh dim 0, then split what is left by mesh dim 1 (torch.chunk each time)
            expected = full
            for placement, parts, index in zip(placements, mesh, (i, j)):
                if isinstance(placement, Shard):
                    chunks = expected.chunk(parts, dim=placement.dim)
                    expected = chunks[index] if index < len(chunks) else expected.narrow(placement.dim, 0, 0)
            box = shard_box(shape, placements, mesh, (i, j))
            got = full[tuple(slice(lo, hi) for lo, hi in box)]
            assert got.shape == expected.shape and torch.equal(got, expected), (placements, i, j, box)
            local_shape, _ = _compute_local_shape_and_global_offset(shape, mesh, [i, j], placements)
            assert tuple(got.shape) == tuple(local_shape)


def test_intersect():
    assert intersect(((0, 4), (2, 6)), ((3, 9), (0, 3))) == ((3, 4), (2, 3))
    assert intersect(((0, 4),), ((4, 8),)) is None
    assert intersect(((0, 4), (0, 2)), ((1, 2), (2, 5))) is None


# ---------------------------------------------------------------------------------- bucket plans

PLAN_SHAPES = {"emb": (13, 21), "norm": (21,), "tiny": (2, 3), "w2": (21, 37), "wide": (1, 50), "w1": (37, 21)}


@pytest.mark.parametrize("num_trainers", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_numel", [1, 7, 30, 256, 10_000])
def test_plan_buckets_cover_every_element_once(num_trainers, bucket_numel):
    plans = plan_buckets(PLAN_SHAPES, (Shard(0),), num_trainers, bucket_numel)
    assert len(plans) == num_trainers
    counts = {name: torch.zeros(shape, dtype=torch.long) for name, shape in PLAN_SHAPES.items()}
    for rank, plan in enumerate(plans):
        for bucket in plan:
            assert bucket, "empty bucket"
            end = 0
            for entry in sorted(bucket, key=lambda e: e.offset):
                size = math.prod(hi - lo for lo, hi in entry.box)
                assert size > 0
                assert entry.offset >= end, "entries overlap inside a bucket"
                end = entry.offset + size
                # a trainer only ships rows of its own torch.chunk shard, whole trailing dims
                shape = PLAN_SHAPES[entry.name]
                rows = chunk_range(shape[0], num_trainers, rank)
                assert rows and rows[0] <= entry.box[0][0] and entry.box[0][1] <= rows[-1] + 1
                assert entry.box[1:] == tuple((0, n) for n in shape[1:])
                counts[entry.name][tuple(slice(lo, hi) for lo, hi in entry.box)] += 1
            if end > bucket_numel:
                # only a single entry made of one row larger than the bucket may overflow it
                assert len(bucket) == 1, bucket
                entry = bucket[0]
                assert entry.box[0][1] - entry.box[0][0] == 1
                assert math.prod(PLAN_SHAPES[entry.name][1:]) > bucket_numel
    for name, count in counts.items():
        assert torch.equal(count, torch.ones_like(count)), f"{name}: elements covered {count.unique().tolist()} times"


# ------------------------------------------------ simulated end-to-end (one process, fake transport)


class _FakeDTensor:
    """Stands in for an FSDP2 parameter: global .shape, .to_local() the torch.chunk shard."""

    def __init__(self, full: torch.Tensor, rank: int, parts: int):
        self.shape = full.shape
        chunks = full.chunk(parts, dim=0)
        self._local = chunks[rank] if rank < len(chunks) else full[:0]

    def to_local(self) -> torch.Tensor:
        return self._local


class _RecordingEngine:
    """update_weights with NativeEngine's semantics (param[index] = tensor) on local tensors of any
    shape, counting how often each element is written."""

    def __init__(self, local_shapes):
        self.params = {n: torch.zeros(s, dtype=GEN_DTYPE) for n, s in local_shapes.items()}
        self.writes = {n: torch.zeros(s, dtype=torch.long) for n, s in local_shapes.items()}
        self.version = -1

    def update_weights(self, buckets, version):
        for bucket in buckets:
            for name, index, tensor in bucket:
                self.params[name][index].copy_(tensor)
                self.writes[name][index] += 1
        self.version = version


def _expected_slice(full: torch.Tensor, placement, parts: int, coordinate: int) -> torch.Tensor:
    if isinstance(placement, Replicate):
        return full
    chunks = full.chunk(parts, dim=placement.dim)
    return chunks[coordinate] if coordinate < len(chunks) else full.narrow(placement.dim, 0, 0)


SIM_SHAPES_2D = {"emb": (13, 21), "tiny": (2, 3), "w2": (21, 37), "wide": (1, 50), "w1": (37, 8)}
SIM_SHAPES = {**SIM_SHAPES_2D, "norm": (21,), "bias": (5,)}


@pytest.mark.parametrize("num_trainers", [1, 2, 3])
@pytest.mark.parametrize("bucket_bytes", [16, 100, 1 << 20])
@pytest.mark.parametrize("layout", ["replicate", "shard0x2", "shard1x3"])
def test_send_receive_reconstructs_generator_slices(monkeypatch, num_trainers, bucket_bytes, layout):
    placement, parts = {"replicate": (Replicate(), 1), "shard0x2": (Shard(0), 2), "shard1x3": (Shard(1), 3)}[layout]
    shapes = SIM_SHAPES_2D if layout == "shard1x3" else SIM_SHAPES
    g = torch.Generator().manual_seed(7)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}

    # fake transport: trainer t's broadcasts are recorded, generators replay them in order. An async
    # broadcast's data move happens only at wait(): a sender that refills a buffer still in flight
    # records the wrong bucket, and a receiver finds NaN in a buffer until it has waited for it.
    sent: dict[int, list[torch.Tensor]] = {}
    current = {"rank": 0}

    def fake_broadcast(tensor, src, group, async_op=False):
        if current["rank"] == src:  # sender: a bucket's place on the wire is its posting order
            assert group == ("group", src)
            queue = sent.setdefault(src, [])
            queue.append(None)
            place = len(queue) - 1
            move = lambda: queue.__setitem__(place, tensor.clone())  # noqa: E731
        else:
            tensor.fill_(float("nan"))
            data = sent[src].pop(0)
            move = lambda: tensor.copy_(data)  # noqa: E731
        if not async_op:
            move()
            return None
        return SimpleNamespace(wait=move)

    fake_dist = SimpleNamespace(get_rank=lambda: current["rank"], broadcast=fake_broadcast)
    monkeypatch.setattr(weight_sync, "dist", fake_dist)
    monkeypatch.setattr(weight_sync, "DTensor", _FakeDTensor)

    trainer_ranks = [100 + t for t in range(num_trainers)]
    groups = [("group", r) for r in trainer_ranks]

    def make_sync(coordinate=0):
        return WeightSync(shapes, trainer_ranks, groups, GEN_DTYPE, torch.device("cpu"), bucket_bytes,
                          generator_placements=(placement,), generator_mesh_shape=(parts,),
                          generator_coordinate=(coordinate,))

    for t, rank in enumerate(trainer_ranks):
        current["rank"] = rank
        make_sync().send({n: _FakeDTensor(x, t, num_trainers) for n, x in full.items()})
    snapshot = {r: [b.clone() for b in bs] for r, bs in sent.items()}

    current["rank"] = -1  # a generator
    for coordinate in range(parts):
        sent.clear()
        sent.update({r: [b.clone() for b in bs] for r, bs in snapshot.items()})
        expected = {n: _expected_slice(x, placement, parts, coordinate).to(GEN_DTYPE) for n, x in full.items()}
        engine = _RecordingEngine({n: e.shape for n, e in expected.items()})
        make_sync(coordinate).receive(engine, version=3)
        assert all(not bs for bs in sent.values()), "generator did not consume every bucket"
        assert engine.version == 3
        for name, want in expected.items():
            assert torch.equal(engine.writes[name], torch.ones_like(engine.writes[name])), (name, coordinate)
            assert torch.equal(engine.params[name], want), (name, coordinate)


# ------------------------------------------------------------------- distributed sync (real ranks)


def _perturbation(shape, version: int) -> torch.Tensor:
    """Deterministic, position-dependent fp32 offsets for the whole tensor."""
    n = math.prod(shape)
    return (torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + version) * 1e-2).float().view(shape)


def _expected_weights(version: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 master after `version` perturbations, computed on whole tensors."""
    torch.manual_seed(0)
    model = Transformer(ARGS, dtype=torch.float32)
    model.init_weights()
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = p.detach().clone()
            for v in range(1, version + 1):
                full.add_(_perturbation(full.shape, v))
            out[name] = full
    return out


def _sync_scenario(generators: int) -> dict:
    cpu = torch.device("cpu")
    roles = build_roles("split", generators, cpu)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Transformer(ARGS).named_parameters()}
    syncs = [WeightSync(shapes, roles.trainer_ranks, roles.weight_groups, GEN_DTYPE, cpu, b) for b in BUCKET_BYTES]
    num_trainers = len(roles.trainer_ranks)
    if roles.is_trainer:
        me = roles.trainer_ranks.index(roles.rank)
        torch.manual_seed(0)
        model = Transformer(ARGS, dtype=torch.float32)
        model.init_weights()
        parallelize(model, roles.trainer_mesh, compute_dtype=torch.float32)
        masters_ok = []
        for version, sync in enumerate(syncs, start=1):
            with torch.no_grad():
                for p in model.parameters():
                    assert isinstance(p, DTensor)
                    local = p.to_local()
                    chunks = _perturbation(p.shape, version).chunk(num_trainers, dim=0)
                    mine = chunks[me] if me < len(chunks) else local.new_zeros(local.shape)
                    assert mine.shape == local.shape
                    local.add_(mine)
            expected = _expected_weights(version)
            # sanity: the perturbed master really is the reference (so a mismatch below is the sync's)
            masters_ok.append(all(torch.equal(p.full_tensor(), expected[n]) for n, p in model.named_parameters()))
            sync.send(dict(model.named_parameters()))
        return {"role": "trainer", "masters_ok": masters_ok,
                "plans": [len(s.plans[me]) for s in syncs]}

    engine = NativeEngine(ARGS, SamplingParams(4), eos_ids=[0], seed=0, dtype=GEN_DTYPE, device="cpu")
    params = dict(engine.model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    checks = []
    for version, sync in enumerate(syncs, start=1):
        sync.receive(engine, version=version)
        expected = {n: t.to(GEN_DTYPE) for n, t in _expected_weights(version).items()}
        checks.append({
            "version": engine.version,
            "names_match": sorted(params) == sorted(expected),
            "mismatched": [n for n, p in params.items() if not torch.equal(p, expected[n])],
            "dtype_ok": all(p.dtype == GEN_DTYPE for p in params.values()),
            "moved": [n for n, p in params.items() if p.data_ptr() != ptrs[n]],
        })
    # No two parameters overlap in memory (the engine's fused projections share a storage, in disjoint blocks).
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params.values())
    disjoint = all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    return {"role": "generator", "checks": checks, "disjoint_memory": disjoint}


def _sync_worker(rank: int, world_size: int, layouts: tuple[int, ...]) -> dict:
    return {g: _sync_scenario(g) for g in layouts}


@pytest.mark.parametrize("world_size, layouts", [(2, (1,)), (3, (1, 2)), (4, (2,))], ids=["1+1", "1+2,2+1", "2+2"])
def test_split_sync_is_bitwise_bf16_of_master(tmp_path, world_size, layouts):
    results = run_ranks(functools.partial(_sync_worker, layouts=layouts), world_size, tmp_path)
    for generators in layouts:
        per_rank = [r[generators] for r in results]
        roles = [r["role"] for r in per_rank]
        assert roles == ["generator"] * generators + ["trainer"] * (world_size - generators)
        for rank, r in enumerate(per_rank):
            where = f"{generators}+{world_size - generators}, rank {rank}"
            if r["role"] == "trainer":
                assert r["masters_ok"] == [True, True], where
                # the small buckets really split the work into many broadcasts
                assert r["plans"][0] > 5 and r["plans"][1] > r["plans"][0], where
                continue
            assert r["disjoint_memory"], where
            for version, check in enumerate(r["checks"], start=1):
                assert check["names_match"], where
                assert check["dtype_ok"], where
                assert check["mismatched"] == [], f"{where}, sync {version}: not bitwise equal: {check['mismatched']}"
                assert check["version"] == version, where
                assert check["moved"] == [], f"{where}: parameters reallocated instead of written in place"


# ------------------------------------------------------------------ colocated: separate storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_colocated_refresh_copies_into_engine_storage(dtype):
    """Run.sync_weights in colocated mode: engine.update_weights([trainer.full_weights(dtype)], v)."""
    with single_process_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("trainer",))
        torch.manual_seed(0)
        policy = Transformer(ARGS, dtype=torch.float32)
        policy.init_weights()
        trainer = Trainer(policy, mesh, torch.device("cpu"), torch.float32, GRPOConfig(group_size=2),
                          OptimizerConfig(), total_steps=1, micro_batch_tokens=64, temperature=1.0, max_new_tokens=4)
        engine = NativeEngine(ARGS, SamplingParams(4), eos_ids=[0], seed=0, dtype=dtype, device="cpu")
        engine_params = dict(engine.model.named_parameters())
        ptrs = {n: p.data_ptr() for n, p in engine_params.items()}

        engine.update_weights([trainer.full_weights(dtype)], 1)

        trainer_params = dict(trainer.model.named_parameters())
        assert engine.version == 1
        assert sorted(engine_params) == sorted(trainer_params)
        # One rank: the trainer's masters are plain tensors (model/mixed_precision.py).
        assert trainer.one_rank is not None and not any(isinstance(p, DTensor) for p in trainer_params.values())
        trainer_storages = {p.untyped_storage().data_ptr() for p in trainer_params.values()}
        for name, p in engine_params.items():
            assert p.dtype == dtype
            assert torch.equal(p, trainer_params[name].detach().to(dtype)), name
            assert p.data_ptr() == ptrs[name], f"{name} reallocated"
            assert p.untyped_storage().data_ptr() not in trainer_storages, f"{name} aliases a trainer parameter"
        before = {n: p.clone() for n, p in engine_params.items()}

        with torch.no_grad():
            for p in trainer_params.values():
                p.add_(1.0)
        for name, p in engine_params.items():
            assert torch.equal(p, before[name]), f"{name} changed with the trainer's parameter"
            assert not torch.equal(trainer_params[name].detach().to(dtype), p), name
