"""The LR schedule and the GRPO update (grpo/train/optim.py, grpo/train/trainer.py); the packing's
hand-made layouts are in test_packing.py, the one-rank path and logprob_diff/exact_frac in
test_trainer_one_rank.py, the shared setup in tests/trainer_setup.py.

The update is checked against a reference written here from the definition, independent of the
trainer: one plain full forward per sequence (`model(tokens)`, no packing), log softmax(logits / T)
at the completion tokens, the clipped surrogate summed over completion tokens and divided by the
minibatch's completion-token count, optional global-norm clipping, then torch.optim.AdamW. The
trainer runs (a) in one process with the whole batch in one micro-batch, (b) in one process with
several micro-batches, (c) on 2 gloo ranks holding different, unevenly sized sets of whole groups.

AdamW's first step is nearly sign(g) and would hide gradient errors, so the optimizer runs with a
large epsilon (eps = 1 >> |g|): the update lr * g / (|g| + eps) is then close to linear in g.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.rollout.episode import EpisodeBatch
from grpo.train.optim import lr_factor
from grpo.train.packing import pack_episodes, plan_micro_batches
from grpo.train.trainer import Trainer
from model import Transformer
from tests.dist_utils import abandon_group, one_thread, run_ranks, single_process_group
from tests.trainer_setup import (
    ATOL,
    CLIP_HIGH,
    CLIP_LOW,
    COMPLETION_LENS,
    MAX_NORM,
    PROMPT_LENS,
    SMALL,
    TEMPERATURE,
    WHOLE,
    build_model,
    episodes_of,
    grpo_config,
    initial_weights,
    make_batch,
    optim_config,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


# ------------------------------------------------------------------------------------------ the reference


def sequence_logprobs(model: Transformer, batch: EpisodeBatch, i: int) -> torch.Tensor:
    """log softmax(logits / T) of episode i's completion tokens, from a plain forward of that sequence alone."""
    p, c = int(batch.prompt_lens[i]), int(batch.completion_lens[i])
    seq = batch.tokens[i, : p + c]
    logits = model(seq[None, :-1])[0].float()
    logprobs = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return torch.stack([logprobs[t - 1, seq[t]] for t in range(p, p + c)])


def reference_run(batch: EpisodeBatch, minibatch_groups: list[list[int]], num_iterations: int, optim: OptimizerConfig):
    """The GRPO update from its definition: returns final weights and the logged statistics."""
    model = build_model()
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                            weight_decay=optim.weight_decay)
    with torch.no_grad():  # π_old: the policy before the first update, held fixed for all of them
        old = {i: sequence_logprobs(model, batch, i) for i in range(len(batch))}
    stats = dict(ratio=0.0, clipped=0.0, tokens=0.0, loss=0.0, diff=0.0, diff_max=0.0, ratio_max=0.0, norms=[])
    for i in range(len(batch)):
        p, c = int(batch.prompt_lens[i]), int(batch.completion_lens[i])
        diff = (old[i] - batch.gen_logprobs[i, p : p + c]).abs()
        stats["diff"] += float(diff.sum())
        stats["diff_max"] = max(stats["diff_max"], float(diff.max()))
    first = True
    for _ in range(num_iterations):
        for groups in minibatch_groups:
            members = episodes_of(batch, groups)
            n_tokens = sum(int(batch.completion_lens[i]) for i in members)
            total = 0.0
            for i in members:
                lp = sequence_logprobs(model, batch, i)
                ref_old = lp.detach() if first else old[i]
                a = float(batch.advantages[i])
                for t in range(lp.shape[0]):
                    r = torch.exp(lp[t] - ref_old[t])
                    clipped_r = torch.clamp(r, 1 - CLIP_LOW, 1 + CLIP_HIGH)
                    total = total - torch.minimum(r * a, clipped_r * a)
                    rv = float(r.detach())
                    stats["ratio"] += rv
                    stats["ratio_max"] = max(stats["ratio_max"], rv)
                    stats["clipped"] += (a > 0 and rv > 1 + CLIP_HIGH) or (a < 0 and rv < 1 - CLIP_LOW)
                    stats["tokens"] += 1
            loss = total / n_tokens
            loss.backward()
            stats["loss"] += float(loss.detach())
            norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params.values()))
            stats["norms"].append(norm)
            if optim.max_grad_norm > 0 and norm > optim.max_grad_norm:
                for p in params.values():
                    p.grad.mul_(optim.max_grad_norm / norm)
            opt.step()
            opt.zero_grad()
            first = False
    weights = {n: p.detach().clone() for n, p in params.items()}
    return weights, stats


# ------------------------------------------------------------------------------------------ trainer runs


def run_trainer(
    batch: EpisodeBatch, world: int, micro_batch_tokens: int, optim: OptimizerConfig, grpo: GRPOConfig,
    timeout_s: float | None = None, share_prompts: bool = False,
):
    """Trainer.train on this rank's batch; (full weights after the step, metrics). Collective.

    timeout_s: run on a fresh group whose collectives fail after that long (instead of hanging).
    share_prompts: pack each group's prompt once (Trainer's share_prompts)."""
    if timeout_s is None:
        mesh = init_device_mesh("cpu", (world,))
    else:
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))
        mesh = DeviceMesh.from_group(group, "cpu")
    trainer = Trainer(build_model(), mesh, torch.device("cpu"), torch.float32, grpo, optim, total_steps=10,
                      micro_batch_tokens=micro_batch_tokens, temperature=TEMPERATURE, max_new_tokens=8,
                      share_prompts=share_prompts)
    metrics = trainer.train(batch)
    weights = {}
    for name, param in trainer.model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        weights[name] = full.detach().clone()
    return weights, metrics


# rank -> groups: rank 0 holds one short group (12 tokens: 1 micro-batch of SMALL tokens), rank 1
# three (several micro-batches): rank 0 pads with empty micro-batches
UNEVEN = [[0], [1, 2, 3]]
# two groups each: the same number of micro-batches per rank, different token counts (18 vs 24)
EVEN = [[0, 1], [2, 3]]
DIST_SCENARIOS = {
    "noclip": dict(optim=dict(), grpo=dict(), split=UNEVEN),
    "clip": dict(optim=dict(max_grad_norm=MAX_NORM), grpo=dict(), split=UNEVEN),
    "iters2_even": dict(optim=dict(), grpo=dict(num_iterations=2), split=EVEN),
    # two minibatches of whole groups, the ranks holding contiguous halves (split mode assigns groups to
    # trainer ranks by token load, grpo/rollout/transport.py assign_groups, so any assignment can occur)
    "minibatches2": dict(optim=dict(), grpo=dict(minibatches=2), split=EVEN),
    # last, on a group with a short collective timeout: mismatched collectives fail instead of hanging,
    # which may leave the process group unusable
    "iters2_uneven": dict(optim=dict(), grpo=dict(num_iterations=2), split=UNEVEN, timeout_s=5.0),
}


def _dist_worker(rank: int, world: int):
    batch = make_batch()
    results = {}
    for name, sc in DIST_SCENARIOS.items():
        local = batch.select(episodes_of(batch, sc["split"][rank]))
        try:
            results[name] = run_trainer(local, world, SMALL, optim_config(**sc["optim"]), grpo_config(**sc["grpo"]),
                                        timeout_s=sc.get("timeout_s"))
        except Exception as exc:  # recorded; the test of that scenario reports it
            results[name] = f"{type(exc).__name__}: {exc}"
            abandon_group()
            break
    return results


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    return run_ranks(_dist_worker, 2, tmp_path_factory.mktemp("trainer_dist"), timeout_s=240.0)


def rank_result(rank_results: dict, scenario: str):
    result = rank_results.get(scenario, "not run: an earlier scenario broke the process group")
    if isinstance(result, str):
        pytest.fail(f"2-rank scenario {scenario!r} failed: {result}")
    return result


@pytest.fixture(scope="module")
def single():
    """Single-process trainer runs, keyed by (micro_batch_tokens, max_grad_norm, minibatches, num_iterations)."""
    batch = make_batch()
    out = {}
    with single_process_group():
        for mbs, norm, mb, iters in [(WHOLE, 0.0, 1, 1), (SMALL, 0.0, 1, 1), (WHOLE, MAX_NORM, 1, 1),
                                     (SMALL, MAX_NORM, 1, 1), (SMALL, 0.0, 2, 2), (WHOLE, 0.0, 2, 1)]:
            out[(mbs, norm, mb, iters)] = run_trainer(batch, 1, mbs, optim_config(norm), grpo_config(mb, iters))
    return out


@pytest.fixture(scope="module")
def reference():
    batch = make_batch()
    all_groups = [[0, 1, 2, 3]]
    return {
        "noclip": reference_run(batch, all_groups, 1, optim_config()),
        "clip": reference_run(batch, all_groups, 1, optim_config(MAX_NORM)),
        "iters2": reference_run(batch, all_groups, 2, optim_config()),
        "mb2_iters2": reference_run(batch, [[0, 1], [2, 3]], 2, optim_config()),
        "mb2": reference_run(batch, [[0, 1], [2, 3]], 1, optim_config()),
    }


def assert_weights_close(got: dict, want: dict, initial: dict | None = None, atol: float = ATOL):
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")
    if initial is not None:
        # the step is large compared with the tolerance, so a wrong gradient cannot hide in it
        moved = max(float((want[n] - initial[n]).abs().max()) for n in want)
        assert moved > 1000 * ATOL


def check_metrics(metrics: dict, stats: dict, updates: int, exact_ratio: bool = False):
    assert metrics["loss/ratio_mean"] == pytest.approx(stats["ratio"] / stats["tokens"], rel=1e-5)
    if exact_ratio:
        assert metrics["loss/ratio_mean"] == 1.0 and metrics["loss/ratio_max"] == 1.0
    assert metrics["loss/ratio_max"] == pytest.approx(stats["ratio_max"], rel=1e-5)
    assert metrics["loss/clip_frac"] == pytest.approx(stats["clipped"] / stats["tokens"], abs=1e-9)
    assert metrics["loss/policy"] == pytest.approx(stats["loss"] / updates, rel=1e-5, abs=1e-7)
    assert metrics["loss/grad_norm"] == pytest.approx(sum(stats["norms"]) / updates, rel=1e-5)
    first_pass_tokens = sum(sum(c) for c in COMPLETION_LENS)
    assert metrics["logprob_diff/mean"] == pytest.approx(stats["diff"] / first_pass_tokens, rel=1e-5)
    assert metrics["logprob_diff/max"] == pytest.approx(stats["diff_max"], rel=1e-5)
    assert metrics["optimizer/lr"] == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------ episode batches


def test_pack_episodes_generic_batch():
    batch = make_batch()
    rows = pack_episodes(batch, pad_id=0)
    assert rows.tokens.shape == (1, int((batch.seq_lens - 1).sum()))  # no padding
    assert float(rows.loss_mask.sum()) == sum(sum(c) for c in COMPLETION_LENS)
    ids = rows.doc_ids[0].tolist()
    assert -1 not in ids and set(ids) == set(range(len(batch)))
    for i in range(len(batch)):
        cols = [c for c, d in enumerate(ids) if d == i]
        assert cols == list(range(cols[0], cols[0] + len(cols)))  # contiguous
        p, c = int(batch.prompt_lens[i]), int(batch.completion_lens[i])
        seq = batch.tokens[i, : p + c].tolist()
        assert len(cols) == p + c - 1
        assert rows.tokens[0, cols].tolist() == seq[:-1]
        assert rows.targets[0, cols].tolist() == seq[1:]
        assert rows.positions[0, cols].tolist() == list(range(p + c - 1))
        assert rows.loss_mask[0, cols].tolist() == [float(t + 1 >= p) for t in range(p + c - 1)]
        assert rows.advantages[0, cols].tolist() == [float(batch.advantages[i])] * len(cols)
        assert rows.gen_logprobs[0, cols].tolist() == batch.gen_logprobs[i, 1 : p + c].tolist()


def test_select_trims_to_longest_sequence():
    batch = make_batch()
    picked = batch.select([0, 1, 2])  # group 0: prompt 3, completions 2, 1, 3 -> width 6
    assert picked.tokens.shape == (3, 6) and picked.gen_logprobs.shape == (3, 6)
    assert picked.completion(2) == batch.completion(2)


def test_completions_are_each_episodes_tokens_after_its_prompt():
    batch = make_batch()
    want = [(p, c) for p, group in zip(PROMPT_LENS, COMPLETION_LENS) for c in group]
    got = batch.completions()
    assert [len(ids) for ids in got] == [c for _, c in want]
    for i, (ids, (p, c)) in enumerate(zip(got, want)):
        assert ids == batch.tokens[i, p : p + c].tolist() == batch.completion(i)


# ------------------------------------------------------------------------------------------ LR schedule


def test_lr_factor_warmup_then_cosine():
    # warmup 4 steps to 1, cosine from step 4 down to 0.1 at step 14
    cases = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 9: 0.1 + 0.9 * 0.5, 14: 0.1, 20: 0.1}
    cases[6] = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 10))
    for step, want in cases.items():
        assert lr_factor(step, 4, 14, 0.1) == pytest.approx(want, abs=1e-12), step
    assert lr_factor(0, 0, 10, 0.0) == pytest.approx(1.0)
    assert lr_factor(5, 0, 10, 0.0) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------ the update


def test_single_process_whole_batch_matches_reference(single, reference):
    weights, stats = reference["noclip"]
    got, metrics = single[(WHOLE, 0.0, 1, 1)]
    assert_weights_close(got, weights, initial_weights())
    check_metrics(metrics, stats, updates=1, exact_ratio=True)
    assert stats["norms"][0] > 2 * MAX_NORM  # so the clipped runs really clip


def make_shared_batch() -> EpisodeBatch:
    """make_batch with each group's episodes on one prompt (its first episode's tokens), as generated."""
    batch = make_batch()
    for i in range(len(batch)):
        first = episodes_of(batch, [int(batch.prompt_index[i]) - 10])[0]
        batch.tokens[i, : int(batch.prompt_lens[i])] = batch.tokens[first, : int(batch.prompt_lens[i])]
    return batch


@pytest.mark.parametrize("micro_batch_tokens, minibatches, iterations", [
    (WHOLE, 1, 1),
    # 12 tokens: the groups of prompts 5 and 4 do not fit one micro-batch with their prompt once, and
    # are split, each part with the prompt again
    (SMALL, 1, 1),
    (SMALL, 2, 2),  # π_old's own pass over the shared layout, in frozen groups
])
def test_shared_prompts_match_reference(micro_batch_tokens, minibatches, iterations):
    """training.share_prompts: each group's prompt packed once as a prefix its episodes attend to;
    the step is the reference's, from one plain forward per sequence."""
    batch = make_shared_batch()
    with single_process_group():
        got, metrics = run_trainer(batch, 1, micro_batch_tokens, optim_config(), grpo_config(minibatches, iterations),
                                   share_prompts=True)
    groups = [[0, 1], [2, 3]] if minibatches == 2 else [[0, 1, 2, 3]]
    weights, stats = reference_run(batch, groups, iterations, optim_config())
    # A shared prompt's gradient is one sum over its episodes' attention, not one per episode: fp32
    # rounding in another order.
    assert_weights_close(got, weights, initial_weights(), atol=3 * ATOL)
    check_metrics(metrics, stats, updates=minibatches * iterations, exact_ratio=iterations == 1)
    plain = sum(int(n) - 1 for n in batch.seq_lens)
    once = plain - 2 * sum(p - 1 for p in PROMPT_LENS)  # each prompt but its last token once, not 3 times
    computed = metrics["train/tokens_computed"] / iterations
    assert computed == once if micro_batch_tokens == WHOLE else once < computed < plain


def test_single_process_micro_batches_match_reference(single, reference):
    weights, stats = reference["noclip"]
    got, metrics = single[(SMALL, 0.0, 1, 1)]
    assert_weights_close(got, weights)
    check_metrics(metrics, stats, updates=1, exact_ratio=True)


def test_single_process_clipped_matches_reference(single, reference):
    weights, stats = reference["clip"]
    for mbs in (WHOLE, SMALL):
        got, metrics = single[(mbs, MAX_NORM, 1, 1)]
        assert_weights_close(got, weights, initial_weights())
        check_metrics(metrics, stats, updates=1, exact_ratio=True)
    # clipping changed the step by far more than the tolerance
    noclip = reference["noclip"][0]
    assert max(float((weights[n] - noclip[n]).abs().max()) for n in weights) > 100 * ATOL


def test_two_ranks_match_single_process_reference(dist_results, reference):
    for scenario in ("noclip", "clip"):
        weights, stats = reference[scenario]
        for rank_results in dist_results:
            got, metrics = rank_result(rank_results, scenario)
            assert_weights_close(got, weights, initial_weights())
            check_metrics(metrics, stats, updates=1, exact_ratio=True)


def test_pi_old_held_fixed_over_minibatches_and_iterations(single, reference):
    # 2 minibatches x 2 passes = 4 optimizer steps, every ratio against the policy before the first
    weights, stats = reference["mb2_iters2"]
    got, metrics = single[(SMALL, 0.0, 2, 2)]
    assert stats["clipped"] > 0 and abs(stats["ratio"] / stats["tokens"] - 1) > 1e-3  # ratios do move
    assert_weights_close(got, weights, initial_weights())
    check_metrics(metrics, stats, updates=4)


def test_two_ranks_two_iterations_match_reference(dist_results, reference):
    weights, stats = reference["iters2"]
    assert stats["clipped"] > 0
    for rank_results in dist_results:
        got, metrics = rank_result(rank_results, "iters2_even")
        assert_weights_close(got, weights, initial_weights())
        check_metrics(metrics, stats, updates=2)


def test_two_ranks_uneven_micro_batches_with_pi_old_recompute(dist_results, reference):
    weights, stats = reference["iters2"]
    for rank_results in dist_results:
        got, metrics = rank_result(rank_results, "iters2_uneven")
        assert_weights_close(got, weights, initial_weights())
        check_metrics(metrics, stats, updates=2)


def test_single_process_minibatches_match_reference(single, reference):
    weights, stats = reference["mb2"]
    got, metrics = single[(WHOLE, 0.0, 2, 1)]
    assert_weights_close(got, weights, initial_weights())
    check_metrics(metrics, stats, updates=2)


def test_two_ranks_minibatches_match_single_process(dist_results, reference):
    weights, stats = reference["mb2"]
    for rank_results in dist_results:
        got, metrics = rank_result(rank_results, "minibatches2")
        assert_weights_close(got, weights, initial_weights())
        check_metrics(metrics, stats, updates=2)


def test_frozen_pass_packs_several_micro_batches_per_forward():
    """π_old's pass (2 iterations) with frozen_pass_tokens = 3 micro-batches: ceil(n / 3) forwards,
    and every micro-batch gets the log-probs of its own episodes, each as a plain forward of that
    episode alone gives them."""
    batch = make_batch()
    with single_process_group():
        mesh = init_device_mesh("cpu", (1,))
        trainer = Trainer(build_model(), mesh, torch.device("cpu"), torch.float32, grpo_config(num_iterations=2),
                          optim_config(), total_steps=10, micro_batch_tokens=SMALL, temperature=TEMPERATURE,
                          max_new_tokens=8, frozen_pass_tokens=3 * SMALL + 2)
        (micro_batches,) = trainer._micro_batches(batch)
        forward, widths = trainer._forward, []

        def counted(rows, model=None):
            widths.append(rows.tokens.shape[1])
            return forward(rows, model)

        trainer._forward = counted
        trainer._frozen_passes(micro_batches, recompute_old=True)
    assert len(micro_batches) > 3 and len(widths) == math.ceil(len(micro_batches) / 3)
    assert max(widths) > SMALL
    chunks = plan_micro_batches((batch.seq_lens - 1).tolist(), SMALL)
    model = build_model()
    with torch.no_grad():
        for mb, chunk in zip(micro_batches, chunks):
            rows = mb.rows
            assert mb.old_logprobs.shape == rows.tokens.shape
            for j, i in enumerate(chunk):
                picked = (rows.doc_ids == j) & (rows.loss_mask > 0)
                torch.testing.assert_close(mb.old_logprobs[picked], sequence_logprobs(model, batch, i),
                                           rtol=0, atol=1e-5)


