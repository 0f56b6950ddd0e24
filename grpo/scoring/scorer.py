"""Turn episodes into rewards: reward functions run in a CPU process pool with a timeout."""

import functools
import math
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo.config.sections import OnRewardError
from grpo.data.prompt import Prompt
from grpo.rollout.episode import EpisodeBatch
from grpo.scoring.calls import clip, load_reward, reward_name, score_chunk, warm_up
from grpo.scoring.pool import Outcome, PoolError, WorkerPool
from rewards import RewardError

ON_ERROR_MODES = typing.get_args(OnRewardError)


@dataclass
class ScoredRewards:
    total: torch.Tensor  # [N] float32, weighted sum over functions
    per_function: dict[str, torch.Tensor]  # name -> [N] float32, unweighted
    # name -> number of episodes scored 0.0 because the call failed (on_error="zero"; else all 0)
    errors: dict[str, int] = field(default_factory=dict)
    # name -> the first failure's message, for each function with errors
    first_errors: dict[str, str] = field(default_factory=dict)


def warn_zeroed(errors: dict[str, int], first_errors: dict[str, str], n: int) -> None:
    """One warning line on stderr per reward function that scored some of n episodes 0.0 (on_error="zero")."""
    for name, count in errors.items():
        if count:
            print(
                f"warning: reward function {name!r} failed on {count}/{n} episodes, scored 0.0 "
                f"(on_error='zero'); first: {clip(first_errors[name], 300)}",
                file=sys.stderr,
                flush=True,
            )


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

    Batched (``@rewards.batched``) functions get one call per chunk; async functions have a
    chunk's calls awaited concurrently (see ``rewards``).

    ``on_error="stop"`` (default): any failing call raises ``RewardError``. ``on_error="zero"``: an
    episode whose call raises or returns a non-number / non-finite value scores 0.0 for that
    function, and a chunk that times out scores 0.0 for all its episodes (chunks still pending
    after a timeout get one more ``timeout_s`` in all, then count as timed out too; a timed-out
    chunk's worker is killed, and a new pool serves the next call). A chunk whose worker dies
    (a crash in native code, a kill from outside) fails the same way, its message naming the exit
    status. Workers ignore SIGTERM: a running call is finished, not lost, when the job is being
    stopped (grpo/scoring/pool.py). ``ScoredRewards.errors`` counts the zeroed
    episodes per function, and each ``score`` call prints one warning line to stderr per function
    that had any. Configuration errors (a spec that does not load, a batched result of the wrong
    length) always raise.
    """

    def __init__(
        self,
        functions: list[str],
        weights: list[float],
        timeout_s: float,
        num_workers: int,
        on_error: str = "stop",
    ):
        if on_error not in ON_ERROR_MODES:
            raise ValueError(f"rewards: on_error must be one of {', '.join(map(repr, ON_ERROR_MODES))}, got {on_error!r}")
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
        self.on_error = on_error
        self._pool: WorkerPool | None = None
        if num_workers > 0:
            # Started now so the workers' start-up overlaps model setup.
            self._pool = self._new_pool()

    def _new_pool(self) -> WorkerPool:
        # Each worker warms its reward functions up as it starts, beside the model's set-up.
        return WorkerPool(self.num_workers, prepare=functools.partial(warm_up, tuple(self.specs)))

    def score(
        self, prompts: list[str], completions: list[str], answers: list[str], metadata: list[dict], warn: bool = True
    ) -> ScoredRewards:
        """Rewards of n episodes; `warn`: print warn_zeroed's lines for this call (a caller that
        scores a batch in several calls prints them once, for the whole batch)."""
        n = len(prompts)
        if not len(completions) == len(answers) == len(metadata) == n:
            raise ValueError(
                f"score: got {n} prompts, {len(completions)} completions, "
                f"{len(answers)} answers, {len(metadata)} metadata"
            )
        episodes = (prompts, completions, answers, metadata)
        self._errors = {name: 0 for name in self.names}
        self._first_error: dict[str, str] = {}
        if self.num_workers == 0:
            values = {
                name: self._unwrap(name, score_chunk(spec, 0, *episodes, self.on_error))
                for spec, name in zip(self.specs, self.names)
            }
        else:
            values = self._score_in_pool(episodes)
        per_function = {name: torch.tensor(values[name], dtype=torch.float32) for name in self.names}
        total = torch.zeros(n, dtype=torch.float32)
        for name, weight in zip(self.names, self.weights):
            total += weight * per_function[name]
        errors = dict(self._errors)
        if warn:
            warn_zeroed(errors, self._first_error, n)
        return ScoredRewards(total=total, per_function=per_function, errors=errors, first_errors=dict(self._first_error))

    def _unwrap(self, name: str, chunk: tuple[list[float], str | None, int, str | None]) -> list[float]:
        rewards, error, zeroed, first_error = chunk
        if error is not None:
            raise RewardError(error)
        if zeroed:
            self._errors[name] += zeroed
            self._first_error.setdefault(name, first_error)
        return rewards

    def _score_in_pool(self, episodes: tuple[list, list, list, list]) -> dict[str, list[float]]:
        if self._pool is None:  # stopped after a timeout or a dead worker
            self._pool = self._new_pool()
        n = len(episodes[0])
        bounds = [(n * k // self.num_workers, n * (k + 1) // self.num_workers) for k in range(self.num_workers)]
        tasks = [(name, start, end, (spec, start, *(column[start:end] for column in episodes), self.on_error))
                 for spec, name in zip(self.specs, self.names) for start, end in bounds if start < end]
        timed_out = []

        def on_timeout(i: int) -> bool:
            timed_out.append(i)
            return self.on_error == "zero"

        try:
            outcomes = self._pool.run(score_chunk, [args for *_, args in tasks], self.timeout_s, on_timeout)
        except PoolError as e:
            self.close()
            raise RewardError(str(e)) from None
        except BaseException:
            self.close()  # interrupted with tasks running (Ctrl-C): their workers are killed
            raise
        if not self._pool.healthy:
            self.close()  # a worker was killed or died; a new pool serves the next call
        if timed_out and self.on_error != "zero":
            # Named: the chunk that ran out of time, not one stopped with it.
            name, start, end, _ = tasks[timed_out[0]]
            self.close()
            raise RewardError(self._failure(name, start, end, outcomes[timed_out[0]]))
        values = {name: [] for name in self.names}
        for (name, start, end, _), outcome in zip(tasks, outcomes):
            if outcome.status == "ok":
                chunk = outcome.value
            else:
                message = self._failure(name, start, end, outcome)
                if self.on_error != "zero":
                    self.close()
                    raise RewardError(message)
                chunk = ([0.0] * (end - start), None, end - start, message)
            values[name].extend(self._unwrap(name, chunk))
        return values

    def _failure(self, name: str, start: int, end: int, outcome: Outcome) -> str:
        where = f"reward function {name!r}"
        episodes = f"episodes {start}-{end - 1}"
        if outcome.status == "timeout":
            return (
                f"{where} timed out after {self.timeout_s} s on {episodes} "
                "(the timeout bounds one chunk of episodes; its worker was killed)"
            )
        if outcome.status == "died":
            return f"{where} did not finish on {episodes}: {outcome.detail}"
        return f"{where} failed in its worker on {episodes}: {clip(outcome.detail, 300)}"

    def close(self) -> None:
        """Stop the workers: idle ones exit on the end-of-work message, busy ones are killed
        (grpo/scoring/pool.py)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "Scorer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def score_episodes(
    scorer: Scorer,
    episodes: EpisodeBatch,
    prompts: dict[int, Prompt],
    decode_batch: Callable[[list[list[int]]], list[str]],
    defaults: dict | None = None,
) -> dict[str, float]:
    """Fill episodes.rewards; returns each reward function's sum over these episodes (what each
    call sees: score_inputs)."""
    scored = scorer.score(*score_inputs(episodes, prompts, decode_batch, defaults))
    episodes.rewards = scored.total
    return {name: float(values.sum()) for name, values in scored.per_function.items()}


def score_inputs(
    episodes: EpisodeBatch,
    prompts: dict[int, Prompt],
    decode_batch: Callable[[list[list[int]]], list[str]],
    defaults: dict | None = None,
) -> tuple[list[str], list[str], list[str], list[dict]]:
    """What the reward functions see of each episode: (prompt texts, completion texts, answers, metadata).

    decode_batch: the text of each of a list of token id lists (Tokenizer.decode_batch), called once.
    defaults: metadata every reward call sees unless the prompt's own metadata overrides it
    (e.g. "format_pattern" for format_reward). Each call's metadata also holds "env_reward": the
    reward the episode's environment gave, None where it gave none (rewards.env_reward reads it).
    A multi-turn episode's completion is its last model turn (its final answer); its metadata's
    "conversation" holds everything after the prompt, environment turns included."""
    owners = [prompts[i] for i in episodes.prompt_index.tolist()]
    heard = [None if math.isnan(r) else r for r in episodes.env_rewards.tolist()]
    metadata = [{**(defaults or {}), **p.metadata, "env_reward": r} for p, r in zip(owners, heard)]
    completions = episodes.completions()
    # An episode ends with a model turn: one turn is the whole completion.
    multi_turn = [i for i, turns in enumerate(episodes.model_turns.tolist()) if turns > 1]
    last_turns = [[ids for sampled, ids in episodes.turns(i) if sampled][-1] for i in multi_turn]
    texts = decode_batch(completions + last_turns)
    for i, last_turn in zip(multi_turn, texts[len(completions):]):
        metadata[i]["conversation"] = texts[i]
        texts[i] = last_turn
    return [p.text for p in owners], texts[: len(completions)], [p.answer for p in owners], metadata
