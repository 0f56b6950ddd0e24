import multiprocessing
import os
import random
import re
import signal
import threading
import time

import pytest
import torch

from grpo.distributed import host
from grpo.scoring.calls import load_reward
from grpo.scoring.pool import auto_pool_size
from grpo.scoring.scorer import Scorer
from rewards import RewardError, digit_match

FIXTURES = "tests.fixtures.slow_rewards"


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("54321", "54321", 1.0),
        ("54320", "54321", 0.8),
        ("543210", "54321", 5 / 6),  # too long: 5 matches over 6 positions
        ("5432", "54321", 0.8),  # too short: 4 matches over 5 positions
        ("", "54321", 0.0),
        ("5x3y1", "54321", 0.6),
        ("abc", "321", 0.0),
        ("12345", "54321", 0.2),  # the prompt echoed back: only the middle digit matches
    ],
)
def test_digit_match(completion, answer, expected):
    assert digit_match(answer[::-1], completion, answer, {}) == pytest.approx(expected)


def test_prompt_ignoring_policies_score_at_most_a_tenth():
    rng = random.Random(0)
    prompts = ["".join(rng.choices("0123456789", k=rng.randint(3, 5))) for _ in range(4000)]
    policies = {
        "random digits, right length": lambda p: "".join(rng.choices("0123456789", k=len(p))),
        "00000": lambda p: "00000",
        "12345": lambda p: "12345",
        "000": lambda p: "000",
        "0": lambda p: "0",
        "empty": lambda p: "",
    }
    for name, policy in policies.items():
        mean = sum(digit_match(p, policy(p), p[::-1], {}) for p in prompts) / len(prompts)
        assert mean <= 0.15, f"policy {name!r} scores {mean:.3f} without reading the prompt"
    assert sum(digit_match(p, p[::-1], p[::-1], {}) for p in prompts) == len(prompts)


def test_scorer_combines_weighted_functions():
    prompts = ["12345", "12345", "12345", "123", "123"]
    completions = ["54321", "54320", "543210", "", "3x1"]
    answers = ["54321", "54321", "54321", "321", "321"]
    metadata = [{"score": 1.0}, {"score": 0.5}, {"score": 0.0}, {"score": 2}, {"score": -1.0}]
    expected_digits = [1.0, 0.8, 5 / 6, 0.0, 2 / 3]
    expected_total = [2 * d - 0.5 * m["score"] for d, m in zip(expected_digits, metadata)]
    functions = ["digit_match", f"{FIXTURES}:from_metadata"]

    results = {}
    for num_workers in (2, 0):  # 2 workers: two chunks per function, reassembled in order
        with Scorer(functions, [2.0, -0.5], timeout_s=30.0, num_workers=num_workers) as scorer:
            results[num_workers] = scorer.score(prompts, completions, answers, metadata)

    scored = results[2]
    assert list(scored.per_function) == ["digit_match", "from_metadata"]
    assert scored.total.dtype == torch.float32 and scored.total.shape == (5,)
    torch.testing.assert_close(scored.per_function["digit_match"], torch.tensor(expected_digits))
    torch.testing.assert_close(scored.per_function["from_metadata"], torch.tensor([1.0, 0.5, 0.0, 2.0, -1.0]))
    torch.testing.assert_close(scored.total, torch.tensor(expected_total))
    assert torch.equal(results[0].total, scored.total)
    for name in functions[:1] + ["from_metadata"]:
        assert torch.equal(results[0].per_function[name], scored.per_function[name])


def test_raising_function_names_function_episode_and_exception():
    completions = ["a", "b", "c", "bad", "d"]
    with Scorer([f"{FIXTURES}:boom"], [1.0], timeout_s=30.0, num_workers=2) as scorer:
        with pytest.raises(RewardError) as error:
            scorer.score(["0", "1", "2", "3", "4"], completions, [""] * 5, [{}] * 5)
    assert str(error.value) == (
        "reward function 'boom' raised ValueError('boom') on episode 3 (prompt '3', completion 'bad')"
    )


@pytest.mark.parametrize(
    "function, returned",
    [("not_a_number", "returned 'x' (str)"), ("nan_reward", "returned nan (float)")],
)
def test_bad_return_value(function, returned):
    long_prompt = "7" * 100
    with Scorer([f"{FIXTURES}:{function}"], [1.0], timeout_s=30.0, num_workers=0) as scorer:
        with pytest.raises(RewardError) as error:
            scorer.score([long_prompt], ["1"], [""], [{}])
    message = str(error.value)
    assert message.startswith(f"reward function {function!r} {returned} on episode 0 (prompt '777")
    assert "7" * 70 not in message  # prompt clipped
    assert message.endswith("completion '1'); expected a finite number")


def test_hanging_function_times_out_and_workers_die():
    children_before = set(multiprocessing.active_children())
    scorer = Scorer([f"{FIXTURES}:hang"], [1.0], timeout_s=0.5, num_workers=2)
    start = time.monotonic()
    with pytest.raises(RewardError, match=re.escape("reward function 'hang' timed out after 0.5 s on episodes 0-1")):
        scorer.score(["1", "2", "3", "4"], ["1", "2", "3", "4"], [""] * 4, [{}] * 4)
    assert time.monotonic() - start < 0.5 + 2
    start = time.monotonic()
    scorer.close()
    assert time.monotonic() - start < 2
    assert set(multiprocessing.active_children()) <= children_before


def test_idle_workers_outlive_a_sigterm_from_outside():
    """Slurm signals every process of a job step, the rank's reward workers too; the rank, not its
    workers, decides when to stop. Idle workers ignore that SIGTERM: the pool scores on, and
    close() still stops every worker promptly."""
    children_before = set(multiprocessing.active_children())
    scorer = Scorer(["digit_match"], [1.0], timeout_s=5.0, num_workers=2)
    batch = (["1", "2", "3", "4"], ["1", "5", "3", "4"], ["1", "2", "3", "4"], [{}] * 4)
    first = scorer.score(*batch).total
    workers = [p for p in multiprocessing.active_children() if p not in children_before]
    assert len(workers) == 2
    for worker in workers:
        os.kill(worker.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert all(worker.is_alive() for worker in workers)
    assert torch.equal(scorer.score(*batch).total, first)
    start = time.monotonic()
    scorer.close()
    assert time.monotonic() - start < 5
    assert set(multiprocessing.active_children()) <= children_before


def test_a_sigterm_during_a_reward_call_does_not_lose_the_call(tmp_path, monkeypatch):
    """The call running when the job is told to stop finishes and its rewards arrive: the rank
    completes its step and saves it."""
    pid_file = tmp_path / "busy"
    monkeypatch.setenv("BUSY_PID_FILE", str(pid_file))
    with Scorer([f"{FIXTURES}:record_then_sleep"], [1.0], timeout_s=30.0, num_workers=2) as scorer:
        signalled = []

        def signal_busy_workers():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(signalled) < 2:
                pids = {int(p) for p in pid_file.read_text().split()} if pid_file.exists() else set()
                for pid in pids - set(signalled):
                    os.kill(pid, signal.SIGTERM)
                    signalled.append(pid)
                time.sleep(0.02)

        signaller = threading.Thread(target=signal_busy_workers)
        signaller.start()
        scored = scorer.score(["1", "2"], ["1", "2"], ["1", "2"], [{}] * 2)
        signaller.join()
    assert len(signalled) == 2
    assert torch.equal(scored.total, torch.ones(2))


def test_each_worker_runs_the_functions_warm_up_once_before_scoring():
    """A reward function's warm_up runs in every pool worker as it starts, before its first episode."""
    with Scorer([f"{FIXTURES}:warmed"], [1.0], timeout_s=30.0, num_workers=2) as scorer:
        batch = (["1", "2", "3", "4"], ["a", "b", "c", "d"], [""] * 4, [{}] * 4)
        assert torch.equal(scorer.score(*batch).total, torch.ones(4))
        assert torch.equal(scorer.score(*batch).total, torch.ones(4))  # not run again


def test_a_failing_warm_up_leaves_the_function_working():
    with Scorer([f"{FIXTURES}:cold_but_fine"], [1.0], timeout_s=30.0, num_workers=2) as scorer:
        scored = scorer.score(["1", "2"], ["a", "b"], [""] * 2, [{}] * 2)
    assert torch.equal(scored.total, torch.ones(2)) and scored.errors == {"cold_but_fine": 0}


def test_a_worker_that_dies_fails_its_chunk_at_once_and_the_next_call_works():
    with Scorer([f"{FIXTURES}:die_on_die"], [1.0], timeout_s=60.0, num_workers=2) as scorer:
        start = time.monotonic()
        with pytest.raises(RewardError, match=re.escape("reward function 'die_on_die' did not finish on episodes 2-3: "
                                                        "the worker (pid ") + r"\d+\) died \(exit code 3\)$"):
            scorer.score(["0", "1", "2", "3"], ["a", "b", "c", "die"], [""] * 4, [{}] * 4)
        assert time.monotonic() - start < 30  # not the 60 s timeout
        scored = scorer.score(["0", "1", "2", "3"], ["a", "b", "c", "d"], [""] * 4, [{}] * 4)
    assert torch.equal(scored.total, torch.ones(4))


def test_on_error_zero_scores_a_dead_workers_chunk_zero(capsys):
    with Scorer([f"{FIXTURES}:die_on_die"], [1.0], timeout_s=60.0, num_workers=2, on_error="zero") as scorer:
        scored = scorer.score(["0", "1", "2", "3"], ["die", "b", "c", "d"], [""] * 4, [{}] * 4)
    assert torch.equal(scored.total, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert scored.errors == {"die_on_die": 2}
    assert "died (exit code 3)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuchmodule:f", "reward function 'nosuchmodule:f': cannot import module 'nosuchmodule' "
                           "(No module named 'nosuchmodule')"),
        (f"{FIXTURES}:missing", f"reward function '{FIXTURES}:missing': module '{FIXTURES}' "
                                "has no attribute 'missing'"),
        (f"{FIXTURES}:NOT_CALLABLE", f"reward function '{FIXTURES}:NOT_CALLABLE': "
                                     "'NOT_CALLABLE' is not callable (int)"),
        (f"{FIXTURES}:two_args", f"reward function '{FIXTURES}:two_args': signature (prompt: str, completion: str) "
                                 "-> float does not accept (prompt, completion, answer, metadata)"),
        ("digit_matc", "unknown reward function 'digit_matc'; built-ins: digit_match, env_reward, format_reward, "
                       "length_penalty, math_accuracy, reasoning_gym (or give 'module:function')"),
        (":f", "reward function ':f': expected 'module:function'"),
    ],
)
def test_bad_spec_fails_at_construction(spec, message):
    with pytest.raises(RewardError, match=f"^{re.escape(message)}$"):
        load_reward(spec)
    with pytest.raises(RewardError, match=f"^{re.escape(message)}$"):
        Scorer(["digit_match", spec], [1.0, 1.0], timeout_s=1.0, num_workers=1)


@pytest.mark.parametrize(
    "cores, local_ranks, expected",
    [
        (2, 1, 1),  # a 2-core machine: one worker, the rank's dispatch on the other core
        (1, 4, 1),  # fewer cores than ranks: still one
        (16, 1, 15),  # one GPU's host: every core but the rank's own
        (16, 4, 3),  # 4 ranks share 16 cores: 4 each, one of them the rank's
        (128, 8, 15),
        (256, 2, 16),  # capped
    ],
)
def test_a_rank_that_waits_for_its_pool_leaves_it_its_share_of_the_cores_but_one(cores, local_ranks, expected):
    assert auto_pool_size(cores, local_ranks) == expected


@pytest.mark.parametrize(
    "cores, local_ranks, expected",
    [(2, 1, 1), (1, 4, 1), (16, 1, 8), (16, 4, 2), (128, 8, 8), (256, 2, 8)],
)
def test_an_engine_beside_the_pool_keeps_half_of_the_share(cores, local_ranks, expected):
    assert auto_pool_size(cores, local_ranks, engine_beside=True) == expected


@pytest.mark.parametrize(
    "overrides, split, expected",
    [
        ([], False, 15),  # colocated, sync: the rank waits while its pool scores
        (["--training.schedule=async"], False, 8),  # its engine generates meanwhile
        (["--rewards.overlap=true"], False, 8),
        (["--rewards.overlap=true"], True, 15),  # trainers score what they receive, after generation
        (["--training.schedule=async"], True, 15),  # split roles: a trainer rank has no engine
        (["--rewards.num_workers=3"], False, 3),
    ],
)
def test_the_run_sizes_its_pool_by_what_the_rank_does_while_it_scores(overrides, split, expected, monkeypatch):
    import train_grpo
    from grpo.config import load_config

    monkeypatch.setattr(host, "usable_cores", lambda: list(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert train_grpo.reward_pool_size(load_config(overrides, world_size=2), split) == expected


def test_multi_turn_episodes_are_scored_after_generation_by_the_larger_pool(monkeypatch):
    import train_grpo
    from grpo.config import load_config

    monkeypatch.setattr(host, "usable_cores", lambda: list(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = load_config(["--rewards.overlap=true"], world_size=2)
    assert train_grpo.reward_pool_size(cfg, split=False) == 8
    cfg.env.name = "calculator"  # set after loading: the checks would ask for a chat checkpoint
    assert train_grpo.reward_pool_size(cfg, split=False) == 15


def test_the_automatic_pool_size_reads_the_cores_and_torchruns_local_ranks(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert auto_pool_size() == max(1, min(16, cores - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
    assert auto_pool_size() == 1
