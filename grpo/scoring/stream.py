"""Rewards computed while the engine still decodes (rewards.overlap): the episodes each engine check
finds finished go to the reward workers from a host thread, so scoring no longer starts with the
batch's last completion and the reward workers no longer idle while the engine decodes.

The rewards are those of scoring the whole batch at once: each reward call sees the same inputs
(score_inputs); only the chunks episodes are grouped in differ, so a batched reward function gets
more, smaller calls. The warnings about zeroed episodes are printed once, for the whole batch.

The thread's host work (laying episodes out, decoding text, pickling the calls) holds the GIL. The
engine's host loop needs it back within a decode step (2-4 ms), but Python hands it over only every
`sys.getswitchinterval()` (5 ms by default): a stream shortens that interval until it is finished
or closed.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable

import torch

from grpo.data.prompt import Prompt
from grpo.engine import Completion
from grpo.rollout.episode import EpisodeBatch
from grpo.rollout.generate import episodes_from_completions
from grpo.scoring.scorer import Scorer, score_inputs, warn_zeroed
from rewards import RewardError

# How long a thread may hold the GIL while another waits for it, as long as a stream lives: well
# under a decode step.
STREAM_SWITCH_INTERVAL_S = 2e-4


class ScoringStream:
    """Scores the completions handed to `add` in a thread of its own; `finish` hands the rewards
    over. One stream serves one generate call."""

    def __init__(
        self, scorer: Scorer, prompts: dict[int, Prompt], decode_batch: Callable[[list[list[int]]], list[str]],
        defaults: dict, pad_id: int,
    ):
        """prompts: every prompt the completions may belong to, by index; decode_batch and defaults as
        score_inputs takes them; pad_id lays each call's episodes out (EpisodeBatch)."""
        self.scorer, self.prompts, self.defaults, self.pad_id = scorer, prompts, defaults, pad_id
        self.decode_batch = decode_batch
        self._queue: queue.SimpleQueue[list[Completion] | None] = queue.SimpleQueue()
        self._rewards: dict[tuple[int, int], float] = {}  # (prompt index, sample index) -> reward
        self._sums: dict[str, float] = {}
        self._errors: dict[str, int] = {}
        self._first_errors: dict[str, str] = {}
        self._scored = 0
        self._failure: BaseException | None = None
        self._stopping = False
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, STREAM_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._serve, name="scoring-stream", daemon=True)
        self._thread.start()

    def add(self, completions: list[Completion]) -> None:
        """Queue finished completions for scoring (an engine's on_finished); returns at once."""
        self._queue.put(list(completions))

    def finish(self, episodes: EpisodeBatch) -> tuple[dict[str, float], RewardError | None]:
        """Wait until everything added is scored, and write each episode's reward into
        episodes.rewards (matched by prompt and sample index). Returns (each reward function's sum
        over the episodes, or the RewardError that stopped scoring); any other error the thread met
        is raised here."""
        self._queue.put(None)
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)
        if isinstance(self._failure, RewardError):
            return {}, self._failure
        if self._failure is not None:
            raise self._failure
        keys = list(zip(episodes.prompt_index.tolist(), episodes.sample_index.tolist()))
        unscored = [key for key in keys if key not in self._rewards]
        if unscored or len(keys) != self._scored:
            raise RuntimeError(
                f"scoring during generation: {self._scored} completions were scored for {len(keys)} episodes; "
                f"unscored (prompt, sample): {unscored[:5]}"
            )
        warn_zeroed(self._errors, self._first_errors, self._scored)
        episodes.rewards = torch.tensor([self._rewards[key] for key in keys], dtype=torch.float32)
        return dict(self._sums), None

    def close(self) -> None:
        """Stop after the reward call in progress, if any (generation failed or was interrupted);
        waits for it at most one reward timeout and a little more."""
        self._stopping = True
        self._queue.put(None)
        self._thread.join(timeout=self.scorer.timeout_s + 5.0)
        sys.setswitchinterval(self._switch_interval)

    def _serve(self) -> None:
        """Score what is queued, everything queued meanwhile in the same call, until the end mark
        or the first failure."""
        try:
            ended = False
            while not ended and not self._stopping:
                batch: list[Completion] = []
                item = self._queue.get()
                while item is not None:
                    batch.extend(item)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                ended = item is None
                if batch and not self._stopping:
                    self._score(batch)
        except BaseException as error:  # handed to the caller by finish()
            self._failure = error

    def _score(self, completions: list[Completion]) -> None:
        episodes = episodes_from_completions(completions, self.pad_id)
        try:
            scored = self.scorer.score(*score_inputs(episodes, self.prompts, self.decode_batch, self.defaults), warn=False)
        except RewardError as error:
            raise RewardError(
                f"{error} (episode numbers count the {len(completions)} episodes scored together while generation ran; "
                "rewards.overlap)"
            ) from None
        keys = zip(episodes.prompt_index.tolist(), episodes.sample_index.tolist())
        self._rewards.update(zip(keys, scored.total.tolist()))
        for name, values in scored.per_function.items():
            self._sums[name] = self._sums.get(name, 0.0) + float(values.sum())
        for name, count in scored.errors.items():
            if count:
                self._errors[name] = self._errors.get(name, 0) + count
                self._first_errors.setdefault(name, f"{scored.first_errors[name]} (numbered within its scoring call)")
        self._scored += len(completions)
