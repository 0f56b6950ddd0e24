"""Turn episodes into rewards: reward functions run in a CPU process pool with a timeout."""

import multiprocessing
import multiprocessing.pool
from dataclasses import dataclass

import torch

from rewards import RewardError, load_reward, reward_name, score_episodes


@dataclass
class ScoredRewards:
    total: torch.Tensor  # [N] float32, weighted sum over functions
    per_function: dict[str, torch.Tensor]  # name -> [N] float32, unweighted


class Scorer:
    """Scores episodes with weighted reward functions (specs as accepted by ``load_reward``).

    With ``num_workers >= 1`` calls run in a pool of ``num_workers`` spawned processes, so a slow
    reward function cannot stall the training loop and a hung one is killed: each function's
    episodes are split into ``num_workers`` chunks, and ``timeout_s`` bounds each chunk call
    (one function on about N / num_workers episodes), not each episode.

    With ``num_workers == 0`` calls run in this process and ``timeout_s`` is NOT enforced: a hung
    reward function hangs training. Use it for debugging (breakpoints, tracebacks) and for
    reward functions known to be fast.

    Workers are spawned, so they re-import the launching script: it needs an
    ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, functions: list[str], weights: list[float], timeout_s: float, num_workers: int):
        if not functions:
            raise ValueError("rewards: at least one reward function is required")
        if len(weights) != len(functions):
            raise ValueError(f"rewards: {len(functions)} functions but {len(weights)} weights")
        if timeout_s <= 0:
            raise ValueError(f"rewards: timeout_s must be > 0, got {timeout_s}")
        if num_workers < 0:
            raise ValueError(f"rewards: num_workers must be >= 0, got {num_workers}")
        self.specs = list(functions)
        self.names = [reward_name(spec) for spec in functions]
        repeated = sorted({name for name in self.names if self.names.count(name) > 1})
        if repeated:
            raise ValueError(f"rewards: reward function names must be unique, repeated: {', '.join(repeated)}")
        # Loaded here so a bad spec fails before the pool and the model are built.
        for spec in self.specs:
            load_reward(spec)
        self.weights = [float(w) for w in weights]
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self._pool = None
        if num_workers > 0:
            # Started now so the workers' start-up overlaps model setup.
            self._pool = self._new_pool()

    def _new_pool(self) -> multiprocessing.pool.Pool:
        # spawn, not fork: forking a process that holds CUDA state or torch threads is unsafe.
        return multiprocessing.get_context("spawn").Pool(self.num_workers)

    def score(
        self, prompts: list[str], completions: list[str], answers: list[str], metadata: list[dict]
    ) -> ScoredRewards:
        n = len(prompts)
        if not len(completions) == len(answers) == len(metadata) == n:
            raise ValueError(
                f"score: got {n} prompts, {len(completions)} completions, "
                f"{len(answers)} answers, {len(metadata)} metadata"
            )
        episodes = (prompts, completions, answers, metadata)
        if self.num_workers == 0:
            values = {name: _unwrap(score_episodes(spec, 0, *episodes)) for spec, name in zip(self.specs, self.names)}
        else:
            values = self._score_in_pool(episodes)
        per_function = {name: torch.tensor(values[name], dtype=torch.float32) for name in self.names}
        total = torch.zeros(n, dtype=torch.float32)
        for name, weight in zip(self.names, self.weights):
            total += weight * per_function[name]
        return ScoredRewards(total=total, per_function=per_function)

    def _score_in_pool(self, episodes: tuple[list, list, list, list]) -> dict[str, list[float]]:
        if self._pool is None:  # terminated after a timeout
            self._pool = self._new_pool()
        n = len(episodes[0])
        bounds = [(n * k // self.num_workers, n * (k + 1) // self.num_workers) for k in range(self.num_workers)]
        # Submit every chunk first so all workers are busy, then collect in order.
        pending = []
        for spec, name in zip(self.specs, self.names):
            for start, end in bounds:
                if start < end:
                    args = (spec, start, *(column[start:end] for column in episodes))
                    pending.append((name, start, end, self._pool.apply_async(score_episodes, args)))
        values = {name: [] for name in self.names}
        for name, start, end, result in pending:
            try:
                chunk = result.get(self.timeout_s)
            except multiprocessing.TimeoutError:
                # A hung worker cannot be interrupted, only killed, and the pool goes with it.
                self.close()
                raise RewardError(
                    f"reward function {name!r} timed out after {self.timeout_s} s on episodes {start}-{end - 1} "
                    "(the timeout bounds one chunk of episodes; worker pool terminated)"
                ) from None
            values[name].extend(_unwrap(chunk))
        return values

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def __enter__(self) -> "Scorer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _unwrap(chunk: tuple[list[float], str | None]) -> list[float]:
    rewards, error = chunk
    if error is not None:
        raise RewardError(error)
    return rewards
