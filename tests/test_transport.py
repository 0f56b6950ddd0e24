"""Episode transport (grpo/rollout/transport.py) and equal micro-batch counts across trainer ranks
(grpo/train/trainer.py: Trainer._micro_batches / Trainer.train).

The distributed exchange runs on real gloo processes (2 generators + 2 trainers, 1 generator +
2 trainers). Generators build their EpisodeBatches from hand-made Completions; the test process
rebuilds the same batches itself and checks, field by field, that every episode arrives on exactly
one trainer, with its group whole, in (prompt index, sample index) order.
"""

from __future__ import annotations

import functools
import math
import random
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.distributed.roles import build_roles
from grpo.engine import Completion, GenerationRequest
from grpo.rollout.episode import EpisodeBatch
from grpo.rollout.generate import episodes_from_completions
from grpo.rollout.transport import assign_groups, exchange_episodes
from grpo.train.trainer import Trainer
from model import ModelArgs, Transformer
from tests.dist_utils import one_thread, run_ranks

V = 11
PAD = 0
GROUP_SIZE = 3


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


# -------------------------------------------------------------------------------- assign_groups


def _loads(tokens, owner, num_trainers):
    loads = [0] * num_trainers
    for t, o in zip(tokens, owner):
        loads[o] += t
    return loads


@pytest.mark.parametrize(
    "tokens, prompts, trainers, expected",
    [
        # largest first, each to the least-loaded trainer: 10->0, 7->1, 5->1, 3->0, 2->1
        ([10, 7, 5, 3, 2], [0, 1, 2, 3, 4], 2, [0, 1, 1, 0, 1]),
        # equal sizes: taken in prompt-index order (0, 1, 2, 3), alternating trainers
        ([5, 5, 5, 5], [3, 1, 2, 0], 2, [1, 1, 0, 0]),
        # 9(p11)->0, 6(p13)->1, 6(p14)->2, 4(p10)->1 (tie 6/6: lower trainer), 2(p15)->2, 1(p12)->2
        ([4, 9, 1, 6, 6, 2], [10, 11, 12, 13, 14, 15], 3, [1, 0, 2, 1, 2, 2]),
        # more trainers than groups: the rest get nothing
        ([3, 8], [0, 1], 4, [1, 0]),
        ([], [], 2, []),
    ],
)
def test_assign_groups_hand_cases(tokens, prompts, trainers, expected):
    assert assign_groups(tokens, prompts, trainers) == expected


@pytest.mark.parametrize("seed", range(20))
def test_assign_groups_balanced_deterministic_order_free(seed):
    rng = random.Random(seed)
    n, trainers = rng.randint(1, 30), rng.randint(1, 6)
    tokens = [rng.choice([rng.randint(1, 50), 20]) for _ in range(n)]  # plenty of ties
    prompts = rng.sample(range(1000), n)
    owner = assign_groups(tokens, prompts, trainers)
    assert len(owner) == n and all(0 <= o < trainers for o in owner)
    loads = _loads(tokens, owner, trainers)
    assert max(loads) - min(loads) <= max(tokens), (loads, tokens)
    assert assign_groups(tokens, prompts, trainers) == owner
    # the owner of a group depends on (tokens, prompt index), not on where the group is listed
    order = list(range(n))
    rng.shuffle(order)
    shuffled = assign_groups([tokens[i] for i in order], [prompts[i] for i in order], trainers)
    assert {prompts[i]: o for i, o in zip(order, shuffled)} == dict(zip(prompts, owner))


# ----------------------------------------------------------------------- episode exchange

# Per generator: (prompt indices in generation order, prompt length per group, completion lengths
# per episode, policy version, generate_s). Uneven lengths; generator 1's batch is wider.
SPECS_2 = [
    ([4, 0, 2], [3, 2, 4], [[1, 4, 2], [3, 3, 5], [2, 6, 1]], 7, 0.25),
    ([1, 3], [5, 2], [[9, 2, 7], [4, 11, 3]], 6, 1.5),
]
SPECS_1 = [([5, 1, 8, 2], [2, 6, 3, 4], [[2, 2, 2], [7, 1, 4], [1, 1, 9], [5, 3, 6]], 3, 0.75)]
SPECS_1_SMALL = [([9], [4], [[3, 1, 2]], 4, 0.125)]  # one group for two trainers: one gets nothing


def make_batch(spec, seed: int) -> EpisodeBatch:
    prompts, prompt_lens, completion_lens, version, _ = spec
    g = torch.Generator().manual_seed(seed)
    completions = []
    for p, plen, lens in zip(prompts, prompt_lens, completion_lens):
        prompt_tokens = torch.randint(1, V, (plen,), generator=g).tolist()
        for s, n in enumerate(lens):
            completions.append(Completion(
                request=GenerationRequest(prompt_tokens, step=1, prompt_index=p, sample_index=s),
                tokens=torch.randint(1, V, (n,), generator=g).tolist(),
                logprobs=(-torch.rand(n, generator=g) * 4).tolist(),
                finish_reason="length" if (p + s) % 2 else "eos",
                version=version,
            ))
    return episodes_from_completions(completions, PAD)


def _as_dict(batch: EpisodeBatch | None):
    if batch is None:
        return None
    return {name: getattr(batch, name).clone() for name in batch.__dataclass_fields__}


def _exchange_worker(rank: int, world_size: int, generators: int, scenarios) -> list:
    roles = build_roles("split", generators, torch.device("cpu"))
    out = []
    for specs in scenarios:
        batch = generate_s = None
        if roles.is_generator:
            spec = specs[roles.generator_ranks.index(rank)]
            batch, generate_s = make_batch(spec, seed=rank), spec[4]
        max_groups = max(len(s[0]) for s in specs)
        if roles.is_generator:
            got, got_s = exchange_episodes(batch, roles, max_groups, generate_s=generate_s)
        else:
            got, got_s = exchange_episodes(None, roles, max_groups)
        out.append({"role": "generator" if roles.is_generator else "trainer", "batch": _as_dict(got), "generate_s": got_s})
    return out


def _check_exchange(results, specs, generators):
    sent = {}
    for i, spec in enumerate(specs):
        b = make_batch(spec, seed=i)
        for row in range(len(b)):
            sent[(int(b.prompt_index[row]), int(b.sample_index[row]))] = (b, row)
    slowest = max(s[4] for s in specs)
    group_tokens = {}
    for (p, _), (b, row) in sent.items():
        group_tokens[p] = group_tokens.get(p, 0) + int(b.seq_lens[row])
    prompts = sorted(group_tokens)
    owner = dict(zip(prompts, assign_groups([group_tokens[p] for p in prompts], prompts, len(results) - generators)))

    seen, prompt_owner = [], {}
    for rank, r in enumerate(results):
        assert r["generate_s"] == slowest, (rank, r["generate_s"])
        if rank < generators:
            assert r["role"] == "generator" and r["batch"] is None
            continue
        assert r["role"] == "trainer"
        got = r["batch"]
        n = got["tokens"].shape[0]
        for name in ("prompt_lens", "completion_lens", "truncated", "version", "prompt_index", "sample_index",
                     "rewards", "advantages"):
            assert got[name].shape == (n,), name
        assert got["tokens"].dtype == torch.long and got["gen_logprobs"].dtype == torch.float32
        assert got["truncated"].dtype == torch.bool
        keys = list(zip(got["prompt_index"].tolist(), got["sample_index"].tolist()))
        assert keys == sorted(keys), f"trainer rank {rank}: not ordered by (prompt, sample): {keys}"
        if n:
            assert got["tokens"].shape[1] == int((got["prompt_lens"] + got["completion_lens"]).max())
        for i, key in enumerate(keys):
            b, row = sent[key]
            length = int(b.seq_lens[row])
            for name in ("prompt_lens", "completion_lens", "truncated", "version"):
                assert got[name][i] == getattr(b, name)[row], (key, name)
            assert torch.equal(got["tokens"][i, :length], b.tokens[row, :length]), key
            assert torch.equal(got["gen_logprobs"][i, :length], b.gen_logprobs[row, :length]), key
            assert float(got["rewards"][i]) == 0.0 and float(got["advantages"][i]) == 0.0
        for p in set(k[0] for k in keys):
            assert p not in prompt_owner, f"group {p} split across trainer ranks {prompt_owner[p]} and {rank}"
            prompt_owner[p] = rank
            assert sorted(s for q, s in keys if q == p) == list(range(GROUP_SIZE)), f"group {p} incomplete"
        seen += keys
    assert len(seen) == len(set(seen)), "an episode arrived twice"
    assert set(seen) == set(sent), f"missing {set(sent) - set(seen)}, unexpected {set(seen) - set(sent)}"
    # trainer loads follow assign_groups (tested above) on the groups' token counts
    assert {p: r - generators for p, r in prompt_owner.items()} == owner
    return [len(r["batch"]["tokens"]) for r in results[generators:]]


def test_encode_decode_keeps_every_field_and_the_loss_mask():
    from grpo.rollout.transport import _decode, _encode
    from tests.batches import hand_made_batch

    batch = hand_made_batch([3, 2], [[2, 3], [1, 4]], [[0.0, 0.0], [0.0, 0.0]], vocab_size=50, seed=0,
                            first_prompt_index=0)
    batch.loss_mask[0, 4] = False  # an environment token inside the first episode
    ints, floats = _encode(batch, [0, 1, 2, 3], batch.tokens.shape[1] + 2)
    back, want = _decode(ints, floats).select(slice(None)), batch.select(slice(None))  # both trimmed to the longest
    for name in ("tokens", "gen_logprobs", "loss_mask", "prompt_lens", "completion_lens", "truncated", "version",
                 "prompt_index", "sample_index"):
        assert torch.equal(getattr(back, name), getattr(want, name)), name
    assert back.loss_mask.sum() == want.loss_mask.sum() == 2 + 3 + 1 + 4 - 1


def test_exchange_two_generators_two_trainers(tmp_path):
    results = run_ranks(functools.partial(_exchange_worker, generators=2, scenarios=[SPECS_2]), 4, tmp_path)
    counts = _check_exchange([r[0] for r in results], SPECS_2, generators=2)
    assert sum(counts) == 15 and all(counts)


def test_exchange_one_generator_two_trainers(tmp_path):
    scenarios = [SPECS_1, SPECS_1_SMALL]
    results = run_ranks(functools.partial(_exchange_worker, generators=1, scenarios=scenarios), 3, tmp_path)
    counts = _check_exchange([r[0] for r in results], SPECS_1, generators=1)
    assert sum(counts) == 12 and all(counts)
    # a single group: one trainer gets it whole, the other an empty (but well-formed) batch
    counts = _check_exchange([r[1] for r in results], SPECS_1_SMALL, generators=1)
    assert sorted(counts) == [0, 3]


# ------------------------------------------------------- equal micro-batch counts across trainers

TRAIN_ARGS = ModelArgs(vocab_size=V, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=24)
MICRO_TOKENS = 8
# trainer rank 0 holds 1 group (3 episodes), rank 1 holds 3 groups (9 episodes)
RANK_PROMPTS = [[0], [1, 2, 3]]


def _trainer_batch(rank: int) -> EpisodeBatch:
    prompts = RANK_PROMPTS[rank]
    spec = (prompts, [2 + p % 3 for p in prompts], [[1 + (p + s) % 4 for s in range(GROUP_SIZE)] for p in prompts], 0, 0.0)
    batch = make_batch(spec, seed=10 + rank)
    batch.advantages = torch.linspace(-1.0, 1.0, len(batch))
    return batch


def _trainer(group, num_iterations: int, minibatches: int) -> Trainer:
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("trainer",))
    torch.manual_seed(0)
    model = Transformer(TRAIN_ARGS, dtype=torch.float32)
    model.init_weights()
    grpo = GRPOConfig(group_size=GROUP_SIZE, num_iterations=num_iterations, minibatches=minibatches)
    optim = OptimizerConfig(lr=1e-2, warmup_steps=0)
    return Trainer(model, mesh, torch.device("cpu"), torch.float32, grpo, optim, total_steps=2,
                   micro_batch_tokens=MICRO_TOKENS, temperature=1.0, max_new_tokens=8)


def _shape_of(minibatches) -> list[list[int]]:
    """Per minibatch, per micro-batch: episodes in it (-1 for a padding entry with rows None)."""
    return [[-1 if mb.rows is None else len(set(mb.rows.doc_ids[mb.rows.doc_ids >= 0].tolist())) for mb in m]
            for m in minibatches]


def _train_case(group, rank, num_iterations, minibatches, train: bool) -> dict:
    try:
        trainer = _trainer(group, num_iterations, minibatches)
        batch = _trainer_batch(rank)
        shape = _shape_of(trainer._micro_batches(batch))
        lengths = torch.tensor([len(m) for m in shape])
        gathered = [torch.empty_like(lengths) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, lengths, group=group)
        metrics = trainer.train(batch) if train else None
        return {"shape": shape, "all_lengths": [g.tolist() for g in gathered], "metrics": metrics}
    except Exception:
        return {"error": traceback.format_exc()}


# (num_iterations, minibatches, run train): (1, 1) skips the π_old pass; (2, 2) needs it.
TRAIN_CASES = [(1, 1, True), (1, 2, False), (2, 2, True)]
# per minibatches, per rank: episodes in each micro-batch (-1: padding), worked out by hand from the
# episodes' input lengths (prompt + completion - 1): p0 2, 3, 4; p1 4, 5, 6; p2 6, 7, 4; p3 5, 2, 3,
# first fit into micro-batches of 8 tokens, longest first.
# minibatches=1: rank 0 -> {4, 3} {2} = [2, 1]; rank 1 -> {7} {6, 2} {6} {5, 3} {5} {4, 4} =
# [1, 2, 1, 2, 1, 2]; both run 6.
# minibatches=2: minibatch m is the m-th half of ALL ranks' groups in prompt order, {p0, p1} then
# {p2, p3}: rank 0 has p0 -> [2, 1] then nothing; rank 1 has p1 -> {6} {5} {4} = [1, 1, 1] then
# p2, p3 -> {7} {6, 2} {5, 3} {4} = [1, 2, 2, 1].
EXPECTED_SHAPES = {
    1: [[[2, 1, -1, -1, -1, -1]], [[1, 2, 1, 2, 1, 2]]],
    2: [[[2, 1, -1], [-1, -1, -1, -1]], [[1, 1, 1], [1, 2, 2, 1]]],
}


def _trainer_worker(rank: int, world_size: int, case_timeout_s: float) -> dict:
    out = {}
    for num_iterations, minibatches, train in TRAIN_CASES:
        # each case on its own group with a short timeout: a collective mismatch (hang) surfaces as
        # an error of that case only
        group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=case_timeout_s))
        out[num_iterations, minibatches] = _train_case(group, rank, num_iterations, minibatches, train)
    return out


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    return run_ranks(functools.partial(_trainer_worker, case_timeout_s=10.0), 2, tmp_path_factory.mktemp("trainer"))


def _check_train_case(results, case):
    per_rank = [r[case] for r in results]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}, (num_iterations, minibatches) = {case}:\n{r['error']}"
    minibatches = case[1]
    for rank, r in enumerate(per_rank):
        assert r["shape"] == EXPECTED_SHAPES[minibatches][rank], (rank, r["shape"])
        assert r["all_lengths"][0] == r["all_lengths"][1]
    m0, m1 = per_rank[0]["metrics"], per_rank[1]["metrics"]
    assert m0 == m1, "global metrics differ across trainer ranks"
    assert m0 is None or all(math.isfinite(v) for v in m0.values()), m0


def test_micro_batches_equal_across_ranks_and_train_completes(trainer_runs):
    _check_train_case(trainer_runs, (1, 1))


def test_micro_batches_padded_per_minibatch(trainer_runs):
    _check_train_case(trainer_runs, (1, 2))


def test_train_with_old_logprob_pass_completes_on_uneven_ranks(trainer_runs):
    """With a π_old pass (num_iterations, minibatches > 1) the padding micro-batches must run their
    forward too, or ranks holding fewer episodes join fewer FSDP all-gathers and hang."""
    _check_train_case(trainer_runs, (2, 2))
